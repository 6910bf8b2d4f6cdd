"""Dense codecs: FP32, BF16, FP16.

Wire format: the 16-byte header (parameter 0), then the ``numel`` values in the codec's dtype,
little-endian, in the tensor's row-major order. FP32 is exact; BF16/FP16 round to nearest even
(IEEE conversion: FP16 overflows to inf beyond 65504, and non-finite values pass through, as
they do in FP32 — dense payloads carry no scales to validate).

A bucket's values are cast once and copied to (and from) each tensor's place as bytes by one
multi-tensor copy: a tensor's place in a bucket's payload need not be aligned to its dtype.
"""

from __future__ import annotations

import torch

from ._format import HEADER_BYTES, check_payload, numel_of, set_headers
from .base import Codec, Plan, written
from .registry import register

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@register("fp32", wire_id=1, dense=True, args={"name": "fp32"})
@register("bf16", wire_id=2, dense=True, args={"name": "bf16"})
@register("fp16", wire_id=3, dense=True, args={"name": "fp16"})
class DenseCodec(Codec):
    def __init__(self, name: str = "fp32") -> None:
        if name not in _DTYPES:
            raise ValueError(f"dense codec must be one of {sorted(_DTYPES)}, got {name!r}")
        self.name = name
        self.dtype = _DTYPES[name]
        self.itemsize = torch.empty((), dtype=self.dtype).element_size()

    def __repr__(self) -> str:
        return f"DenseCodec({self.name!r})"

    def nbytes(self, shape: torch.Size) -> int:
        return HEADER_BYTES + numel_of(shape) * self.itemsize

    def formula_bits_per_param(self, shape: torch.Size) -> float:
        return 8.0 * self.itemsize

    def _make_plan(
        self, shapes: list[torch.Size], device: torch.device, at: list[int] | None
    ) -> DensePlan:
        return DensePlan(self, shapes, device, at)

    def explain(self, payload: torch.Tensor, shape: torch.Size, name: str = "tensor") -> None:
        check_payload(
            payload,
            name=name,
            codec=self.name,
            describe=self.name,
            expected_nbytes=self.nbytes(shape),
            param=0,
            numel=numel_of(shape),
            shape=shape,
        )


class DensePlan(Plan):
    """A bucket's values in the codec's dtype after each tensor's header."""

    def __init__(
        self,
        codec: DenseCodec,
        shapes: list[torch.Size],
        device: torch.device,
        at: list[int] | None = None,
    ) -> None:
        super().__init__(codec, shapes, device, at)
        self.dtype, size = codec.dtype, codec.itemsize
        set_headers(self, [0] * len(self.sizes))
        # (payload bytes, bytes of the cast values) of each non-empty tensor
        self.places = [
            (a + HEADER_BYTES, s * size, n * size)
            for a, s, n in zip(self.at, self.starts, self.sizes)
            if n
        ]

    def encode(
        self, flat: torch.Tensor, out: torch.Tensor, decoded: bool = False
    ) -> tuple[None, torch.Tensor | None]:
        out[self.header_at] = self.header_want
        cast = flat.to(self.dtype)
        raw = cast.view(torch.uint8)
        _copy(
            [out[p : p + n] for p, _, n in self.places], [raw[s : s + n] for _, s, n in self.places]
        )
        return None, cast.float() if decoded else None

    def decode(
        self, payload: torch.Tensor, into: torch.Tensor | None = None, add: bool = False
    ) -> tuple[None, torch.Tensor, torch.Tensor]:
        bad = self.headers_bad(payload)
        raw = torch.empty(
            self.numel * self.codec.itemsize, dtype=torch.uint8, device=payload.device
        )
        _copy(
            [raw[s : s + n] for _, s, n in self.places],
            [payload[p : p + n] for p, _, n in self.places],
        )
        return None, written(raw.view(self.dtype), into, add), bad


def _copy(targets: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    if targets:
        torch._foreach_copy_(targets, sources)
