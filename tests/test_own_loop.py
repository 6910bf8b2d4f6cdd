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


def torchrun(script: Path, *args: str, cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess:
    """``torchrun --nproc-per-node 2 script args`` as a user would type it; output captured."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-port", str(_free_port()), str(script), *args]
    env = dict(os.environ, PYTHONPATH=str(HERE))
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("strategy", ["diloco", "streaming", "sparseloco", "co2"])
def test_own_loop_contract(tmp_path, strategy):
    out = tmp_path / "result.pt"
    proc = torchrun(HERE / "own_loop_script.py", strategy, str(out), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = torch.load(out, weights_only=False)
    # two `with` blocks of 20 steps train bit for bit like one block of 40 (H = 6: both end mid-round)
    assert res["two_blocks_equal_one"]
    # parameters, BatchNorm statistics and the frozen parameter are the same on every rank after
    # one block, two blocks, uneven step counts (44 vs 41: no hang) and whole rounds only
    assert res["same_on_every_rank"] == [True, True, True, True]
    # the 4 steps after the last sync (40 = 6 x 6 + 4) are not thrown away
    assert res["partial_round_counts"]
    assert torch.equal(res["one"]["scale"], torch.ones_like(res["one"]["scale"]))  # rank 0's frozen value
    if strategy == "diloco":
        for name, expected in res["reference"].items():
            torch.testing.assert_close(res["one"][name].float(), expected.float(), atol=1e-6, rtol=0,
                                       msg=name)


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
    enc = torch.nn.TransformerEncoder(torch.nn.TransformerEncoderLayer(16, 2, 32, batch_first=True), 4)
    model = torch.nn.ModuleDict({"embed": torch.nn.Embedding(10, 16), "body": enc,
                                 "head": torch.nn.Linear(16, 10)})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sync = lowcomm.StreamingDiLoCo(model, opt, sync_every=30, fragments=3)
    assert sync.fragment_names[0] == ["embed.weight", "head.weight", "head.bias"]
    assert all(n.startswith(("body.layers.0.", "body.layers.2.")) for n in sync.fragment_names[1])
    assert all(n.startswith(("body.layers.1.", "body.layers.3.")) for n in sync.fragment_names[2])


def test_streaming_sees_through_torch_compile():
    from helpers import tiny_model

    model = torch.compile(tiny_model())
    sync = lowcomm.StreamingDiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                   sync_every=30, fragments=3)
    assert len(sync.fragment_names) == 3
    assert all(n.startswith("_orig_mod.blocks.0.") for n in sync.fragment_names[1])
    explicit = lowcomm.StreamingDiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                       sync_every=30, overlap=1,
                                       fragment_modules=[["embed", "norm", "head"], ["blocks"]])
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
