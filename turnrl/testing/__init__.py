"""Harnesses for tests and benchmarks, not runtime code: engines and envs with controllable latency
(latency.py) and fault injection (faults.py)."""
