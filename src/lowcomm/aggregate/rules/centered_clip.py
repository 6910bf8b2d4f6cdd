"""Centered clipping (Karimireddy, He and Jaggi, ICML 2021; the rule BTARD runs inside its
all-reduce): from a centre ``v``, each contribution's distance to it is clipped to ``tau`` and
the centre moves by their mean, ``v <- v + mean_i clip(x_i - v, tau)``, a few times.

The paper starts from the previous round's aggregate (with momentum) and fixes ``tau``. A sync's
contributions are one round of it, so we start from the coordinate-wise median (robust on its
own) and take ``tau`` as the median distance to the centre each iteration: no setting to tune
per model, and at most half the sites, the far ones, are clipped. Three iterations, as the
paper's experiments; a tensor whose ``tau`` is 0 (half the sites sit on its centre) stops
there. Dense codecs only (see ``median``)."""

from __future__ import annotations

import torch

from ...segments import Segments
from ._robust import Robust, divided, median_of, scale_to, sum_rows

ITERATIONS = 3


class CenteredClip(Robust):
    """The centre the contributions settle on when each pulls at most ``tau``."""

    name = "centered-clip"

    def robust_rows(self, rows: torch.Tensor, usable: torch.Tensor, seg: Segments) -> torch.Tensor:
        each = seg.spread(usable)
        count = seg.spread(usable.sum(dim=0))
        centre = median_of(rows, each)
        moving = torch.ones(seg.count, dtype=torch.bool, device=rows.device)
        for _ in range(ITERATIONS):
            away = torch.where(each, rows - centre, 0.0)
            norms = seg.sum(away * away).sqrt()
            tau = median_of(norms, usable)
            moving &= tau > 0
            step = divided(sum_rows(away * seg.spread(scale_to(norms, tau))), count)
            centre = torch.where(seg.spread(moving), centre + step, centre)
        return centre
