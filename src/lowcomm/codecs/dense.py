"""Dense codecs: FP32, BF16, FP16.

Wire format: the 16-byte header (parameter 0), then the ``numel`` values in the codec's dtype,
little-endian, in the tensor's row-major order. FP32 is exact; BF16/FP16 round to nearest even
(IEEE conversion: FP16 overflows to inf beyond 65504, and non-finite values pass through, as
they do in FP32 — dense payloads carry no scales to validate).
"""

from __future__ import annotations

import torch

from ._format import HEADER_BYTES, check_payload, numel_of, write_header
from .base import Codec
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

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        if not x.is_floating_point():
            raise TypeError(f"codecs encode floating-point tensors, got {x.dtype}")
        flat = x.detach().reshape(-1)
        n = flat.numel()
        payload = torch.empty(self.nbytes((n,)), dtype=torch.uint8, device=x.device)
        write_header(payload, self.name, 0, n)
        payload[HEADER_BYTES:].view(self.dtype).copy_(flat)
        return payload

    def decode(
        self, payload: torch.Tensor, shape: torch.Size, name: str = "tensor"
    ) -> torch.Tensor:
        shape = torch.Size(shape)
        n = numel_of(shape)
        payload = check_payload(
            payload,
            name=name,
            codec=self.name,
            describe=self.name,
            expected_nbytes=self.nbytes(shape),
            param=0,
            numel=n,
            shape=shape,
        )
        data = payload[HEADER_BYTES:].view(self.dtype)
        out = torch.empty(n, dtype=torch.float32, device=payload.device)
        out.copy_(data)
        return out.view(shape)
