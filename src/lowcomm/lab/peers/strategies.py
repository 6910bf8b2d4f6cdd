"""torchft's DiLoCo and Streaming DiLoCo, run by our trainer as peers for comparison.

Same knobs as our own DiLoCo and Streaming DiLoCo; torchft's streaming sends FP32 (its low-bit
path needs CUDA). The implementation is :mod:`lowcomm.lab.peers.torchft` (an optional extra).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from lowcomm.config import ConfigError, SyncConfig
from lowcomm.strategies.base import Strategy, register
from lowcomm.strategies.ddp import raise_inside
from lowcomm.strategies.diloco import DiLoCo
from lowcomm.strategies.streaming import SETTINGS as STREAMING

if TYPE_CHECKING:
    from lowcomm.config import MembershipConfig, TrainConfig


class _Peer(Strategy):
    """A torchft method: checked by torchft's own limits, no checkpoints, no joins."""

    peer = True
    streaming = False
    """Whether torchft syncs our fragments in turn (its Streaming DiLoCo)."""

    def check(self, sync_cfg: SyncConfig, cfg: TrainConfig, resume: str | None) -> None:
        """torchft installed, and settings its DiLoCo runs (no checkpoints)."""
        from . import torchft

        torchft.check_config(sync_cfg, cfg.checkpoint_every, resume)

    def check_sites(self, cfg: TrainConfig) -> None:
        """One rank per worker: torchft's replica groups are ours of size 1."""
        if cfg.ranks_per_worker > 1:
            raise_inside(self.name, cfg.ranks_per_worker)

    def check_schedule(self, model: Any, sync_cfg: SyncConfig) -> None:
        """torchft's own limits on H, P and tau (its DiLoCo syncs the whole model otherwise)."""
        if self.streaming:
            from . import torchft

            torchft.check_fragments(model, sync_cfg)

    def engine(
        self,
        model: Any,
        optimizer: Any,
        sync_cfg: SyncConfig,
        *,
        timeout_s: float,
        elastic: Any,
        peer_lighthouse: str,
    ) -> Any:
        """torchft's ``DiLoCo`` around the model, with our fragments when it streams."""
        from . import torchft

        return torchft.TorchftDiLoCo(
            model, optimizer, sync_cfg, timeout_s=timeout_s, streaming=self.streaming,
            elastic=elastic, peer_lighthouse=peer_lighthouse,
        )  # fmt: skip

    def own_lighthouse(self, options: dict[str, int]) -> Any:
        """torchft's Managers meet at a LighthouseServer of their own, in this process."""
        if not os.environ.get("LOWCOMM_DEBUG"):
            os.environ.setdefault("RUST_LOG", "warn")  # the lighthouse logs every quorum at INFO
        from torchft.coordination import LighthouseServer

        return LighthouseServer(bind="[::]:0", **options)


@register
class TorchftDiLoCo(_Peer):
    """torchft's ``DiLoCo`` with the whole model as one fragment."""

    name = "torchft-diloco"
    summary = "torchft's DiLoCo (peer, for comparison)"
    settings = DiLoCo.settings

    def check_elastic(self, membership: MembershipConfig, rejoin: bool) -> None:
        """torchft's own Managers keep membership: no replay, quorum rounds or joins of ours."""
        if membership.replay:
            raise ConfigError("--replay re-enacts lowcomm's own membership, not torchft's: drop it")
        if membership.rounds == "quorum":
            raise ConfigError("rounds=quorum runs lowcomm's own methods, not torchft-diloco")
        if rejoin:
            raise ConfigError("a site joins lowcomm's own methods only, not torchft-diloco")


@register
class TorchftStreaming(_Peer):
    """torchft's ``DiLoCo`` given our fragments: its Streaming DiLoCo, FP32 on the wire."""

    name = "torchft-streaming"
    summary = "torchft's Streaming DiLoCo (peer, for comparison; FP32 on CPU)"
    settings = {**STREAMING, "codec": "fp32"}
    streaming = True

    def check_elastic(self, membership: MembershipConfig, rejoin: bool) -> None:
        """Of torchft's methods, only its DiLoCo runs elastic."""
        raise ConfigError(f"elastic=true runs torchft-diloco of torchft's methods, not {self.name}")
