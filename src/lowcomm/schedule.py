"""Fragments and the sync schedule. Pure: no torch.distributed, no tensors (and no torch import
at module level, so the simulator shares these rules without needing torch).

Every decision here is a function of the global inner step and the config only, so every worker
syncs the same fragment at the same step (docs/algorithms.md §2: mismatched order deadlocks).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .errors import ConfigError


def find_blocks(model: Any) -> list[str]:
    """Module-name prefixes of the model's repeated blocks, in order; [] if it has none.

    The blocks are the largest list of same-type modules anywhere in the model: an
    ``nn.ModuleList`` or ``nn.Sequential`` of two or more children of one class, the one holding
    the most parameters (ties: more children, then the first found). Names come from
    ``named_modules``, so wrapper prefixes (``_orig_mod.`` of torch.compile, ``module.`` of DDP)
    are part of them, exactly as in ``named_parameters``.
    """
    import torch.nn as nn

    best: tuple[int, int] = (0, 0)
    found: list[str] = []
    for name, module in model.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)):
            continue
        children = list(module.named_children())
        if len(children) < 2 or len({type(c) for _, c in children}) != 1:
            continue
        size = (sum(p.numel() for p in module.parameters()), len(children))
        if size[0] > 0 and size > best:
            best = size
            found = [f"{name}.{child}" if name else child for child, _ in children]
    return found


def expand_fragment_modules(groups: list[list[str]], param_names: list[str]) -> list[list[str]]:
    """Parameter names per fragment from module or parameter name prefixes (``fragment_modules=``).

    An entry matches a parameter equal to it or under it (``layers.0`` matches ``layers.0.w``);
    wrapper prefixes (``_orig_mod.``, ``module.``) may be left out.
    """

    def bare(name: str) -> str:
        for prefix in _WRAPPER_PREFIXES:
            while name.startswith(prefix):
                name = name[len(prefix) :]
        return name

    out: list[list[str]] = []
    for i, group in enumerate(groups):
        if isinstance(group, str) or not all(isinstance(g, str) for g in group):
            raise ConfigError(
                f"fragment_modules[{i}] must be a list of module or parameter names, got {group!r}"
            )
        wanted = [bare(g) for g in group]
        out.append(
            [
                n
                for n in param_names
                if any(bare(n) == w or bare(n).startswith(w + ".") for w in wanted)
            ]
        )
    return out


# Prefixes that wrappers add to parameter names: torch.compile and DDP/FSDP1.
_WRAPPER_PREFIXES = ("_orig_mod.", "module.", "_fsdp_wrapped_module.")


def assign_blocks(n_blocks: int, n_groups: int, pattern: str) -> list[list[int]]:
    """Split block indices 0..n_blocks-1 into n_groups: strided (b mod n) or sequential runs."""
    if n_groups < 1 or n_groups > n_blocks:
        raise ConfigError(f"cannot split {n_blocks} blocks into {n_groups} fragments")
    if pattern == "strided":
        return [list(range(g, n_blocks, n_groups)) for g in range(n_groups)]
    if pattern == "sequential":
        base, extra = divmod(n_blocks, n_groups)
        out, start = [], 0
        for g in range(n_groups):
            size = base + (1 if g < extra else 0)
            out.append(list(range(start, start + size)))
            start += size
        return out
    raise ConfigError(f"unknown fragment_pattern '{pattern}': choose strided or sequential")


def resolve_fragment_count(n_blocks: int, fragments: int, blocks_per_fragment: int) -> int:
    """P from either `fragments` or `blocks_per_fragment`, validated against the block count."""
    if blocks_per_fragment > 0:
        if n_blocks == 0:
            raise ConfigError(
                "blocks_per_fragment needs a model with a block list "
                "(model.blocks / model.layers / ...) or explicit fragments"
            )
        return -(-n_blocks // blocks_per_fragment) + 1
    if fragments > 1 and fragments > n_blocks + 1:
        raise ConfigError(
            f"fragments={fragments} but the model has {n_blocks} blocks: "
            f"P must be <= blocks + 1 = {n_blocks + 1}"
        )
    return fragments


def build_fragments(
    param_names: list[str],
    block_prefixes: list[str],
    fragments: int,
    blocks_per_fragment: int = 0,
    pattern: str = "strided",
) -> list[list[str]]:
    """Parameter names per fragment (docs/algorithms.md §2).

    P = 1: one fragment with everything. P >= 2: fragment 0 holds every parameter outside the
    blocks (embeddings, final norm, head); blocks are split among fragments 1..P-1.
    """
    P = resolve_fragment_count(len(block_prefixes), fragments, blocks_per_fragment)
    if P == 1:
        return [list(param_names)]
    groups = assign_blocks(len(block_prefixes), P - 1, pattern)
    block_of: dict[str, int] = {}
    for name in param_names:
        for b, prefix in enumerate(block_prefixes):
            if name.startswith(prefix + "."):
                block_of[name] = b
                break
    frag_of_block = {b: g + 1 for g, blocks in enumerate(groups) for b in blocks}
    out: list[list[str]] = [[] for _ in range(P)]
    for name in param_names:
        out[frag_of_block[block_of[name]] if name in block_of else 0].append(name)
    if not out[0]:
        out = out[1:]  # a model made only of blocks has no embeddings fragment
    return out


def check_fragments(fragments: list[list[str]], param_names: list[str]) -> None:
    """Every trainable parameter in exactly one non-empty fragment, or ConfigError."""
    seen: dict[str, int] = {}
    for i, frag in enumerate(fragments):
        if not frag:
            raise ConfigError(f"fragment {i} is empty: every fragment needs at least one parameter")
        for name in frag:
            if name in seen:
                raise ConfigError(
                    f"parameter '{name}' is in fragments {seen[name]} and {i}: "
                    f"each parameter must be in exactly one"
                )
            seen[name] = i
    known = set(param_names)
    unknown = [n for n in seen if n not in known]
    if unknown:
        raise ConfigError(f"fragments name parameters the model does not have: {unknown[:5]}")
    missing = [n for n in param_names if n not in seen]
    if missing:
        raise ConfigError(
            f"parameters in no fragment: {missing[:5]}: fragments must cover every parameter"
        )


@dataclass(frozen=True)
class Schedule:
    """When each fragment is sent and when its result is applied, from the global step only.

    Fragment p is sent after inner step t when t >= 1 and (t - t_p) mod H == 0, with offsets
    t_p = floor(p * H / P) spread evenly over [0, H); its result is applied after step t + tau.
    So every fragment sees exactly H inner steps between two of its sends.
    """

    sync_every: int
    n_fragments: int = 1
    overlap: int = 0

    def __post_init__(self) -> None:
        """The overlap rule: a fragment's result lands before the next fragment is sent, except
        CO2's whole-round overlap (tau = H, one fragment)."""
        H, tau, P = self.sync_every, self.overlap, self.n_fragments
        if tau == 0 or self.is_round_overlap():
            return
        if tau * P >= H:
            raise ConfigError(
                f"overlap (tau={tau}) must be < H/P = {H}/{P}: "
                f"a fragment's result must land before the next fragment is sent; "
                f"lower overlap, raise sync_every or use fewer "
                f"fragments (or overlap=sync_every with fragments=1 for CO2's whole-round overlap)"
            )

    def offset(self, p: int) -> int:
        """t_p: the step offset of fragment p."""
        return (p * self.sync_every) // self.n_fragments

    def sends_at(self, step: int) -> list[int]:
        """Fragments whose pseudo-gradient is sent after inner step ``step`` (1-based)."""
        if step < 1:
            return []
        return [
            p for p in range(self.n_fragments) if (step - self.offset(p)) % self.sync_every == 0
        ]

    def syncs_through(self, step: int) -> int:
        """How many inner steps in 1..``step`` send something: the run's sync count, the same
        on every site (one that joined later included)."""
        H, total = self.sync_every, 0
        for r in sorted({self.offset(p) % H for p in range(self.n_fragments)}):
            if r == 0:
                total += step // H
            elif step >= r:
                total += (step - r) // H + 1
        return total

    def next_send(self, step: int) -> int:
        """The first inner step after ``step`` that sends something."""
        return next(u for u in range(step + 1, step + self.sync_every + 1) if self.sends_at(u))

    def apply_step(self, send_step: int) -> int:
        """The inner step after which a result sent at ``send_step`` is applied."""
        return send_step + self.overlap

    def is_round_overlap(self) -> bool:
        """CO2's mode: the collective spans a whole round (tau = H, one fragment)."""
        return self.overlap > 0 and self.overlap == self.sync_every and self.n_fragments == 1
