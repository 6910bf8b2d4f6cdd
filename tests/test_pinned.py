"""Bit-for-bit pins: the engine's arithmetic must not move when its code is reorganised.

Most tests compare against references within a tolerance, which a reordered float sum would
pass. These pin a SHA-256 of everything a short run ends with (the published model and every
tensor and counter of ``sync.state_dict()``) for each preset and the engine's main variants,
on 2 gloo workers with a fixed seed.

The digests hold for one torch build and one CPU kernel set: they are recorded per
``torch.backends.cpu.get_cpu_capability()`` and the test skips (saying so) on a machine whose
kernels were never recorded. To record a new machine, run this file with
``LOWCOMM_PRINT_PINS=1`` on a commit known to be right and add the printed digests.

The second test resumes checkpoints written by the trainer at commit 5f0fff9 (before the
engine became a package): the on-disk layout is a contract.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import adamw, batches, tiny_model

import lowcomm

# name -> (preset, keyword arguments, inner steps, blocks the steps are split into). Tuned
# preset values (outer lr, co2_keep) are spelled out: the pins fix the engine, not the tuning.
CASES: dict[str, tuple[str, dict, int, int]] = {
    "diloco": ("DiLoCo", {"sync_every": 4}, 14, 1),
    "diloco_two_blocks_int8": ("DiLoCo", {"sync_every": 4, "codec": "int8"}, 14, 2),
    "diloco_two_phase_ef": (
        "DiLoCo",
        {"sync_every": 4, "codec": "int4", "reduce": "two-phase", "compensation": "ef"},
        13,
        1,
    ),
    "streaming": (
        "StreamingDiLoCo",
        {"sync_every": 8, "blocks_per_fragment": 1, "outer_lr": 0.7},
        21,
        1,
    ),
    "streaming_continue": (
        "StreamingDiLoCo",
        {"sync_every": 8, "fragments": 2, "overlap": 2, "merge": "continue", "outer_lr": 0.7},
        21,
        2,
    ),
    # the exit rule of a fragment whose last result lands after its last inner step
    "streaming_alpha0_drained": (
        "StreamingDiLoCo",
        {"sync_every": 8, "fragments": 2, "overlap": 2, "alpha": 0.0, "outer_lr": 0.7},
        25,
        1,
    ),
    "streaming_alpha0_landed": (
        "StreamingDiLoCo",
        {"sync_every": 6, "fragments": 2, "overlap": 2, "alpha": 0.0, "outer_lr": 0.7},
        14,
        1,
    ),
    "sparseloco": ("SparseLoCo", {"sync_every": 4}, 14, 2),
    "co2": ("CO2", {"sync_every": 4, "co2_keep": 0.75}, 14, 2),
    "co2_reset_penalty": (
        "CO2",
        {"sync_every": 4, "co2_merge": "reset", "staleness_penalty": True, "momentum_clip": 1.0},
        13,
        1,
    ),
}

# cpu capability -> case -> digest (recorded at commit 5f0fff9, torch 2.13.0+cpu)
PINS: dict[str, dict[str, str]] = {
    "AVX512": {
        "diloco": "ce4c7e9598bf7bf09cf79d37500d5cdc",
        "diloco_two_blocks_int8": "7cd5c1ccd1709d515f6b48a490e43e7a",
        "diloco_two_phase_ef": "6a5744b0653e257c6239da87ca01eb73",
        "streaming": "662d5fef964b352929bb634b4e370576",
        "streaming_continue": "c67dea5e6d33914bf70bda9f144256a2",
        "streaming_alpha0_drained": "df32ee3f58a29f90902edc24cc756f24",
        "streaming_alpha0_landed": "69c551d9f795b1457451eac8abc82912",
        "sparseloco": "3bd694c2ea62efa8215ab2e5e9a2b98b",
        "co2": "df4b6f6ee757f56ad5304b6b1ac8f153",
        "co2_reset_penalty": "78b7305a619667c9edf95e2a08d6a89d",
    }
}


def _digest(model: torch.nn.Module, sd: dict) -> str:
    h = hashlib.sha256()

    def feed(x, path: str) -> None:
        if isinstance(x, torch.Tensor):
            h.update(path.encode())
            h.update(x.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        elif isinstance(x, dict):
            for k in sorted(x, key=str):
                feed(x[k], f"{path}/{k}")
        elif isinstance(x, (list, tuple)):
            for i, v in enumerate(x):
                feed(v, f"{path}/{i}")
        elif isinstance(x, (bool, int, str)) or x is None:
            h.update(f"{path}={x!r}".encode())
        # floats in the state are timings and meters: not part of the arithmetic

    feed(dict(model.state_dict()), "model")
    feed({k: v for k, v in sd.items() if k not in ("stats", "meter")}, "engine")
    return h.hexdigest()[:32]  # 128 bits


def _run_cases(rank: int, world: int) -> dict[str, str]:
    out = {}
    for name, (preset, kw, steps, blocks) in CASES.items():
        model = tiny_model(seed=0)
        opt = adamw(model)
        data = batches(rank, world)
        sync = getattr(lowcomm, preset)(model, opt, **kw)
        per_block = -(-steps // blocks)
        done = 0
        while done < steps:
            with sync:
                for _ in range(min(per_block, steps - done)):
                    x, y = data.next()
                    model(x, y).backward()
                    opt.step()
                    opt.zero_grad()
                    done += 1
        out[name] = _digest(model, sync.state_dict())
    return out


def test_every_case_ends_bit_identical_to_its_pin(workers):
    capability = torch.backends.cpu.get_cpu_capability()
    got = workers(_run_cases, 2)
    if os.environ.get("LOWCOMM_PRINT_PINS"):
        print(json.dumps({capability: got[0]}, indent=2))
    pins = PINS.get(capability)
    if pins is None:
        pytest.skip(f"no digests recorded for CPU capability {capability} (see module doc)")
    assert got[0].keys() == pins.keys()
    wrong = [n for n in pins if got[0][n] != pins[n]]
    assert not wrong, f"cases no longer bit-identical to their pins: {wrong}"


V0 = Path(__file__).parent / "data" / "checkpoints_v0"


# by hand (-m slow): streaming and sparseloco (the same loader as co2's, other parts)
@pytest.mark.parametrize(
    "strategy",
    [
        pytest.param("streaming", marks=pytest.mark.slow),
        "co2",
        pytest.param("sparseloco", marks=pytest.mark.slow),
    ],
)
def test_checkpoint_from_before_the_engine_split_resumes_bit_identically(tmp_path, strategy):
    """A run saved at step 8 of 24 by commit 5f0fff9 resumes to that commit's own final model
    (``<strategy>.model.pt``, from the same run left uninterrupted)."""
    if torch.backends.cpu.get_cpu_capability() != "AVX512":
        pytest.skip("the saved runs were computed with AVX512 kernels")
    run = tmp_path / strategy
    shutil.copytree(V0 / strategy, run)
    done = subprocess.run(
        [sys.executable, "-m", "lowcomm.cli", "train", "--resume", str(run)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    resumed = torch.load(run / "model.pt", weights_only=True)
    expected = torch.load(V0 / f"{strategy}.model.pt", weights_only=True)
    assert resumed.keys() == expected.keys()
    for k in expected:
        assert torch.equal(resumed[k], expected[k]), k
