"""Outer optimizers: update the global copy from the averaged pseudo-gradient. Pure math.

Sign convention (ALGORITHMS.md): pseudo_grad = theta_global - theta_local, so a descent step
theta_global <- theta_global - lr * pseudo_grad moves the global copy toward the workers.
Each optimizer keeps state per key (one key per fragment), so fragments are independent.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from .config import SyncConfig


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
        if self.momentum > 0:
            st = self.state.setdefault(key, {})
            buf = st.get("momentum")
            if buf is None:
                buf = st["momentum"] = g.detach().clone()
            else:
                buf.mul_(self.momentum).add_(g)
            g = g.add(buf, alpha=self.momentum) if self.nesterov else buf
        global_params.add_(g, alpha=-self.lr)


def make_outer(cfg: SyncConfig) -> OuterOptimizer:
    """The outer optimizer the config names."""
    if cfg.outer_optimizer == "nesterov":
        return OuterSGD(cfg.outer_lr, cfg.outer_momentum, nesterov=cfg.nesterov)
    if cfg.outer_optimizer == "sgd":
        return OuterSGD(cfg.outer_lr, 0.0)
    raise NotImplementedError(
        f"outer_optimizer={cfg.outer_optimizer} is not implemented yet: use nesterov or sgd")
