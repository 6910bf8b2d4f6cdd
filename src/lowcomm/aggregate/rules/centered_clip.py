"""Centered clipping (Karimireddy, He and Jaggi, ICML 2021; the rule BTARD runs inside its
all-reduce): from a centre ``v``, each contribution's distance to it is clipped to ``tau`` and
the centre moves by their mean, ``v <- v + mean_i clip(x_i - v, tau)``, a few times.

The paper starts from the previous round's aggregate (with momentum) and fixes ``tau``. A sync's
contributions are one round of it, so we start from the coordinate-wise median (robust on its
own) and take ``tau`` as the median distance to the centre each iteration: no setting to tune
per model, and at most half the sites, the far ones, are clipped. Three iterations, as the
paper's experiments. Dense codecs only (see ``median``)."""

from __future__ import annotations

import torch

from ._robust import Robust, clip_to, mean_rows, median_of, median_rows

ITERATIONS = 3


class CenteredClip(Robust):
    """The centre the contributions settle on when each pulls at most ``tau``."""

    name = "centered-clip"

    def robust(self, rows: torch.Tensor) -> torch.Tensor:
        centre = median_rows(rows)
        for _ in range(ITERATIONS):
            away = rows - centre
            norms = away.norm(dim=1)
            tau = median_of(norms)
            if not bool(tau > 0):  # half the sites sit on the centre: it stays
                break
            centre = centre + mean_rows(clip_to(away, norms, tau))
        return centre
