"""Benchmarks of anarchon: ``python -m bench --help``."""
