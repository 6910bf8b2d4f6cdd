"""Run a benchmark's worker function on spawned gloo processes and read back rank 0's JSON."""

from __future__ import annotations

import json
import os
import socket
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any


def run_workers_json(worker: Callable[..., None], workers: int, args: Any) -> Any:
    """``worker(rank, world, port, args, out)`` on ``workers`` spawned processes; the JSON that
    rank 0 wrote to the path ``out``."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "result.json")
        mp.start_processes(
            worker, args=(workers, port, args, out), nprocs=workers, join=True, start_method="spawn"
        )
        return json.loads(Path(out).read_text())
