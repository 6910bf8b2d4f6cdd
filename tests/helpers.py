"""Small deterministic pieces shared by tests (importable from spawned workers)."""

from __future__ import annotations

import numpy as np
import torch

from lowcomm.train.data import Batches
from lowcomm.train.model import build_model

SEQ, BATCH = 16, 4


def tokens(n: int = 20000, seed: int = 1234) -> np.ndarray:
    """A synthetic byte-token corpus with some structure (so losses move)."""
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 256, size=257)
    return base[(np.arange(n) * 7 + rng.integers(0, 3, size=n)) % 257].astype(np.int64)


def tiny_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return build_model("tiny", max_seq_len=SEQ)


def adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)


def batches(rank: int, world: int, seed: int = 0) -> Batches:
    return Batches(tokens(), BATCH, SEQ, rank, world, seed)


def flat_params(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).float() for p in model.parameters()])


def local_steps(
    model: torch.nn.Module, opt: torch.optim.Optimizer, data: Batches, steps: int
) -> None:
    """``steps`` plain inner steps of one worker (what the references replay per worker)."""
    for _ in range(steps):
        x, y = data.next()
        model(x, y).backward()
        opt.step()
        opt.zero_grad()


class StepGate:
    """Holds each job the engine hands its comm thread until the training thread has begun an
    inner step after handing it over. An engine that overlaps training with its collectives
    passes at once; one that waited for the job before training on never lets that step begin,
    and the hold gives up (recorded False) after ``wait_s``. Checks an order of events, so it
    holds on any machine, however fast or loaded."""

    def __init__(self, transport, wait_s: float = 60.0) -> None:
        import threading

        self.cond, self.begun, self.held, self.closed = threading.Condition(), 0, [], False
        self.done = 0  # jobs that ran to their end on the comm thread
        submit = transport.submit

        def submitted(fn):
            with self.cond:
                need = 0 if self.closed else self.begun + 1

            def held():
                with self.cond:
                    self.held.append(self.cond.wait_for(lambda: self.begun >= need, wait_s))
                out = fn()
                with self.cond:
                    self.done += 1
                return out

            return submit(held)

        transport.submit = submitted

    def step(self) -> None:
        """The training thread begins an inner step."""
        with self.cond:
            self.begun += 1
            self.cond.notify_all()

    def close(self) -> None:
        """No more inner steps: jobs handed over from now on (the last sends', leaving the
        block) are not held, and those waiting go."""
        with self.cond:
            self.closed, self.begun = True, 1 << 62
            self.cond.notify_all()
