"""Bit-for-bit pins: the engine's arithmetic must not move when its code is reorganised.

Most tests compare against references within a tolerance, which a reordered float sum would
pass. These pin a SHA-256 of everything a short run ends with (the published model and every
tensor and counter of ``sync.state_dict()``) for each preset and the engine's main variants,
on 2 gloo workers with a fixed seed. Each case runs twice, with two kinds of inner step:

- **elementwise** inner steps: parameters set from integers and gradients written by
  elementwise arithmetic on integer-drawn targets and noise, then AdamW. No BLAS, no oneDNN:
  only ATen's own kernels, which are the same code on every CPU that runs the same kernel set
  (``torch.backends.cpu.get_cpu_capability()``: AVX512, AVX2 or DEFAULT). These pins are keyed
  by torch version and capability, and all three capabilities are recorded, so they hold on
  any x86-64 CPU, Intel or AMD: they are the guard that always runs.
- **model** inner steps: the tiny transformer's forward and backward, whose matrix products go
  through MKL and oneDNN, which choose other kernels (and so other bits) by CPU vendor and
  model. These pins are keyed by a *measured* fingerprint of those kernels (the digest of a
  short plain-torch AdamW run on ``tiny``); on a machine whose fingerprint has no record the
  test instead checks that every case repeats bit for bit, and says so.

To record a machine, run this file on a commit known to be right with ``LOWCOMM_PRINT_PINS=1``
(and ``-s``), once per kernel set (``ATEN_CPU_CAPABILITY=avx2`` or ``default`` forces the
others), and add the printed digests. docs/testing.md says what the pins guarantee.

The last tests resume checkpoints written by the trainer at commit 5f0fff9 (before the engine
became a package): the on-disk layout is a contract.
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
from conftest import run_workers
from helpers import adamw, batches, local_steps, tiny_model

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

# "torch version/capability" -> case -> digest, elementwise inner steps (recorded at b49c41a on
# an Intel Xeon with ATEN_CPU_CAPABILITY forced to each kernel set; MKL held to its AVX2, SSE4.2
# and compatible paths gave the same digests, as an AMD machine's MKL would). ATen's AVX2 and
# AVX-512 kernels give the same bits for these cases.
_VECTORIZED = {
    "diloco": "905f9fdab7d4cdb0fd720c26b1471a7f",
    "diloco_two_blocks_int8": "a06ee520d88538287a96691841c719db",
    "diloco_two_phase_ef": "1c420812ce580d0cd1d1a2754556776f",
    "streaming": "4d3410cee5996d052504ee88a1e72e7d",
    "streaming_continue": "196d9c5413d4b6f1dc486678ca929544",
    "streaming_alpha0_drained": "adb97b2fd249dbb01a9703f02dadde90",
    "streaming_alpha0_landed": "fc5800e699c871661f65230e870e8b6f",
    "sparseloco": "031a07cdb17708be78e167610e57a0e8",
    "co2": "72fc6c74dd24388c067a96eb54761274",
    "co2_reset_penalty": "8f8b89ab80102f462f39db1339632a50",
}
ELEMENTWISE_PINS: dict[str, dict[str, str]] = {
    "2.13.0+cpu/AVX512": _VECTORIZED,
    "2.13.0+cpu/AVX2": _VECTORIZED,
    "2.13.0+cpu/DEFAULT": {
        "diloco": "4c07b9eeb05181d2db40b126e3407a21",
        "diloco_two_blocks_int8": "a53bc11fe6abbc428d68ac10e837d3ef",
        "diloco_two_phase_ef": "dbaaaddc95d22efe197be7a4c9c62f7f",
        "streaming": "c868694582063d779896ad0caee327af",
        "streaming_continue": "0345082c607fe468656d17bc08e64b35",
        "streaming_alpha0_drained": "0b0b2e8762d711f944435dc4c49d2eb7",
        "streaming_alpha0_landed": "4ebbf1ab57b98370509c44e71097df47",
        "sparseloco": "46e1a0d1878e5ddc39e17db41f94aa57",
        "co2": "5678ce32610ce99eff30a1be3e00998f",
        "co2_reset_penalty": "e78379602bf57ab304f008c6a3905bea",
    },
}

# "torch version/capability/kernel fingerprint" -> case -> digest, model inner steps (recorded
# at 5f0fff9 on an Intel Xeon; the fingerprint was measured on the same kind of machine)
MODEL_PINS: dict[str, dict[str, str]] = {
    "2.13.0+cpu/AVX512/0bef455440b93bbc": {
        "diloco": "ce4c7e9598bf7bf09cf79d37500d5cdc",
        "diloco_two_blocks_int8": "7cd5c1ccd1709d515f6b48a490e43e7a",
        "diloco_two_phase_ef": "6a5744b0653e257c6239da87ca01eb73",
        "streaming": "662d5fef964b352929bb634b4e370576",
        "streaming_continue": "c67dea5e6d33914bf70bda9f144256a2",
        "streaming_alpha0_drained": "df32ee3f58a29f90902edc24cc756f24",
        "streaming_alpha0_landed": "69c551d9f795b1457451eac8abc82912",
        "sparseloco": "57cf40b93733af462d2f8360913403db",
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


def kernel_fingerprint() -> str:
    """Which matrix kernels this process runs: the digest of three plain-torch AdamW steps of
    ``tiny`` on one thread (MKL and oneDNN pick theirs by CPU vendor and model)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = tiny_model(seed=0)
        local_steps(model, adamw(model), batches(0, 1), 3)
        return _digest(model, {})[:16]
    finally:
        torch.set_num_threads(threads)


def machine_key(fingerprint: str | None = None) -> str:
    """``torch version/capability`` (elementwise pins), ``/fingerprint`` appended (model pins)."""
    key = f"{torch.__version__}/{torch.backends.cpu.get_cpu_capability()}"
    return key if fingerprint is None else f"{key}/{fingerprint}"


class Elementwise:
    """Inner steps with no BLAS: integer-drawn starting weights, per-site targets and per-step
    noise (mt19937 integers, the same on every CPU), gradients by elementwise arithmetic."""

    def __init__(self, model: torch.nn.Module, rank: int) -> None:
        self.params = list(model.parameters())
        self.gen = torch.Generator().manual_seed(1 + rank)
        start = torch.Generator().manual_seed(0)  # every site starts from the same weights
        with torch.no_grad():
            for p in self.params:
                p.copy_(self._draw(p, start, 256))
        self.targets = [self._draw(p, self.gen, 64) for p in self.params]

    @staticmethod
    def _draw(p: torch.Tensor, gen: torch.Generator, scale: int) -> torch.Tensor:
        return torch.randint(-64, 65, p.shape, generator=gen).to(p.dtype) / scale

    def optimizer(self) -> torch.optim.Optimizer:
        """SGD with momentum: AdamW's square root goes through MKL's vector math, whose bits
        differ between its AVX2 and AVX-512 paths (and so between AMD and Intel)."""
        return torch.optim.SGD(self.params, lr=0.05, momentum=0.9, weight_decay=0.01)

    def backward(self) -> None:
        for p, t in zip(self.params, self.targets):
            noise = self._draw(p, self.gen, 256)
            p.grad = (p.detach() - t) * 0.5 + noise


def _run_case(rank: int, world: int, name: str, elementwise: bool) -> str:
    preset, kw, steps, blocks = CASES[name]
    model = tiny_model(seed=0)
    synthetic = Elementwise(model, rank) if elementwise else None
    opt = synthetic.optimizer() if synthetic is not None else adamw(model)
    data = batches(rank, world)
    sync = getattr(lowcomm, preset)(model, opt, **kw)
    per_block = -(-steps // blocks)
    done = 0
    while done < steps:
        with sync:
            for _ in range(min(per_block, steps - done)):
                if synthetic is not None:
                    synthetic.backward()
                else:
                    x, y = data.next()
                    model(x, y).backward()
                opt.step()
                opt.zero_grad()
                done += 1
    return _digest(model, sync.state_dict())


def _run_all(rank: int, world: int, repeat_model: bool) -> dict:
    out = {
        "fingerprint": kernel_fingerprint(),
        "elementwise": {n: _run_case(rank, world, n, True) for n in CASES},
        "model": {n: _run_case(rank, world, n, False) for n in CASES},
    }
    if repeat_model:  # no record to compare with: the run must at least repeat itself
        out["model_again"] = {n: _run_case(rank, world, n, False) for n in CASES}
    return out


@pytest.fixture(scope="module")
def pinned_runs(tmp_path_factory) -> dict:
    """Every case, both kinds of inner step, on 2 gloo workers (one spawn for the module)."""
    known = {k.rsplit("/", 1)[1] for k in MODEL_PINS if k.startswith(machine_key() + "/")}
    repeat = kernel_fingerprint() not in known
    # rank 0's: its per-site state (local weights, error buffers) is its own
    res = run_workers(_run_all, 2, repeat, tmp_path=tmp_path_factory.mktemp("pinned"))[0]
    if os.environ.get("LOWCOMM_PRINT_PINS"):
        print(json.dumps({machine_key(): res["elementwise"]}, indent=4))
        print(json.dumps({machine_key(res["fingerprint"]): res["model"]}, indent=4))
    return res


def _wrong(got: dict[str, str], pins: dict[str, str]) -> list[str]:
    assert got.keys() == pins.keys()
    return [n for n in pins if got[n] != pins[n]]


def test_engine_arithmetic_is_bit_identical_to_its_pin_on_any_cpu(pinned_runs):
    pins = ELEMENTWISE_PINS.get(machine_key())
    if pins is None:
        pytest.skip(f"no elementwise digests recorded for {machine_key()} (see module doc)")
    wrong = _wrong(pinned_runs["elementwise"], pins)
    assert not wrong, f"cases no longer bit-identical to their pins: {wrong}"


def test_model_cases_match_their_pin_or_repeat_bit_for_bit(pinned_runs):
    """Where this machine's kernels were recorded, the real model's cases match the record;
    elsewhere they must repeat exactly (the only thing knowable there)."""
    key = machine_key(pinned_runs["fingerprint"])
    pins = MODEL_PINS.get(key)
    if pins is None:
        print(f"no model digests for {key}: checked that every case repeats bit for bit")
        assert pinned_runs["model_again"] == pinned_runs["model"]
        return
    wrong = _wrong(pinned_runs["model"], pins)
    assert not wrong, f"cases no longer bit-identical to their pins: {wrong}"


V0 = Path(__file__).parent / "data" / "checkpoints_v0"
# the kernels the saved runs' final models were computed with (machine_key(fingerprint))
V0_KERNELS = {"2.13.0+cpu/AVX512/0bef455440b93bbc"}


def _resume(run: Path) -> dict[str, torch.Tensor]:
    done = subprocess.run(
        [sys.executable, "-m", "lowcomm.cli", "train", "--resume", str(run)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    return torch.load(run / "model.pt", weights_only=True)


def _leaves(x, path: str = "") -> set[str]:
    """Every key path of a saved state down to its leaves (a list's items by position)."""
    if isinstance(x, dict):
        return {p for k, v in x.items() for p in _leaves(v, f"{path}/{k}")} or {path}
    if isinstance(x, (list, tuple)) and any(isinstance(v, (dict, list, tuple)) for v in x):
        return {p for i, v in enumerate(x) for p in _leaves(v, f"{path}/{i}")}
    return {path}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in b:
        assert torch.equal(a[k], b[k]), k


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
    """A run saved at step 8 of 24 by commit 5f0fff9 resumes: every key of its layout is one
    today's trainer keeps (the engine's loader refuses keys it does not read). Where this
    machine runs the kernels the saved run was computed with, it ends in that commit's own
    final model (``<strategy>.model.pt``, from the same run left uninterrupted); elsewhere,
    resumed again from the step-16 checkpoint it wrote, it ends in the same bits. (SparseLoCo's
    final model is the resume's since one sync path computed its 2-bit table's statistics by
    segment sums: its arithmetic, not its checkpoint, changed.)"""
    straight = tmp_path / "straight"
    shutil.copytree(V0 / strategy, straight)
    old = torch.load(next(V0.glob(f"{strategy}/checkpoints/*/rank0.pt")), weights_only=True)
    final = _resume(straight)

    at16 = straight / "checkpoints" / "step-000000016"
    new = torch.load(at16 / "rank0.pt", weights_only=True)
    missing = _leaves(old) - _leaves(new)
    assert not missing, f"keys of the 5f0fff9 layout no longer kept: {sorted(missing)}"

    if machine_key(kernel_fingerprint()) in V0_KERNELS:  # the record: the stronger check
        _same(final, torch.load(V0 / f"{strategy}.model.pt", weights_only=True))
        return
    again = tmp_path / "again"
    shutil.copytree(straight, again, ignore=shutil.ignore_patterns("step-000000024", "model.pt"))
    _same(_resume(again), final)
    print(
        f"{strategy}: the saved final model was computed with other kernels than this "
        f"machine's ({machine_key(kernel_fingerprint())}): checked the resumes agree"
    )
