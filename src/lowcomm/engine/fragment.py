"""A fragment: one group of parameters synced together, owning its global copy and its state.

Its global copy is one flat FP32 buffer (the parameters as views of it); its pseudo-gradient is
``reference - local`` where the reference is the global copy, or with the continue merge the
local weights at its last send (``snapshot``). ``unsent`` counts inner steps since its last send.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from ..codecs import kernels
from ..config import ConfigError
from .state import RunState, StatePart
from .tensors import Part, copy_into, local, on_device_of, values_on, views


@dataclass
class Fragment:
    """One group of parameters synced together, with its global copy as one flat FP32 buffer."""

    index: int
    names: list[str]
    raw: list[nn.Parameter]  # the model's parameters (DTensors under FSDP2)
    global_flat: torch.Tensor
    global_views: list[torch.Tensor]
    buckets: list[list[int]]
    unsent: int = 0  # inner steps since this fragment was last sent
    snapshot: torch.Tensor | None = None  # continue merge: local weights at the last send
    part: Part | None = None  # DDP inside a worker: (this rank's part, parts)
    kernels: str = "auto"  # which implementations run (codecs.kernels: auto or torch)

    @property
    def key(self) -> str:
        """Its name in the outer optimizer's state and in checkpoints."""
        return f"fragment{self.index}"

    @property
    def params(self) -> list[torch.Tensor]:
        """This rank's part of each parameter: the local shard under FSDP2, its slice of rows
        with DDP inside a worker, else the parameter.

        Looked up each time: FSDP2 may re-point a sharded parameter's storage at lazy init.
        """
        return [local(p, self.part) for p in self.raw]

    def load_global(self) -> None:
        """The global copy into the local parameters (from host state, in one transfer)."""
        with torch.no_grad():
            params = self.params
            copy_into(params, views(on_device_of(params, self.global_flat), params))

    @property
    def reference(self) -> torch.Tensor:
        """What the pseudo-gradient is measured from: the snapshot when there is one, else the
        global copy."""
        return self.snapshot if self.snapshot is not None else self.global_flat

    def pseudo_grad_into(
        self, out: list[torch.Tensor], take_snapshot: bool = False
    ) -> torch.Tensor:
        """The pseudo-gradient ``reference - local`` (FP32) written into ``out`` (views shaped
        like the parameters); with ``take_snapshot``, then :meth:`take_snapshot`, in the same
        pass over the weights (the ``difference`` kernel). Returns a 0-d bool on the state's
        device, whether every entry is finite (nothing read)."""
        ref = self.reference
        params = self.params
        plain = values_on(ref.device, params)
        snaps = (
            views(self.snapshot, params) if take_snapshot and self.snapshot is not None else None
        )
        ops = kernels.choose(ref.device, self.kernels)
        return ops.difference(out, views(ref, params), plain, snaps)

    def take_snapshot(self) -> None:
        """Remember the local weights (in FP32) as the continue merge's reference."""
        assert self.snapshot is not None
        params = self.params
        copy_into(views(self.snapshot, params), values_on(self.snapshot.device, params))


def register_fragment_state(state: RunState, frags: list[Fragment]) -> None:
    """Declare the fragments' state: their names (checked on load), global copies, snapshots
    and unsent counts."""
    state.register(
        "fragments",
        StatePart(
            lambda: [list(f.names) for f in frags], lambda v: _check_names(frags, v), kept=False
        ),
    )
    state.register(
        "global",
        StatePart(
            lambda: {f.key: f.global_flat.clone() for f in frags},
            lambda v: _load_global(frags, v),
            shared=True,
            buffer=True,
        ),
    )
    state.register(
        "snapshot",
        StatePart(
            lambda: {f.key: f.snapshot.clone() for f in frags if f.snapshot is not None},
            lambda v: _load_snapshots(frags, v or {}),
            fresh={},  # a fresh worker starts it at the global copy
            buffer=True,
        ),
    )
    state.register(
        "unsent",
        StatePart(
            lambda: [f.unsent for f in frags],
            lambda v: _load_unsent(frags, v or [0] * len(frags)),
        ),  # per site: the inner steps this site took since its last send (a joiner: none)
    )


def _check_names(frags: list[Fragment], names: Any) -> None:
    if names != [list(f.names) for f in frags]:
        raise ConfigError(
            "the checkpoint's fragments differ from this run's: resume with the "
            "same model and fragment settings"
        )


def _load_global(frags: list[Fragment], saved: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for f in frags:
            f.global_flat.copy_(saved[f.key])


def _load_snapshots(frags: list[Fragment], saved: dict[str, torch.Tensor]) -> None:
    """A checkpoint without a fragment's snapshot starts it at the global copy (loaded first)."""
    with torch.no_grad():
        for f in frags:
            if f.snapshot is not None:
                f.snapshot.copy_(saved.get(f.key, f.global_flat))


def _load_unsent(frags: list[Fragment], unsent: list[int]) -> None:
    for f, n in zip(frags, unsent):
        f.unsent = int(n)
