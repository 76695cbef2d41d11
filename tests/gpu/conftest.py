"""Scripts for a lent GPU machine, run by hand (``python tests/gpu/check_nccl.py``): never
collected by pytest, so the CPU test suite cannot start them."""

collect_ignore_glob = ["*.py"]
