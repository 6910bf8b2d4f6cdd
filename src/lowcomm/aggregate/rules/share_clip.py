"""``cosine-clip`` whose top-k merge counts an entry few sites sent as those sites' share, not
the whole: each entry's sum over the sites that sent it is divided by the number of senders or a
majority of the contributions, whichever is larger.

Why: the selected mean applies an entry one site alone sent in full. A bad site that spends its
clipped budget on indices nobody else picks (on top-k most entries have one sender, so a dot
product with the others of about 0 says nothing) moves those entries as far as every honest
site together, every sync, in a fixed direction. Here an entry a majority sent is their selected
mean, as before; one that fewer sent moves by their share of a majority (with 8 sites, a lone
sender's 1/5), so a minority moves the model no more on entries of its own than its members'
share of a majority.

What an honest site's entry did not get applied is not lost: the rule hands the share it held
back (``1 - c / max(c, floor)`` of the entry) to the sender's error buffer (as a weighted merge
does), and the site sends it again, grown, until it is applied or others pick it too. On dense
codecs every site sends every entry, so this is ``cosine-clip`` exactly."""

from __future__ import annotations

import torch

from ..combine import Contributions
from .cosine_clip import CosineClip


class ShareClip(CosineClip):
    """``cosine-clip``; on top-k each entry divided by max(senders, a majority of the parts),
    and what of this site's part that left unapplied handed back to its error buffer."""

    name = "share-clip"
    restores = True  # unweighted too: the gather exchange asks unapplied() of this rule

    def merge_sparse(
        self, parts: Contributions, kept: torch.Tensor, keep: torch.Tensor, out: torch.Tensor
    ) -> torch.Tensor:
        each = parts.segments.spread(keep)
        counts = torch.zeros(parts.numel, dtype=torch.float32, device=out.device)
        out.zero_()
        for j in range(len(parts)):  # one sender after the other: the same bits everywhere
            out.index_add_(0, parts.index(j), kept[j])
            counts.index_add_(0, parts.index(j), each[j].float())
        present = parts.present.sum() if parts.present is not None else len(parts)
        divisor = counts.clamp_min(present // 2 + 1)  # max(senders, a majority)
        out.div_(divisor)
        # each entry's share applied, c / max(c, floor), and which (part, tensor) it was of
        self._share, self._keep = counts / divisor, keep
        return out

    def unapplied(self, parts: Contributions, j: int) -> tuple[torch.Tensor, torch.Tensor]:
        """On top-k: what of part ``j`` the last merge held back, in the units of the error
        buffer (those of the selected mean, which applies a part whole): ``(1 - c / max(c,
        floor)) v`` at its entries, ``v`` in a tensor where the part was left out. (What
        clipping took is not handed back, as no robust rule hands it back.) Dense: nothing."""
        if not parts.sparse:
            return super().unapplied(parts, j)  # type: ignore[return-value]
        idx, vals = parts.index(j), parts.values(j)
        kept = parts.segments.spread(self._keep[j])
        return idx, torch.where(kept, vals * (1.0 - self._share[idx]), vals)
