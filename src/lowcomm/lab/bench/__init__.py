"""Benchmarks: ``lowcomm compare`` (strategies side by side, optionally over kernel-shaped links
from :mod:`lowcomm.lab.netshape`), and codec, sync-cost, overhead, chaos, heal and straggler
benchmarks."""
