"""Error compensation: what a lossy codec dropped is kept locally and sent later.

Two rules, each holding one buffer per parameter, keyed by the parameter's name:

- ``ErrorFeedback`` (SparseLoCo, docs/algorithms.md §3 steps 1 and 4)::

      e <- beta * e + x          accumulate(key, x) -> e   (encode and send C(e))
      e <- e - D(C(e))           subtract(key, decoded)

- ``MovingAverageCompensation`` (LoCo, docs/algorithms.md §5)::

      h = g + e                                  compensate(key, g) -> h   (send C(h))
      e <- beta * e + (1 - beta) * (h - D(C(h)))  update(key, h, decoded)

  ``beta = 0`` is plain error feedback on the last step only. ``step()`` counts optimizer
  steps and zeroes every buffer each ``reset_every`` steps (default 1024, the LoCo authors'
  period; 0: never); ``reset()`` zeroes them at once (LoCo drops its errors after an fp16
  loss-scale overflow) and ``rescale(f)`` multiplies them by ``f`` (the loss scale changed, and
  the buffers hold errors of scaled gradients).

Both follow the :class:`Compensation` protocol: ``before_send`` -> encode -> ``after_send``
for one named tensor (the two-phase reduce's second quantisation), and ``before_flat`` ->
encode -> ``after_flat`` for a whole group of named tensors one after another (a fragment, a
gradient bucket's part), then ``step`` per optimizer step. A group's buffers are kept as one
flat buffer in the storage dtype, each name's buffer a view of it, so a group costs the same
launches however many tensors it holds.

Storage. Buffers live on ``device`` (``"cpu"`` keeps them off the accelerator; ``None`` keeps
each one on the device of the tensors it compensates, e.g. FSDP's gradients) in ``dtype``:
``torch.float32``, ``torch.bfloat16``, or ``torch.int8`` (a per-tensor absmax scale,
``e ~ q * scale / 127`` with round-to-nearest; LoCo's memory-saving option). Arithmetic is
always FP32 on the device of the incoming tensor; the buffer is rounded to the storage dtype
when written back. Between ``accumulate`` and ``subtract`` the FP32 ``e`` that was returned is
kept (with FP32 storage on the same device it *is* the stored buffer, updated in place by
both calls: the caller must not modify it, nor keep it past ``subtract``), so the residual
``e - D(C(e))`` is computed from exactly what was encoded rather than from its rounded copy.

:func:`make_compensation` builds the one a :class:`~lowcomm.config.SyncConfig` asks for (the
engine's buffers and the two-phase reduce's second ones alike).

``state_dict()`` holds only tensors, strings and numbers, so it loads with
``torch.load(weights_only=True)``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import torch

from .codecs._format import div_scalar
from .outer import chunk

if TYPE_CHECKING:  # annotations only: config must not be needed to import the math
    from .config import SyncConfig

#: the LoCo authors' reset period, in optimizer steps
DEFAULT_RESET_EVERY = 1024

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int8": torch.int8}
_NAMES = {v: k for k, v in _DTYPES.items()}


def _as_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, str):
        key = {"fp32": "float32", "bf16": "bfloat16"}.get(dtype, dtype)
        if key not in _DTYPES:
            raise ValueError(
                f"compensation storage dtype must be one of fp32, bf16, int8; got {dtype!r}"
            )
        return _DTYPES[key]
    if dtype not in _NAMES:
        raise ValueError(
            f"compensation storage dtype must be float32, bfloat16 or int8; got {dtype}"
        )
    return dtype


class Compensation(Protocol):
    """What the engine, the aggregator and the hooks call on an error compensation."""

    def before_send(self, key: str, x: torch.Tensor) -> torch.Tensor:
        """What to encode in place of ``x`` (FP32, on ``x``'s device)."""
        ...

    def after_send(self, key: str, sent: torch.Tensor, decoded: torch.Tensor) -> None:
        """Record what was lost: ``sent`` was encoded and peers decode ``decoded``."""
        ...

    takes_sparse: bool  # after_flat may be handed a sparse decode (Encoded.sparse_flat)
    restores: bool  # restore_flat hands a weighted merge's unapplied part back

    def before_flat(
        self,
        names: list[str],
        shapes: list[torch.Size],
        x: torch.Tensor,
        ok: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """What to encode in place of the group ``x`` (FP32, ``names``' tensors of ``shapes``
        one after another); ``ok``: a 0-d bool on the device, where False the buffers stay."""
        ...

    def after_flat(
        self, names: list[str], shapes: list[torch.Size], sent: torch.Tensor, enc: Any
    ) -> None:
        """Record what was lost once ``sent`` (what before_flat gave) was encoded as ``enc`` (an
        aggregate.Encoded: its ``local`` or ``sparse_flat`` decode, its ``ok`` flag)."""
        ...

    def step(self) -> None:
        """Count one optimizer step (periodic resets)."""
        ...

    def reset(self) -> None:
        """Zero every buffer."""
        ...

    def rescale(self, factor: float) -> None:
        """Multiply every buffer by ``factor``."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """Tensors, strings and numbers only."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from ``state_dict()``."""
        ...


class _BufferStore:
    """Named buffers in a storage dtype (int8 with a per-tensor scale) on a chosen device."""

    def __init__(self, dtype: torch.dtype | str, device: torch.device | str | None) -> None:
        self.dtype = _as_dtype(dtype)
        self.device = torch.device(device) if device is not None else None
        self.buffers: dict[str, torch.Tensor] = {}
        self.scales: dict[str, torch.Tensor] = {}  # int8 only: fp32 0-d absmax / 127
        self.groups: dict[tuple[str, ...], _Group] = {}  # group(): named buffers as one

    def group(self, names: list[str], shapes: list[torch.Size], device: torch.device) -> _Group:
        """The buffers of ``names`` (shaped ``shapes``) as one flat buffer: made from the
        buffers held (zeros where none is) unless every name's buffer already is its view;
        on this store's device, else ``device``."""
        g = self.groups.get(tuple(names))
        if g is None or not g.holds(self):
            g = self.groups[tuple(names)] = _Group(self, names, shapes, self.device or device)
        return g

    def __contains__(self, key: str) -> bool:
        return key in self.buffers

    def get(self, key: str, like: torch.Tensor) -> torch.Tensor:
        """The buffer as FP32 on ``like``'s device (zeros, shaped like ``like``, if absent)."""
        buf = self.buffers.get(key)
        if buf is None:
            return torch.zeros(like.shape, dtype=torch.float32, device=like.device)
        if buf.shape != like.shape:
            raise ValueError(
                f"compensation buffer {key!r} has shape {tuple(buf.shape)}, "
                f"got a tensor of shape {tuple(like.shape)}"
            )
        out = buf.to(device=like.device, dtype=torch.float32, copy=True)  # never an alias
        if self.dtype == torch.int8:
            out.mul_(self.scales[key].to(like.device))
        return out

    def get_for_update(self, key: str, like: torch.Tensor) -> torch.Tensor:
        """As ``get``, but the stored buffer itself when it already is FP32 on ``like``'s
        device: the caller updates it in place and puts it back, with no model-sized copy."""
        buf = self.buffers.get(key)
        if buf is not None and buf.dtype == torch.float32 and buf.device == like.device:
            if buf.shape == like.shape:
                return buf
        return self.get(key, like)

    def put(self, key: str, value: torch.Tensor) -> None:
        """Store an FP32 value, rounding it to the storage dtype."""
        value = value.detach()
        if self.dtype == torch.int8:
            absmax = value.abs().amax() if value.numel() else value.new_zeros(())
            scale = torch.where(absmax > 0, div_scalar(absmax, 127.0), torch.ones_like(absmax))
            q = torch.round(value / scale).clamp_(-127, 127).to(torch.int8)
            device = self.device or value.device
            self.buffers[key] = q.to(device)
            self.scales[key] = scale.to(device=device, dtype=torch.float32)
        else:
            # callers hand over fresh tensors: keep them as they are when nothing changes
            self.buffers[key] = value.to(device=self.device or value.device, dtype=self.dtype)

    def zero(self) -> None:
        for buf in self.buffers.values():
            buf.zero_()

    def scale_by(self, factor: float) -> None:
        if self.dtype == torch.int8:  # the codes stay, their scale moves
            for s in self.scales.values():
                s.mul_(factor)
        else:
            for buf in self.buffers.values():
                buf.mul_(factor)

    def clear(self) -> None:
        self.buffers.clear()
        self.scales.clear()
        self.groups.clear()

    def state(self) -> dict[str, Any]:
        return {
            "dtype": _NAMES[self.dtype],
            "buffers": {k: v.clone() for k, v in self.buffers.items()},
            "scales": {k: v.clone() for k, v in self.scales.items()},
        }

    def load(self, state: dict[str, Any]) -> None:
        dtype = _as_dtype(state["dtype"])
        if dtype != self.dtype:
            raise ValueError(
                f"state holds {state['dtype']} buffers, this compensation stores "
                f"{_NAMES[self.dtype]}"
            )
        self.groups.clear()  # rebuilt from the loaded buffers at their next use
        self.buffers = {str(k): v.to(self.device or v.device) for k, v in state["buffers"].items()}
        self.scales = {
            str(k): v.to(self.device or v.device) for k, v in state.get("scales", {}).items()
        }
        if self.dtype == torch.int8 and set(self.scales) != set(self.buffers):
            raise ValueError("int8 compensation state lacks a scale for some buffers")


class _Group:
    """Named buffers kept as one flat buffer in the store's dtype (int8: with one scale per
    name), each name's buffer a view of it (see :meth:`_BufferStore.group`)."""

    def __init__(
        self,
        store: _BufferStore,
        names: list[str],
        shapes: list[torch.Size],
        device: torch.device,
    ) -> None:
        sizes = [torch.Size(s).numel() for s in shapes]
        self.names, self.numel = list(names), sum(sizes)
        self.lengths = torch.tensor(sizes, dtype=torch.int64, device=device)
        self.flat = torch.zeros(self.numel, dtype=store.dtype, device=device)
        self.int8 = store.dtype == torch.int8
        self.scales = torch.ones(len(names), device=device) if self.int8 else None
        at = 0
        for i, (name, shape, n) in enumerate(zip(names, shapes, sizes)):
            view = self.flat[at : at + n].view(shape)
            if name in store.buffers:
                view.copy_(store.buffers[name])
                if self.scales is not None:
                    self.scales[i] = store.scales[name]
            store.buffers[name] = view
            if self.scales is not None:
                store.scales[name] = self.scales[i]
            at += n

    def holds(self, store: _BufferStore) -> bool:
        """Whether every name's buffer in ``store`` still is this group's view."""
        at = self.flat.data_ptr()
        step = self.flat.element_size()
        for i, name in enumerate(self.names):
            buf = store.buffers.get(name)
            if buf is None or buf.data_ptr() != at:
                return False
            if self.scales is not None:
                scale = store.scales.get(name)
                if scale is None or scale.data_ptr() != self.scales[i].data_ptr():
                    return False
            at += buf.numel() * step
        return True

    def read(self, device: torch.device) -> tuple[torch.Tensor, bool]:
        """The group as FP32 on ``device``, and whether that is the stored buffer itself (FP32
        there already: update it in place, nothing to write back)."""
        if not self.int8 and self.flat.dtype == torch.float32 and self.flat.device == device:
            return self.flat, True
        e = self.flat.to(device=device, dtype=torch.float32, copy=True)
        if self.scales is not None:
            e.mul_(self._each(self.scales.to(device)))
        return e, False

    def write(self, e: torch.Tensor) -> None:
        """Store ``e`` (FP32, what :meth:`read` gave and was updated) in the storage dtype."""
        if self.scales is None:
            self.flat.copy_(e)
            return
        absmax = torch.segment_reduce(e.abs(), "max", lengths=self.lengths.to(e.device), initial=0)
        scale = torch.where(absmax > 0, div_scalar(absmax, 127.0), torch.ones_like(absmax))
        q = torch.round(e / self._each(scale)).clamp_(-127, 127).to(torch.int8)
        self.flat.copy_(q)
        self.scales.copy_(scale)

    def _each(self, per_name: torch.Tensor) -> torch.Tensor:
        """One value per name spread over that name's elements."""
        lengths = self.lengths.to(per_name.device)
        return torch.repeat_interleave(per_name, lengths, output_size=self.numel)


class _Compensation:
    """What both compensations share: buffers keyed by parameter name in one store."""

    _store: _BufferStore

    @property
    def dtype(self) -> torch.dtype:
        """Storage dtype of the buffers."""
        return self._store.dtype

    @property
    def device(self) -> torch.device | None:
        """Where the buffers live (None: on the device of the tensors they compensate)."""
        return self._store.device

    def rescale(self, factor: float) -> None:
        """Multiply every buffer by ``factor`` (the loss scale changed by that factor)."""
        self._store.scale_by(float(factor))

    def keys(self) -> list[str]:
        """Names of the buffers held."""
        return list(self._store.buffers)

    def buffer(self, key: str) -> torch.Tensor | None:
        """The stored error for ``key`` as FP32 on the storage device (None if absent)."""
        if key not in self._store:
            return None
        return self._store.get(key, self._store.buffers[key].to(torch.float32))


class ErrorFeedback(_Compensation):
    """SparseLoCo's error feedback: ``e <- beta e + x``; send ``C(e)``; ``e <- e - D(C(e))``."""

    def __init__(
        self,
        beta: float,
        dtype: torch.dtype | str = torch.float32,
        device: torch.device | str | None = "cpu",
    ) -> None:
        if not 0.0 <= beta <= 1.0:
            raise ValueError(f"error decay beta must be in [0, 1], got {beta}")
        self.beta = float(beta)
        self._store = _BufferStore(dtype, device)
        self._pending: dict[str, torch.Tensor] = {}
        # before_flat's group between it and after_flat: (group, e, whether e is stored)
        self._pending_flat: dict[tuple[str, ...], tuple[_Group, torch.Tensor, bool]] = {}

    def step(self) -> None:
        """Error feedback has no periodic reset: nothing to count."""

    def accumulate(self, key: str, x: torch.Tensor) -> torch.Tensor:
        """``e <- beta e + x``; returns ``e`` in FP32 on ``x``'s device (encode this)."""
        e = self._store.get_for_update(key, x)
        x = x.detach().to(torch.float32)
        step = chunk(e)
        flat_e, flat_x = e.view(-1), x.reshape(-1)
        for at in range(0, e.numel(), step):  # e is re-read from the cache: 3 passes, not 5
            flat_e[at : at + step].mul_(self.beta).add_(flat_x[at : at + step])
        self._store.put(key, e)
        self._pending[key] = e
        return e

    def before_send(self, key: str, x: torch.Tensor) -> torch.Tensor:
        """The engine's common call: what to encode for ``x`` (here ``accumulate``)."""
        return self.accumulate(key, x)

    takes_sparse = True
    restores = True

    def before_flat(
        self,
        names: list[str],
        shapes: list[torch.Size],
        x: torch.Tensor,
        ok: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``accumulate`` of a group at once: ``x`` holds ``names``' tensors one after another;
        returns ``e`` (FP32 on ``x``'s device: the stored buffer itself where it is FP32 there).
        ``ok``: a 0-d bool on the device, whether ``x`` is finite, not read here; where it is
        False the buffers stay as they were (``x`` is zeroed in place, beta taken as 1), and
        so does the subtraction of what is then encoded (see :meth:`after_flat`)."""
        group = self._store.group(names, shapes, x.device)
        e, stored = group.read(x.device)
        if ok is None:
            e.mul_(self.beta).add_(x.detach())
        else:
            e.mul_(torch.where(ok, self.beta, 1.0)).add_(x.detach().masked_fill_(~ok, 0.0))
        self._pending_flat[tuple(names)] = (group, e, stored)
        return e

    def after_flat(
        self, names: list[str], shapes: list[torch.Size], sent: torch.Tensor, enc: Any
    ) -> None:
        """``e <- e - D(C(e))`` for a group, from its encoding (an aggregate.Encoded): at the
        sent entries of a sparse one, else everywhere; nothing where the encoding's device
        flag ``enc.ok`` says the update was not finite."""
        group, e, stored = self._pending_flat.pop(tuple(names))
        if enc.sparse_flat is not None:
            idx, values = enc.sparse_flat
            e.index_add_(0, idx, values if enc.ok is None else values * enc.ok, alpha=-1.0)
        else:
            e.sub_(enc.local if enc.ok is None else enc.local * enc.ok)
        if not stored:
            group.write(e)

    def restore_flat(
        self,
        names: list[str],
        shapes: list[torch.Size],
        unapplied: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
    ) -> None:
        """``e <- e + u`` for a group: ``u`` is what of the sent message a weighted merge did
        not apply (flat, or (flat indices, values) with 0 elsewhere), so that overall
        ``e <- e - s D(C(e))`` with ``s`` the share applied (docs/algorithms.md,
        "Token-weighted merge")."""
        dense = unapplied if isinstance(unapplied, torch.Tensor) else unapplied[1]
        group = self._store.group(names, shapes, dense.device)
        e, stored = group.read(dense.device)
        if isinstance(unapplied, tuple):
            e.index_add_(0, unapplied[0], unapplied[1].to(torch.float32))
        else:
            e.add_(unapplied.to(torch.float32))
        if not stored:
            group.write(e)

    def after_send(self, key: str, sent: torch.Tensor, decoded: torch.Tensor) -> None:
        """The engine's common call once ``sent`` was encoded (here ``subtract``)."""
        self.subtract(key, decoded)

    def subtract(self, key: str, sent_decoded: torch.Tensor) -> None:
        """``e <- e - D(C(e))`` with ``sent_decoded`` what peers decode of the sent ``e``."""
        e = self._pending.pop(key, None)
        if e is None:
            if key not in self._store:
                raise KeyError(f"no error buffer for {key!r}: call accumulate first")
            e = self._store.get(key, sent_decoded)
        if e.shape != sent_decoded.shape:
            raise ValueError(
                f"decoded tensor for {key!r} has shape {tuple(sent_decoded.shape)}, "
                f"error buffer has {tuple(e.shape)}"
            )
        # in place: e is the stored buffer or a copy of it, and nobody reads it after the send
        self._store.put(key, e.sub_(sent_decoded.to(device=e.device, dtype=torch.float32)))

    def subtract_sparse(self, key: str, idx: torch.Tensor, values: torch.Tensor) -> None:
        """:meth:`subtract` of a decode that is zero but at the flat positions ``idx``, where it
        is ``values``: only those entries are touched (e - 0 = e elsewhere, the same bits)."""
        e = self._pending.pop(key, None)
        if e is None:
            if key not in self._store:
                raise KeyError(f"no error buffer for {key!r}: call accumulate first")
            e = self._store.get(key, self._store.buffers[key].to(torch.float32))
        flat = e.view(-1)
        flat.index_add_(0, idx.to(e.device), values.to(e.device, torch.float32), alpha=-1.0)
        self._store.put(key, e)

    def restore(
        self, key: str, unapplied: torch.Tensor | tuple[torch.Tensor, torch.Tensor]
    ) -> None:
        """``e <- e + u``: ``u`` is what of the sent message a weighted merge did not apply
        (flat, or (flat indices, values) with 0 elsewhere), so that overall ``e <- e - s D(C(e))``
        with ``s`` the share applied (docs/algorithms.md, "Token-weighted merge")."""
        if key not in self._store:
            raise KeyError(f"no error buffer for {key!r}: nothing was sent")
        e = self._store.get_for_update(key, self._store.buffers[key])
        flat = e.view(-1)
        if isinstance(unapplied, tuple):
            idx, values = unapplied
            flat.index_add_(0, idx.to(e.device), values.to(e.device, torch.float32))
        else:
            flat.add_(unapplied.to(e.device, torch.float32).reshape(-1))
        self._store.put(key, e)

    def reset(self) -> None:
        """Zero every buffer."""
        self._store.zero()
        self._pending.clear()

    def state_dict(self) -> dict[str, Any]:
        return {"kind": "error_feedback", "beta": self.beta, **self._store.state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("kind") != "error_feedback":
            raise ValueError(f"not an ErrorFeedback state (kind={state.get('kind')!r})")
        self.beta = float(state["beta"])
        self._store.load(state)
        self._pending.clear()


class MovingAverageCompensation(_Compensation):
    """LoCo: ``h = g + e``; send ``C(h)``; ``e <- beta e + (1 - beta)(h - D(C(h)))``."""

    def __init__(
        self,
        beta: float,
        dtype: torch.dtype | str = torch.float32,
        device: torch.device | str | None = "cpu",
        reset_every: int = DEFAULT_RESET_EVERY,
    ) -> None:
        if not 0.0 <= beta <= 1.0:
            raise ValueError(f"LoCo beta must be in [0, 1], got {beta}")
        if reset_every < 0:
            raise ValueError(f"reset_every must be >= 0 (0 = never), got {reset_every}")
        self.beta = float(beta)
        self.reset_every = int(reset_every)
        self.steps = 0
        self._store = _BufferStore(dtype, device)
        self._pending_flat: dict[tuple[str, ...], tuple[_Group, torch.Tensor, bool]] = {}

    def compensate(self, key: str, g: torch.Tensor) -> torch.Tensor:
        """``h = g + e`` in FP32 on ``g``'s device (encode this)."""
        h = self._store.get(key, g)
        return h.add_(g.detach().to(torch.float32))

    def before_send(self, key: str, g: torch.Tensor) -> torch.Tensor:
        """The engine's common call: what to encode for ``g`` (here ``compensate``)."""
        return self.compensate(key, g)

    def after_send(self, key: str, h: torch.Tensor, decoded: torch.Tensor) -> None:
        """The engine's common call once ``h`` was encoded (here ``update``)."""
        self.update(key, h, decoded)

    takes_sparse = False
    restores = False

    def before_flat(
        self,
        names: list[str],
        shapes: list[torch.Size],
        x: torch.Tensor,
        ok: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``compensate`` of a group at once: ``h = x + e`` (a new FP32 tensor on ``x``'s
        device); ``ok`` as :meth:`ErrorFeedback.before_flat` (where False the buffers stay)."""
        group = self._store.group(names, shapes, x.device)
        e, stored = group.read(x.device)
        h = e + x.detach().to(torch.float32)
        self._pending_flat[tuple(names)] = (group, e, stored)
        return h

    def after_flat(
        self, names: list[str], shapes: list[torch.Size], sent: torch.Tensor, enc: Any
    ) -> None:
        """``update`` of a group at once from its encoding's dense decode (``enc.local``);
        nothing where the device flag ``enc.ok`` says the update was not finite."""
        group, e, stored = self._pending_flat.pop(tuple(names))
        err = sent - enc.local.to(torch.float32)
        if enc.ok is None:
            e.mul_(self.beta).add_(err, alpha=1.0 - self.beta)
        else:
            moved = (e * self.beta).add_(err, alpha=1.0 - self.beta)
            e.copy_(torch.where(enc.ok, moved, e))
        if not stored:
            group.write(e)

    def update(self, key: str, h: torch.Tensor, decoded: torch.Tensor) -> None:
        """``e <- beta e + (1 - beta)(h - decoded)``."""
        if h.shape != decoded.shape:
            raise ValueError(
                f"decoded tensor for {key!r} has shape {tuple(decoded.shape)}, "
                f"compensated tensor has {tuple(h.shape)}"
            )
        e = self._store.get(key, h)
        err = h.detach().to(torch.float32) - decoded.to(device=h.device, dtype=torch.float32)
        e.mul_(self.beta).add_(err, alpha=1.0 - self.beta)
        self._store.put(key, e)

    def step(self) -> None:
        """Count one optimizer step; zero all buffers every ``reset_every`` steps."""
        self.steps += 1
        if self.reset_every and self.steps % self.reset_every == 0:
            self.reset()

    def reset(self) -> None:
        """Zero every buffer (e.g. after a loss-scale overflow)."""
        self._store.zero()

    def state_dict(self) -> dict[str, Any]:
        return {
            "kind": "loco",
            "beta": self.beta,
            "reset_every": self.reset_every,
            "steps": self.steps,
            **self._store.state(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("kind") != "loco":
            raise ValueError(f"not a MovingAverageCompensation state (kind={state.get('kind')!r})")
        self.beta = float(state["beta"])
        self.reset_every = int(state["reset_every"])
        self.steps = int(state["steps"])
        self._store.load(state)


def make_compensation(
    cfg: SyncConfig, device: torch.device | str | None
) -> ErrorFeedback | MovingAverageCompensation | None:
    """The compensation ``cfg.compensation`` names (None for "none"), its buffers on ``device``.

    ``device=None`` keeps each buffer on the device of the tensors it compensates.
    """
    if cfg.compensation == "none":
        return None
    if cfg.compensation == "ef":
        return ErrorFeedback(cfg.error_decay, device=device)
    if cfg.compensation == "loco":
        return MovingAverageCompensation(
            cfg.loco_beta, device=device, reset_every=cfg.loco_reset_every
        )
    raise ValueError(f"unknown compensation {cfg.compensation!r}: none, ef or loco")
