"""One-off tuning, profiling, A/B and spike scripts behind decisions recorded in
`benchmarks/HISTORY.md`; run each as `python -m benchmarks.lab.<name>` from the repository root.
"""
