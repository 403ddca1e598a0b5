"""Benchmarks: `mtplxd bench` (decode.py, serve.py, sessions.py) and the engine's cycle and row timings."""
