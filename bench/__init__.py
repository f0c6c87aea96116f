"""ucmcache benchmarks: see bench/run.py (python -m bench.run --help)."""
