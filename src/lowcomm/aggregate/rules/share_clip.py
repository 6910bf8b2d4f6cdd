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

from ..combine import Parts
from ._robust import readable
from .cosine_clip import CosineClip


class ShareClip(CosineClip):
    """``cosine-clip``; on top-k each entry divided by max(senders, a majority of the parts),
    and what of this site's part that left unapplied handed back to its error buffer."""

    name = "share-clip"
    restores = True  # unweighted too: the gather exchange asks unapplied() of this rule

    def merge_sparse(
        self,
        parts: Parts,
        sent: list[tuple[torch.Tensor, torch.Tensor]],
        at: list[int],
        out: torch.Tensor,
    ) -> torch.Tensor:
        n = parts.shape.numel()
        counts = torch.zeros(n, dtype=torch.float32, device=out.device)
        out.zero_()
        for idx, vals in sent:  # one sender after the other: the same bits everywhere
            out.index_add_(0, idx, vals)
            counts.index_add_(0, idx, torch.ones(idx.numel(), device=out.device))
        divisor = counts.clamp_min(len(parts) // 2 + 1)  # max(senders, a majority)
        out.div_(divisor)
        # each entry's share applied, c / max(c, floor), and which parts it was of (unapplied)
        self._share, self._kept = counts / divisor, set(at)
        return out

    def unapplied(self, parts: Parts, j: int) -> tuple[torch.Tensor, torch.Tensor]:
        """On top-k: what of part ``j`` the last merge held back, in the units of the error
        buffer (those of the selected mean, which applies a part whole): ``(1 - c / max(c,
        floor)) v`` at its entries, ``v`` where the part was left out. (What clipping took is
        not handed back, as no robust rule hands it back.) Dense: nothing."""
        if not hasattr(parts.codec, "decode_sparse"):
            return super().unapplied(parts, j)
        got = readable(parts, j, sparse=True)
        if got is None:  # (never this site's own: it checked its values before sending)
            return torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.float32)
        idx, vals = got
        if j not in getattr(self, "_kept", ()):
            return idx, vals
        return idx, vals * (1.0 - self._share[idx])
