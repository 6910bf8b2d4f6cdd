"""A worker that is a whole site: 2 replicas x 2 ranks with FSDP2 inside, against 2 x 1.

tests/replica_script.py trains the same model on the same per-replica batches three ways under
torchrun (4 ranks with FSDP2 and a ("replicate", "shard") mesh; 2 plain ranks; 2 plain ranks
whose weights are held as two row halves) for diloco, streaming (FP4, tau = 1), sparseloco
and co2.
"""

from __future__ import annotations

import pytest
import torch
from test_own_loop import HERE, torchrun

STRATEGIES = ["diloco", "streaming", "sparseloco", "co2"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = {}
    for mode, ranks in [("fsdp", 4), ("plain", 2), ("split", 2)]:
        folder = tmp_path_factory.mktemp(mode)
        proc = torchrun(HERE / "replica_script.py", mode, str(folder), cwd=folder, nproc=ranks)
        assert proc.returncode == 0, proc.stderr[-3000:]
        out[mode] = [torch.load(folder / f"rank{r}.pt") for r in range(ranks)]
    return out


def _assert_models_close(a: dict, b: dict, rtol: float) -> None:
    for name in b:
        scale = b[name].abs().max()
        err = (a[name] - b[name]).abs().max()
        assert err <= rtol * scale, f"{name}: max error {err:.3g} vs scale {scale:.3g}"


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_replicas_with_fsdp_inside_train_as_one_rank_replicas(runs, strategy):
    fsdp, plain, split = runs["fsdp"], runs["plain"], runs["split"]
    final = fsdp[0][strategy]["model"]
    # all four ranks hold the same model: both replicas, both shards of each
    for r in range(1, 4):
        for name, v in final.items():
            assert torch.equal(fsdp[r][strategy]["model"][name], v), (r, name)
    start = fsdp[0]["start"]
    assert max((final[n] - start[n]).abs().max() for n in final) > 1e-2  # it trained
    if strategy == "sparseloco":
        # top-k picks entries per tile and its 2-bit values share one table per tensor: on a
        # shard both are the shard's own, so the exact reference holds each weight as the same
        # two halves; against whole weights the run differs (other entries kept)
        _assert_models_close(final, split[0][strategy]["model"], rtol=1e-5)
    else:
        # element-wise math, and FP4 scales per 128 entries that shard boundaries do not cut
        _assert_models_close(final, plain[0][strategy]["model"], rtol=1e-5)
    # each rank sends its shard between replicas: half the 1-rank replica's payload (streaming:
    # plus a header per tensor)
    ratio = fsdp[0][strategy]["payload_bytes"] / plain[0][strategy]["payload_bytes"]
    if strategy != "sparseloco":
        assert 0.5 <= ratio < 0.52, ratio
    else:
        ratio = fsdp[0][strategy]["payload_bytes"] / split[0][strategy]["payload_bytes"]
        assert 0.5 <= ratio < 0.52, ratio


class _FakeMesh:
    """Just the DeviceMesh surface lowcomm reads before it builds any group."""

    def __init__(self, shape: tuple[int, ...], names: tuple[str, ...] | None) -> None:
        self.mesh = torch.arange(int(torch.tensor(shape).prod())).reshape(shape)
        self.ndim, self.mesh_dim_names = len(shape), names

    def size(self, dim: int | None = None) -> int:
        return self.mesh.numel() if dim is None else self.mesh.shape[dim]


def test_a_mesh_without_workers_or_with_unsharded_weights_is_one_clear_error():
    import lowcomm
    from lowcomm.engine import _check_sharded

    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(lowcomm.ConfigError, match="dimension named 'replicate'"):
        lowcomm.LowComm(model, opt, mesh=_FakeMesh((2, 2), ("dp", "tp")))
    with pytest.raises(lowcomm.ConfigError, match="not both"):
        lowcomm.LowComm(
            model, opt, mesh=_FakeMesh((2, 2), ("replicate", "shard")), process_group=object()
        )
    with pytest.raises(lowcomm.ConfigError, match="2 ranks in each worker .* not sharded"):
        _check_sharded(_FakeMesh((2, 2), ("replicate", "shard")), list(model.parameters()))
    _check_sharded(_FakeMesh((2, 1), ("replicate", "shard")), list(model.parameters()))  # fine
