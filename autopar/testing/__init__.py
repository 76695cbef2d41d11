"""Helpers for running autopar on several local processes (tests, demo, benchmarks)."""
