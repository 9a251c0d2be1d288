from fastgrpo.cli import entry

raise SystemExit(entry())
