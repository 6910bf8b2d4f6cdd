"""This worker's local weights as the run state sees them: saved and loaded with checkpoints,
kept aside while leaving the block publishes the consolidated model, and put back on entering
again (refusing a model changed in between)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn as nn

from ..config import ConfigError
from .fragment import Fragment
from .placement import Placement
from .state import RunState, StatePart
from .tensors import load_named, local, named_state


class LocalWeights:
    """The local weights and buffers, the copy kept between blocks and the published model."""

    def __init__(
        self, model: nn.Module, frags: list[Fragment], placement: Placement, state: RunState
    ) -> None:
        self.model, self.frags, self.placement = model, frags, placement
        self.started = False  # inside a block (the model holds the local weights)
        self.kept: dict[str, torch.Tensor] | None = None  # local weights while outside a block
        self.published: dict[str, torch.Tensor] | None = None  # the model loaded on leaving
        state.register(
            # fresh (None): a worker of a world of another size starts from the global copy
            "local",
            StatePart(self.save, self.load, restore=lambda v: setattr(self, "kept", v), fresh=None),
        )

    def save(self) -> dict[str, torch.Tensor]:
        """Clones of the local weights and buffers: the model's, or those kept for the next
        block."""
        current = self.kept if self.kept is not None else named_state(self.model, self.part)
        return {k: v.clone() for k, v in current.items()}

    @property
    def part(self) -> tuple[int, int] | None:
        """This rank's part of each weight with DDP inside a worker."""
        return self.placement.part

    def load(self, saved: dict[str, torch.Tensor] | None) -> None:
        """Saved local weights into the model now (inside a block, or before the first), or
        kept for the next block; none saved: every worker starts from the global copy."""
        if saved is None:
            with torch.no_grad():
                for f in self.frags:
                    f.load_global()
            saved = named_state(self.model, self.part)
        if self.started or self.kept is None:
            load_named(self.model, saved, self.part)
            self.placement.share_parts(self.frags)
        else:  # between blocks: the next start() restores these instead of the kept ones
            self.kept, self.published = dict(saved), None

    def publish(self) -> None:
        """Load the global copies into the model and remember them as published."""
        with torch.no_grad():
            for frag in self.frags:
                frag.load_global()
        self.placement.share_parts(self.frags)
        self.published = {
            n: v.detach().clone() for f in self.frags for n, v in zip(f.names, f.global_views)
        }

    def global_state(self) -> dict[str, torch.Tensor]:
        """The global parameters by name: the global copies inside a block, the published
        (consolidated) model outside it once one was published."""
        if not self.started and self.published is not None:
            return dict(self.published)
        return {n: v for f in self.frags for n, v in zip(f.names, f.global_views)}

    def reenter(self) -> None:
        """Second and later blocks: the model must still hold what leaving published; then the
        kept local weights go back in. (After a block left by an exception nothing was kept:
        training goes on from the weights as they are.)"""
        if self.kept is None:
            return
        if self.published is not None:
            current = {n: local(p, self.part) for n, p in self.model.named_parameters()}
            changed = [
                n
                for n, v in self.published.items()
                if not torch.equal(current[n].detach().to(v.device, v.dtype), v)
            ]
            if changed:
                raise ConfigError(
                    f"the model's parameters changed since the last block ended (e.g. "
                    f"{changed[0]}): to continue from a checkpoint load it with "
                    f"sync.load_state_dict(...) instead of model.load_state_dict(...)"
                )
        load_named(self.model, self.kept, self.part)
        self.placement.share_parts(self.frags)
        self.kept = None

    @contextlib.contextmanager
    def global_loaded(self) -> Iterator[nn.Module]:
        """The model with the global copies loaded, the local weights put back afterwards."""
        saved = [p.detach().clone() for f in self.frags for p in f.params]
        with torch.no_grad():
            for f in self.frags:
                f.load_global()
        self.placement.share_parts(self.frags)
        try:
            yield self.model
        finally:
            with torch.no_grad():
                for p, s in zip((p for f in self.frags for p in f.params), saved):
                    p.copy_(s)
            self.placement.share_parts(self.frags)
