"""Benchmarks of autopar; ``python -m benchmarks`` regenerates BENCHMARKS.md (see __main__)."""
