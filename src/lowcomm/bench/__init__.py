"""Benchmarks: ``lowcomm compare`` (strategies side by side, optionally over kernel-shaped links),
the shaped links themselves (netshape/), and codec, sync-cost and overhead microbenchmarks."""
