"""The codec interface: a tensor <-> the bytes that really go on the wire.

A codec's payload is a 1-D ``torch.uint8`` tensor holding a small header and the packed data.
Its size depends only on the tensor's shape and the codec's settings (never on the values), so
every worker's payload for the same tensor has the same size and can be all-gathered directly.
Codecs never call torch.distributed.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from ..errors import PayloadError  # noqa: F401  (re-exported)


class Codec(ABC):
    """Encode a float tensor into packed bytes, decode it back, and report sizes."""

    #: short name used in configs (``codec=int4``)
    name: str = ""
    #: True when encoding any 1-D slice of a tensor is valid (the two-phase reduce shards flat
    #: buffers across workers, so only element-wise codecs may be used there).
    elementwise: bool = True

    @abstractmethod
    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Pack ``x`` (float, any shape) into a 1-D uint8 payload of ``nbytes(x.shape)`` bytes."""

    @abstractmethod
    def decode(
        self, payload: torch.Tensor, shape: torch.Size, name: str = "tensor"
    ) -> torch.Tensor:
        """Unpack a payload into an FP32 tensor of ``shape``; raise PayloadError naming ``name``."""

    @abstractmethod
    def nbytes(self, shape: torch.Size) -> int:
        """Exact payload size in bytes for a tensor of ``shape``."""

    @abstractmethod
    def formula_bits_per_param(self, shape: torch.Size) -> float:
        """Bits per element the format's formula predicts (headers excluded)."""

    def roundtrip(self, x: torch.Tensor) -> torch.Tensor:
        """decode(encode(x)): what a peer will see of ``x``."""
        return self.decode(self.encode(x), x.shape)
