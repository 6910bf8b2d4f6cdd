"""Segments of a flat vector: the tensors of a bucket laid one after another, and per-segment
sums, maxima and spreads over every row of a matrix at once. The codecs' statistics (a top-k
table's per tensor) and the combine rules' per-tensor decisions (a robust rule's norms) run on
them: launches that do not grow with the number of segments, and no read of the device."""

from __future__ import annotations

import torch


class Segments:
    """Segments of ``lengths`` entries one after another (some may be empty)."""

    def __init__(self, lengths: list[int] | torch.Tensor, device: torch.device) -> None:
        if isinstance(lengths, torch.Tensor):
            self.lengths_t = lengths.to(device=device, dtype=torch.int64)
            self.count = int(lengths.numel())
            self.total = None
        else:
            self.lengths_t = torch.tensor(list(lengths), dtype=torch.int64, device=device)
            self.count = len(lengths)
            self.total = sum(lengths)

    def _reduce(self, x: torch.Tensor, how: str) -> torch.Tensor:
        if self.count == 0:  # (segment_reduce wants at least one segment)
            return x.new_zeros((*x.shape[:-1], 0))
        if x.dim() == 1:
            return torch.segment_reduce(x, how, lengths=self.lengths_t, initial=0, unsafe=True)
        lengths = self.lengths_t.expand(x.shape[0], self.count).contiguous()
        return torch.segment_reduce(x, how, lengths=lengths, axis=1, initial=0, unsafe=True)

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of each segment of ``x`` ([V], or each row of [m, V]): [T] (or [m, T]); 0
        for an empty segment."""
        return self._reduce(x, "sum")

    def max(self, x: torch.Tensor) -> torch.Tensor:
        """Each segment's largest entry (NaN propagates; an empty segment's: 0)."""
        return self._reduce(x, "max")

    def spread(self, per_segment: torch.Tensor) -> torch.Tensor:
        """Values per segment ([..., T]) repeated over their segments' entries ([..., V])."""
        return torch.repeat_interleave(per_segment, self.lengths_t, dim=-1, output_size=self.total)
