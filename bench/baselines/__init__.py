"""Baselines the benchmark compares ucmcache with (never imported by ucmcache)."""
