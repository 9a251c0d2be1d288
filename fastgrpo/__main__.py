from fastgrpo.cli import main

raise SystemExit(main())
