"""Benchmarks of vlmrl against raw baselines; run as ``python -m benchmarks.step``."""
