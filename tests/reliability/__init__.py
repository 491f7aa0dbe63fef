"""The reliability suite (issue 10): bad inputs and injected faults, counted.

See RELIABILITY.md at the repository root and `harness.py` for how cases are counted.
"""
