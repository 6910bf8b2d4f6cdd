"""Outer optimizers: update the global copy from the averaged pseudo-gradient. Pure math.

Sign convention (docs/algorithms.md): pseudo_grad = theta_global - theta_local, so a descent step
theta_global <- theta_global - lr * pseudo_grad moves the global copy toward the workers.
Each optimizer keeps state per key (one key per fragment), so fragments are independent.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from .config import SyncConfig

# Elements per piece of a sequence of element-wise ops on a CPU: the sequence's temporaries
# and re-reads stay in the core's cache, so it costs one pass over its inputs and outputs.
CHUNK = 1 << 16


def chunk(t: torch.Tensor) -> int:
    """Elements per piece for fused element-wise work on ``t``: :data:`CHUNK` on a CPU, the
    whole tensor on an accelerator (one kernel launch per op)."""
    return CHUNK if t.device.type == "cpu" else max(1, t.numel())


class OuterOptimizer(ABC):
    """Update a flat global buffer in place from a flat averaged pseudo-gradient."""

    def __init__(self) -> None:
        self.state: dict[str, dict[str, torch.Tensor]] = {}

    @abstractmethod
    def step(self, key: str, global_params: torch.Tensor, pseudo_grad: torch.Tensor) -> None:
        """Apply one outer step to ``global_params`` (modified in place)."""

    def state_dict(self) -> dict:
        """Tensors and plain types only (loadable with weights_only=True)."""
        return {k: {n: t.clone() for n, t in s.items()} for k, s in self.state.items()}

    def load_state_dict(self, sd: dict) -> None:
        """Restore from ``state_dict()``."""
        self.state = {k: {n: t.clone() for n, t in s.items()} for k, s in sd.items()}


class OuterSGD(OuterOptimizer):
    """SGD with optional (Nesterov) momentum, the same math as torch.optim.SGD (dampening 0).

    buf <- mu*buf + g (buf = g at the first step); update = g + mu*buf (Nesterov) or buf.
    momentum = 0 gives plain SGD with the learning rate applied exactly once (SparseLoCo).
    """

    def __init__(self, lr: float, momentum: float = 0.0, nesterov: bool = False) -> None:
        super().__init__()
        self.lr, self.momentum, self.nesterov = lr, momentum, nesterov

    def step(self, key: str, global_params: torch.Tensor, pseudo_grad: torch.Tensor) -> None:
        g = pseudo_grad
        if self.momentum <= 0:
            global_params.add_(g, alpha=-self.lr)
            return
        st = self.state.setdefault(key, {})
        first = "momentum" not in st
        if first:
            st["momentum"] = g.detach().clone()
        buf = st["momentum"]
        # the same element-wise arithmetic, a cache-sized chunk at a time: the Nesterov sum
        # g + mu*buf is a temporary of one chunk, not of the model (2 model-sized passes saved)
        step = chunk(g)
        scratch = torch.empty(min(step, g.numel()), dtype=g.dtype, device=g.device)
        for at in range(0, g.numel(), step):
            gc, bc = g[at : at + step], buf[at : at + step]
            if not first:
                bc.mul_(self.momentum).add_(gc)
            update = bc
            if self.nesterov:
                update = torch.add(gc, bc, alpha=self.momentum, out=scratch[: gc.numel()])
            global_params[at : at + step].add_(update, alpha=-self.lr)


def gap_aware_penalty(
    gap: torch.Tensor, mean_abs_update: torch.Tensor, eps: float = 1e-12
) -> torch.Tensor:
    """Lambda = 1 / max(1, gap / (eps + C)), element-wise (Gap-Aware's form, docs/algorithms.md §4).

    ``gap`` is how far each global coordinate moved since the stale pseudo-gradient was computed
    (|theta_r - theta_{r-1}|), ``C`` the running mean of |outer update| of that coordinate, so
    only coordinates that moved more than usual are damped.
    """
    return 1.0 / torch.clamp(gap / (mean_abs_update + eps), min=1.0)


class OuterCO2(OuterOptimizer):
    """CO2's outer step on a one-round-stale average pseudo-gradient.

    m <- beta*m + Lambda * stale_pseudo_grad;  clip m in place;  theta <- theta - lr*m.
    Lambda is :func:`gap_aware_penalty` of the last outer update against C, the cumulative
    mean of |outer update| per element (Lambda = 1 at the first step, and when the penalty is off).
    Clipping: element-wise to +-phi (``clip_mode="element"``) or the whole momentum's L2 norm to
    phi (``"norm"``); phi = 0 turns it off. Model-sized buffers per fragment, on ``state_device``
    (the model's device by default): m only with momentum or clipping, C and the last update's
    magnitude only with the penalty; the preset (no momentum up to 16 workers, no penalty, no
    clip) keeps none.
    """

    def __init__(
        self,
        lr: float,
        momentum: float,
        penalty: bool = True,
        clip: float = 0.0,
        clip_mode: str = "element",
    ) -> None:
        super().__init__()
        if clip_mode not in ("element", "norm"):
            raise ValueError(f"clip_mode must be element or norm, got {clip_mode}")
        self.lr, self.momentum, self.penalty = lr, momentum, penalty
        self.clip, self.clip_mode = clip, clip_mode
        self.last_penalty: torch.Tensor | None = None  # for inspection and tests
        self.clipped_elements = 0  # momentum entries the clip changed, summed over steps
        self.penalized_elements = 0  # entries damped by the penalty (Lambda < 1)

    def step(self, key: str, global_params: torch.Tensor, pseudo_grad: torch.Tensor) -> None:
        st = self._state(key, global_params)
        g = pseudo_grad
        C, last = st.get("mean_abs_update"), st.get("last_update")
        if self.penalty and int(st["steps"]) > 0:
            lam = gap_aware_penalty(last.abs(), C)
            self.penalized_elements += int((lam < 1).sum())
            g = g * lam
            self.last_penalty = lam
        else:
            self.last_penalty = None
        m = st.get("momentum")
        if m is None:  # no momentum, no clip: the update is the (damped) average itself
            m = g
        else:
            m.mul_(self.momentum).add_(g)
            self._clip(m)
        if last is None:
            global_params.sub_(m if self.lr == 1.0 else m * self.lr)
        else:
            last.copy_(m).mul_(self.lr)
            global_params.sub_(last)
        st["steps"] += 1
        if C is not None:
            n = int(st["steps"])
            # from here on only |last update| is read (C, the next penalty's gap): keep that,
            # in place, rather than a model-sized abs() temporary at every step
            last.abs_()
            C.mul_((n - 1) / n).add_(last, alpha=1.0 / n)  # cumulative mean of |update|

    def _state(self, key: str, like: torch.Tensor) -> dict:
        """This fragment's state, with only the buffers the settings read: the momentum with
        momentum or clipping, C and the last update with the penalty (none for the preset)."""
        st = self.state.setdefault(key, {})
        st.setdefault("steps", torch.zeros((), dtype=torch.int64))
        if (self.momentum > 0 or self.clip > 0) and "momentum" not in st:
            st["momentum"] = torch.zeros_like(like)
        if self.penalty and "mean_abs_update" not in st:
            st["mean_abs_update"] = torch.zeros_like(like)
            st["last_update"] = torch.zeros_like(like)
        return st

    def _clip(self, m: torch.Tensor) -> None:
        if self.clip <= 0:
            return
        if self.clip_mode == "element":
            self.clipped_elements += int((m.abs() > self.clip).sum())
            m.clamp_(-self.clip, self.clip)  # in place: the public CO2 code dropped the result
            return
        norm = float(m.norm())
        if norm > self.clip:
            self.clipped_elements += m.numel()
            m.mul_(self.clip / norm)


def make_outer(cfg: SyncConfig) -> OuterOptimizer:
    """The outer optimizer the config names."""
    if cfg.outer_optimizer == "nesterov":
        return OuterSGD(cfg.outer_lr, cfg.outer_momentum, nesterov=cfg.nesterov)
    if cfg.outer_optimizer == "sgd":
        return OuterSGD(cfg.outer_lr, 0.0)
    return OuterCO2(
        cfg.outer_lr,
        cfg.outer_momentum,
        penalty=cfg.staleness_penalty,
        clip=cfg.momentum_clip,
        clip_mode=cfg.momentum_clip_mode,
    )
