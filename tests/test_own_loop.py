"""lowcomm in a user's own loop, launched the way users launch it: torchrun, their model.

Each strategy runs tests/own_loop_script.py on 2 workers; see that file for the model and loop.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import lowcomm

HERE = Path(__file__).parent
ROOT = HERE.parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(
    script: Path, *args: str, cwd: Path, timeout: float = 240, nproc: int = 2
) -> subprocess.CompletedProcess:
    """``torchrun --nproc-per-node N script args`` as a user would type it; output captured."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(nproc),
        "--master-port",
        str(_free_port()),
        str(script),
        *args,
    ]
    env = dict(os.environ, PYTHONPATH=str(HERE))
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


# the default cases share one torchrun (its start, ~4 s on 2 cores, paid once); by hand (-m
# slow): sparseloco (streaming's path with another codec), in a torchrun of its own
CONTRACT_DEFAULT = ["diloco", "streaming", "co2"]


class _Contracts(dict):
    """Each strategy's results of own_loop_script.py, from the first test that needs them."""

    def __init__(self, factory) -> None:
        super().__init__()
        self.factory = factory

    def __missing__(self, strategy: str) -> dict:
        group = CONTRACT_DEFAULT if strategy in CONTRACT_DEFAULT else [strategy]
        folder = self.factory.mktemp("own-loop")
        out = folder / "result-{strategy}.pt"
        proc = torchrun(HERE / "own_loop_script.py", ",".join(group), str(out), cwd=folder)
        assert proc.returncode == 0, proc.stderr[-3000:]
        for s in group:
            self[s] = torch.load(str(out).format(strategy=s), weights_only=False)
        return self[strategy]


@pytest.fixture(scope="module")
def contracts(tmp_path_factory):
    return _Contracts(tmp_path_factory)


@pytest.mark.parametrize(
    "strategy", ["diloco", "streaming", pytest.param("sparseloco", marks=pytest.mark.slow), "co2"]
)
def test_own_loop_contract(contracts, strategy):
    res = contracts[strategy]
    # two `with` blocks of 20 steps train bit for bit like one block of 40
    # (H = 6: both end mid-round)
    assert res["two_blocks_equal_one"]
    # parameters, BatchNorm statistics and the frozen parameter are the same on every rank after
    # one block, two blocks, uneven step counts (44 vs 41: no hang), whole rounds only, and a
    # schedule that drifts (rank 1 skips two optimizer steps mid-run: syncs pair up in order)
    assert res["same_on_every_rank"] == [True, True, True, True, True]
    # the 4 steps after the last sync (40 = 6 x 6 + 4) are not thrown away
    assert res["partial_round_counts"]
    assert torch.equal(
        res["one"]["scale"], torch.ones_like(res["one"]["scale"])
    )  # rank 0's frozen value
    if strategy == "diloco":
        for name, expected in res["reference"].items():
            torch.testing.assert_close(
                res["one"][name].float(), expected.float(), atol=1e-6, rtol=0, msg=name
            )


def _readme_snippet() -> str:
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    return next(b for b in blocks if "init_process_group" in b)


def test_readme_snippet_runs_as_written(tmp_path):
    """The README's loop, copied out and run with torchrun exactly as it stands (no teardown)."""
    script = tmp_path / "train.py"
    script.write_text(_readme_snippet())
    proc = torchrun(script, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "SyncStats(" in proc.stdout


def test_streaming_finds_blocks_in_any_model():
    enc = torch.nn.TransformerEncoder(
        torch.nn.TransformerEncoderLayer(16, 2, 32, batch_first=True), 4
    )
    model = torch.nn.ModuleDict(
        {"embed": torch.nn.Embedding(10, 16), "body": enc, "head": torch.nn.Linear(16, 10)}
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sync = lowcomm.StreamingDiLoCo(model, opt, sync_every=30, fragments=3)
    assert sync.fragment_names[0] == ["embed.weight", "head.weight", "head.bias"]
    assert all(n.startswith(("body.layers.0.", "body.layers.2.")) for n in sync.fragment_names[1])
    assert all(n.startswith(("body.layers.1.", "body.layers.3.")) for n in sync.fragment_names[2])


def test_streaming_sees_through_torch_compile():
    from helpers import tiny_model

    model = torch.compile(tiny_model())
    sync = lowcomm.StreamingDiLoCo(
        model, torch.optim.SGD(model.parameters(), lr=0.1), sync_every=30, fragments=3
    )
    assert len(sync.fragment_names) == 3
    assert all(n.startswith("_orig_mod.blocks.0.") for n in sync.fragment_names[1])
    explicit = lowcomm.StreamingDiLoCo(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        sync_every=30,
        overlap=1,
        fragment_modules=[["embed", "norm", "head"], ["blocks"]],
    )
    assert explicit.fragment_names[1][0].startswith("_orig_mod.blocks.")


MISUSES = [
    (dict(sync_every="10"), "sync_every must be a whole number"),
    (dict(sync_every=10.5), "sync_every must be a whole number"),
    (dict(outer_lr="x"), "outer_lr must be a number"),
    (dict(nesterov="no"), "nesterov must be True or False"),
    (dict(timeout_s=-1), "timeout_s must be"),
    (dict(codec="fp5"), "unknown codec"),
    (dict(fragments=[["embed"]]), "fragment_modules"),
    (dict(fragments=10), "fragments=10"),
    (dict(fragments=3, blocks_per_fragment=2), "not both"),
    (dict(aggregation="selected-mean", codec="fp32"), "selected-mean needs codec=topk"),
    (dict(bogus=1), "unknown sync option"),
]


@pytest.mark.parametrize("kwargs,message", MISUSES)
def test_misuse_is_one_line_config_error(kwargs, message):
    from helpers import tiny_model

    model = tiny_model()
    with pytest.raises(lowcomm.ConfigError, match=re.escape(message)) as info:
        lowcomm.StreamingDiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), **kwargs)
    assert "\n" not in str(info.value)


def test_optimizer_without_the_models_parameters_is_refused():
    from helpers import tiny_model

    model, other = tiny_model(), tiny_model()
    with pytest.raises(lowcomm.ConfigError, match="holds none of the model"):
        lowcomm.DiLoCo(model, torch.optim.SGD(other.parameters(), lr=0.1))
    assert issubclass(lowcomm.ConfigError, lowcomm.LowCommError)


def _checkpoint_worker(rank: int, world: int, strategy: str, path: str) -> dict:
    from helpers import adamw, batches, flat_params, local_steps, tiny_model

    preset = {"diloco": lowcomm.DiLoCo, "streaming": lowcomm.StreamingDiLoCo, "co2": lowcomm.CO2}
    kw = {"sync_every": 6} | ({"fragments": 3, "overlap": 1} if strategy == "streaming" else {})
    model = tiny_model(seed=0)
    opt, data = adamw(model), batches(rank, world)
    sync = preset[strategy](model, opt, **kw)
    with sync:
        local_steps(model, opt, data, 20)
    torch.save(
        {"sync": sync.state_dict(), "optimizer": opt.state_dict(), "data": data.state_dict()},
        f"{path}.rank{rank}",
    )
    with sync:  # the uninterrupted run
        local_steps(model, opt, data, 20)
    saved = torch.load(f"{path}.rank{rank}", weights_only=True)  # tensors and plain types only
    model2 = tiny_model(seed=7)  # another init: the checkpoint must fully define the run
    opt2, data2 = adamw(model2), batches(rank, world)
    sync2 = preset[strategy](model2, opt2, **kw)
    sync2.load_state_dict(saved["sync"])
    opt2.load_state_dict(saved["optimizer"])
    data2.load_state_dict(saved["data"])
    with sync2:
        local_steps(model2, opt2, data2, 20)
    return {
        "uninterrupted": flat_params(model),
        "resumed": flat_params(model2),
        "bytes": (sync.stats.bytes_sent, sync2.stats.bytes_sent),
    }


# by hand (-m slow): streaming (its pending results are CO2's path)
@pytest.mark.parametrize(
    "strategy", ["diloco", pytest.param("streaming", marks=pytest.mark.slow), "co2"]
)
def test_own_loop_checkpoint_resumes_bit_for_bit(workers, tmp_path, strategy):
    """sync.state_dict() saved on every rank, loaded into fresh objects before the block: the
    resumed run equals the uninterrupted one (a result in flight at the save included)."""
    for r in workers(_checkpoint_worker, 2, strategy, str(tmp_path / "ckpt")):
        assert torch.equal(r["uninterrupted"], r["resumed"])
        assert r["bytes"][0] == r["bytes"][1]  # byte totals continue from the checkpoint
