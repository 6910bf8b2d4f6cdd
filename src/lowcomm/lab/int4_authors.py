"""The LoCo authors' 4-bit quantiser (their DeepSpeed kernels), beside our ``int4``.

Per group of ``block_size`` elements with absmax ``a``, the scale is ``s = a / 8`` and an element
``x`` becomes ``q = clamp(round(x / s), -8, 7)`` (round half to even; only ``+a`` itself, which
would be ``+8``, is clipped to 7), decoding to ``q * s``. Our ``int4`` instead uses ``s = a / 7``
and the symmetric codes ``-7..7``: one code fewer, but no clipping. The authors pick one group per
``min(rows, cols)`` elements of a matrix (:func:`authors_group_size`); as a codec the group is
the ``block_size`` it is built with, so that any 1-D slice encodes the same way (element-wise).
The LoCo hooks' ``loco_quantizer=authors`` uses it (the lab registers it as ``int4-authors``).

Wire format: as every block codec (see ``lowcomm.codecs.block``); a code ``q`` is stored as
``q + 8``, so all 16 codes are valid. Bits per element: ``4 + 32 / block_size``.
"""

from __future__ import annotations

import torch

from lowcomm.codecs.block import DEFAULT_BLOCK_SIZE, BlockCodec
from lowcomm.codecs.registry import register

_MAGIC = float(2**23)


@register("int4-authors", wire_id=10, options=("block_size",))
class AuthorsInt4Codec(BlockCodec):
    """absmax/8 int4, codes -8..7 (top clipped), round half to even, per ``block_size`` group."""

    bits = 4
    pad_code = 8  # the zero code
    invalid_codes = "none: all 16 codes are valid"

    def __init__(self, block_size: int = DEFAULT_BLOCK_SIZE) -> None:
        super().__init__(block_size, stochastic=False, generator=None)

    def quantize_rows(self, xb: torch.Tensor, scales: torch.Tensor, codes: torch.Tensor) -> None:
        s = self.block_absmax(xb, scales).div_(8.0)
        scales.copy_(s)
        work = torch.div(xb, s[:, None])
        # round half to even into the low mantissa bits: codes land in [0, 16], then clip 16
        work.add_(_MAGIC + 8.0)
        codes.copy_(work.view(torch.int32).view(-1))
        codes.clamp_(max=15)

    def dequantize_rows(
        self, codes: torch.Tensor, scales: torch.Tensor, out: torch.Tensor
    ) -> torch.Tensor:
        out.copy_(codes.view(out.shape))
        out.sub_(8.0).mul_(scales[:, None])
        return torch.zeros((), dtype=torch.bool, device=out.device)
