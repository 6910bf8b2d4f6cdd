"""The codec interface: tensors <-> the bytes that really go on the wire.

A codec's payload for one tensor is a small header and the packed data; its size depends only
on the tensor's shape and the codec's settings (never on the values), so every worker's
payload for the same tensors has the same size and can be all-gathered directly. Codecs never
call torch.distributed.

A codec encodes and decodes a whole bucket of tensors at once through a :class:`Plan`, built
once per (shapes, device, layout) and cached: the one implementation, on every device.
Encoding one tensor (:meth:`Codec.encode`) is a plan of one tensor. A codec from outside this
package (a plugin) that has no plan of its own gets :class:`TensorwisePlan`, which calls its
``encode`` and ``decode`` tensor by tensor.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import Any

import torch

from ..errors import PayloadError  # noqa: F401  (re-exported)


class Codec(ABC):
    """Encode float tensors into packed bytes, decode them back, and report sizes."""

    #: short name used in configs (``codec=int4``)
    name: str = ""
    #: True when encoding any 1-D slice of a tensor is valid (the two-phase reduce shards flat
    #: buffers across workers, so only element-wise codecs may be used there).
    elementwise: bool = True
    #: which kernels its plans run: "auto" (the fastest here) or "torch" (:mod:`.kernels`)
    kernels: str = "auto"

    @abstractmethod
    def nbytes(self, shape: torch.Size) -> int:
        """Exact payload size in bytes for a tensor of ``shape``."""

    @abstractmethod
    def formula_bits_per_param(self, shape: torch.Size) -> float:
        """Bits per element the format's formula predicts (headers excluded)."""

    def plan(
        self, shapes: list[torch.Size], device: torch.device, at: list[int] | None = None
    ) -> Plan:
        """The plan for tensors of ``shapes`` on ``device``, each tensor's payload at byte
        ``at[i]`` of a buffer (default: one after another from 0); built once, then cached."""
        cache: dict[Any, Plan] = self.__dict__.setdefault("_plans", {})
        key = (tuple(tuple(s) for s in shapes), str(device), tuple(at) if at else None)
        if key not in cache:
            cache[key] = self._make_plan([torch.Size(s) for s in shapes], device, at)
        return cache[key]

    def _make_plan(
        self, shapes: list[torch.Size], device: torch.device, at: list[int] | None
    ) -> Plan:
        """This codec's plan (a plugin without one: tensor by tensor)."""
        return TensorwisePlan(self, shapes, device, at)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Pack ``x`` (float, any shape) into a 1-D uint8 payload of ``nbytes(x.shape)`` bytes."""
        flat = as_float_input(x)
        plan = self.plan([x.shape], flat.device)
        out = torch.empty(plan.span + 1, dtype=torch.uint8, device=flat.device)
        plan.encode(flat, out)
        return out[: plan.span]

    def decode(
        self, payload: torch.Tensor, shape: torch.Size, name: str = "tensor"
    ) -> torch.Tensor:
        """Unpack a payload into an FP32 tensor of ``shape``; raise PayloadError naming ``name``."""
        idx, values = self.decode_parts(payload, shape, name)
        if idx is None:
            return values.view(shape)
        out = torch.zeros(numel_of(shape), dtype=torch.float32, device=values.device)
        return out.index_copy_(0, idx, values).view(shape)

    def decode_parts(
        self, payload: torch.Tensor, shape: torch.Size, name: str = "tensor"
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """One tensor's payload decoded as its plan gives it: (None, the values) for a dense
        format, (flat indices, values) for a sparse one; PayloadError naming ``name`` (read
        at once: one host read) if the payload breaks a rule of the format."""
        shape = torch.Size(shape)
        self.explain_size(payload, shape, name)
        idx, values, bad = self.plan([shape], payload.device).decode(payload)
        if bool(bad):
            self.explain(payload, shape, name)
            raise PayloadError(f"{name}: the payload does not decode as {self.name}")
        return idx, values

    def explain_size(self, payload: Any, shape: torch.Size, name: str) -> None:
        """PayloadError unless ``payload`` is a 1-D uint8 tensor of ``nbytes(shape)`` bytes."""
        check_bytes(payload, name)
        want = self.nbytes(shape)
        if payload.numel() != want:
            describe = getattr(self, "describe", lambda: self.name)()
            raise PayloadError(
                f"{name}: payload has {payload.numel()} bytes, expected {want} for shape "
                f"{tuple(shape)} with codec {describe}"
            )

    def explain(self, payload: torch.Tensor, shape: torch.Size, name: str = "tensor") -> None:  # noqa: B027
        """PayloadError saying what in ``payload`` (one tensor's) breaks the format, if anything
        does (the error path: reads whatever it needs); a codec with no checks of its own
        raises nothing here."""

    def roundtrip(self, x: torch.Tensor) -> torch.Tensor:
        """decode(encode(x)): what a peer will see of ``x``."""
        return self.decode(self.encode(x), x.shape)


class Plan:
    """A bucket of tensors of fixed shapes under one codec on one device: :meth:`encode` and
    :meth:`decode` of all of them at once, with no host read.

    Each tensor's payload sits at byte ``at[i]`` of a buffer (``span`` bytes hold them all);
    ``starts[i]`` is its first element among the tensors one after another (``numel`` in all).
    ``sparse``: decodes are (flat indices, values) into those ``numel`` elements, else dense.
    ``negative_zeros``: whether a decoded value can be -0.0.
    """

    sparse = False
    #: whether a decode can give -0.0 (0 + -0.0 is +0.0: a sum must then start from zeros)
    negative_zeros = True

    def __init__(
        self,
        codec: Codec,
        shapes: list[torch.Size],
        device: torch.device,
        at: list[int] | None = None,
    ) -> None:
        self.codec, self.device = codec, torch.device(device)
        self.shapes = [torch.Size(s) for s in shapes]
        self.sizes = [numel_of(s) for s in self.shapes]
        self.numel = sum(self.sizes)
        self.widths = [codec.nbytes(s) for s in self.shapes]
        if at is None:
            at, pos = [], 0
            for w in self.widths:
                at.append(pos)
                pos += w
        self.at = list(at)
        self.span = max((a + w for a, w in zip(self.at, self.widths)), default=0)
        self.starts, pos = [], 0
        for n in self.sizes:
            self.starts.append(pos)
            pos += n

    def encode(
        self, flat: torch.Tensor, out: torch.Tensor, decoded: bool = False
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Encode ``flat`` (the tensors, FP32, one after another) into ``out`` (uint8, at least
        ``span + 1`` bytes: byte ``span`` is scratch, for the caller to overwrite). Returns what
        peers decode of it where the codec knows it on the way ((indices, values) for a sparse
        one), or with ``decoded`` always (else ``(None, None)``)."""
        raise NotImplementedError

    def decode(
        self, payload: torch.Tensor, into: torch.Tensor | None = None, add: bool = False
    ) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
        """(flat indices or None, FP32 values, a 0-d bool: whether the payload breaks a rule
        of the format) of ``payload`` read at the plan's places; no host read. A dense plan
        takes ``into``, an FP32 buffer of ``numel`` its values are written into (with ``add``,
        added to), returned as the values."""
        raise NotImplementedError

    def headers_bad(self, payload: torch.Tensor) -> torch.Tensor:
        """Whether a header of ``payload`` is not its tensor's (a 0-d bool, nothing read;
        ``header_at`` and ``header_want`` are :func:`._format.set_headers`')."""
        return (payload[self.header_at] != self.header_want).any()

    def check(self, payload: torch.Tensor) -> torch.Tensor:
        """Whether ``payload`` breaks a rule of the format (a 0-d bool), without its values
        where the plan can tell so."""
        return self.decode(payload)[2]

    def explain(self, payload: torch.Tensor, names: list[str]) -> None:
        """PayloadError for the first tensor of ``payload`` that breaks a rule, named by
        ``names`` (the error path, after :meth:`decode` said one does)."""
        for i, (shape, name) in enumerate(zip(self.shapes, names)):
            piece = payload[self.at[i] : self.at[i] + self.widths[i]]
            self.codec.explain_size(piece, shape, name)
            self.codec.explain(piece, shape, name)
        raise PayloadError(f"{', '.join(names[:1])}...: the payload does not decode")


class TensorwisePlan(Plan):
    """A plan for a codec without one (a plugin's): its own ``encode`` and ``decode`` tensor by
    tensor. Dense decodes; a payload that fails to decode says so in the flag."""

    def encode(
        self, flat: torch.Tensor, out: torch.Tensor, decoded: bool = False
    ) -> tuple[None, torch.Tensor | None]:
        for shape, a, w, s, n in zip(self.shapes, self.at, self.widths, self.starts, self.sizes):
            out[a : a + w] = self.codec.encode(flat[s : s + n].view(shape))
        return None, self.decode(out)[1] if decoded else None

    def decode(
        self, payload: torch.Tensor, into: torch.Tensor | None = None, add: bool = False
    ) -> tuple[None, torch.Tensor, torch.Tensor]:
        values = torch.zeros(self.numel, dtype=torch.float32, device=payload.device)
        bad = False
        for shape, a, w, s, n in zip(self.shapes, self.at, self.widths, self.starts, self.sizes):
            try:
                values[s : s + n] = self.codec.decode(payload[a : a + w], shape).reshape(-1)
            except PayloadError:
                bad = True
        return None, written(values, into, add), torch.tensor(bad, device=payload.device)


def written(values: torch.Tensor, into: torch.Tensor | None, add: bool) -> torch.Tensor:
    """``values`` as a dense plan's decode returns them: as they are, or written into ``into``
    (with ``add``, added to it), which is then returned."""
    if into is None:
        return values if values.dtype == torch.float32 else values.float()
    return into.add_(values) if add else into.copy_(values)


def check_bytes(payload: Any, name: str) -> None:
    """PayloadError naming ``name`` unless ``payload`` is a 1-D uint8 tensor."""
    if not isinstance(payload, torch.Tensor):
        raise PayloadError(
            f"{name}: payload is a {type(payload).__name__}, expected a uint8 tensor"
        )
    if payload.dtype != torch.uint8 or payload.dim() != 1:
        raise PayloadError(
            f"{name}: payload must be a 1-D uint8 tensor, got {payload.dtype} of shape "
            f"{tuple(payload.shape)}"
        )


def numel_of(shape: Any) -> int:
    """Elements of a shape (a Python int)."""
    return math.prod(tuple(shape))


def as_float_input(x: torch.Tensor) -> torch.Tensor:
    """Flat fp32 view (or copy) of a float tensor to encode."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"expected a tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"codecs encode floating-point tensors, got {x.dtype}")
    return x.detach().reshape(-1).to(torch.float32)
