"""Benchmark scripts (run as files: ``python benchmarks/X.py``) and the HF twin they share with the tests."""
