"""How the decoded contributions become one tensor: the :class:`Combine` rule, apart from the
exchange that moves the bytes (all-reduce, gather, two-phase).

A rule is one class in one file under ``aggregate/rules/``: it sets ``name`` (which registers
it in :data:`COMBINES`) and implements :meth:`Combine.combine`, which sees one tensor's
contributions, one per site that sent one, each decoded when read (:class:`Parts`), with the
sites' weights. The rule is chosen once, when the aggregator is built (:func:`combine_for`).

The all-reduce and two-phase exchanges can only sum: they run a rule only if it is a
:class:`SumCombine` (the result is ``finish(sum_j w_j x_j, sum_j w_j)``); anything else needs
the gather exchange, which hands the rule every contribution.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar

import torch

from ..errors import ConfigError, PayloadError

if TYPE_CHECKING:
    from ..codecs.base import Codec

#: every rule by its name (the config's ``aggregation``), filled by the classes themselves
COMBINES: dict[str, type[Combine]] = {}


class Parts(Sequence[torch.Tensor]):
    """One tensor's contributions from the sites that sent one: ``parts[j]`` decodes site j's
    payload into a flat FP32 tensor when read (one at a time: a rule that needs them all at
    once stacks them); ``sparse(j)`` gives a sparse codec's (indices, values) instead."""

    def __init__(
        self,
        codec: Codec,
        payloads: list[torch.Tensor],
        shape: torch.Size,
        names: list[str],
        weights: list[float] | None,
        senders: list[int] | None = None,
        keep: bool = False,
    ) -> None:
        self.codec, self.payloads, self.shape, self.names = codec, payloads, shape, names
        self.weights = weights  # one per part, or None: every part counts once
        self.senders = senders  # each part's group rank, to name the sender of a bad payload
        # keep: each part decoded once, for a second reader (the gather's per-sender norms);
        # off, parts are decoded one at a time and let go (a plain mean streams them)
        self._kept: dict[tuple[bool, int], object] | None = {} if keep else None

    def __len__(self) -> int:
        return len(self.payloads)

    def __getitem__(self, j: int) -> torch.Tensor:  # type: ignore[override]
        if not -len(self) <= j < len(self):
            raise IndexError(j)  # ends iteration
        return self._decoded(False, j % len(self))  # type: ignore[return-value]

    def sparse(self, j: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Part ``j`` as the (indices, values) a sparse codec sent (``decode_sparse``)."""
        return self._decoded(True, j % len(self))  # type: ignore[return-value]

    def _decoded(self, sparse: bool, j: int) -> object:
        if self._kept is not None and (sparse, j) in self._kept:
            return self._kept[(sparse, j)]
        if sparse:
            decode = self.codec.decode_sparse  # type: ignore[attr-defined]
            got: object = decode(self.payloads[j], self.shape, self.names[j])
        else:
            got = self.codec.decode(self.payloads[j], self.shape, self.names[j]).reshape(-1)
        if self._kept is not None:
            self._kept[(sparse, j)] = got
        return got

    def blame(self, err: PayloadError) -> PayloadError:
        """``err`` (raised while combining) with the sender of the first part that fails to
        decode on its own: every receiver tries the parts in the same order, so all name the
        same one (``err`` as it is when no part fails alone, or the senders are unknown)."""
        if err.sender is not None or self.senders is None:
            return err
        alone = self.sparse if hasattr(self.codec, "decode_sparse") else self.__getitem__
        for j, sender in enumerate(self.senders):
            try:
                alone(j)
            except PayloadError as bad:
                return PayloadError(str(bad), sender)
        return err

    def total_weight(self) -> float:
        """The sum of the parts' weights (their count when unweighted)."""
        return sum(self.weights) if self.weights is not None else len(self)


class Combine(ABC):
    """A rule that turns the decoded contributions of one tensor into one tensor."""

    name: ClassVar[str]  # the config's ``aggregation`` value
    sum_decomposable: ClassVar[bool] = False  # set by SumCombine: all-reduce/two-phase can run it
    # not defined on a sparse codec's contributions (refused for top-k: see check_codec)
    dense_only: ClassVar[bool] = False
    # unapplied() asked of an unweighted merge too (share-clip hands back what it held back)
    restores: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        if "name" in cls.__dict__:  # a concrete rule, not a helper base
            module = cls.__module__.rpartition(".")
            if module[0] == __package__ + ".rules" and module[2].replace("_", "-") != cls.name:
                # the config lists the rules by their files' names, without importing them
                raise ValueError(
                    f"combine rule {cls.name!r} must live in rules/{module[2]}.py's name"
                )
            COMBINES[cls.name] = cls

    @abstractmethod
    def combine(self, parts: Parts, out: torch.Tensor) -> torch.Tensor:
        """Write the combination of ``parts`` (at least one) into ``out`` (flat FP32, as long
        as one part, contents unspecified) and return it. Weighted by ``parts.weights``."""

    def unapplied(self, parts: Parts, j: int) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Of part ``j`` (weighted parts), what the weighted combination did not apply, in the
        unweighted rule's units: error feedback counted all of it as sent, as it may when the
        rule is unweighted (then every part is applied as the rule applies one part), and adds
        this back (docs/algorithms.md, "Token-weighted merge"). A flat FP32 tensor, or (flat
        indices, values) where the rest is 0. Every rule that takes weights gives it."""
        raise NotImplementedError(f"aggregation={self.name} does not say what a weight left out")


class SumCombine(Combine):
    """A rule that needs only ``sum_j w_j x_j`` and ``sum_j w_j``, which an all-reduce can
    give: it implements :meth:`finish`; :meth:`combine` sums the parts and finishes."""

    sum_decomposable = True

    @abstractmethod
    def finish(self, total: torch.Tensor, weight: float) -> torch.Tensor:
        """The result, in place in ``total`` (``sum_j w_j x_j``), from ``weight`` (``sum_j w_j``;
        the count of contributions when unweighted, 0 when there were none)."""

    def share(self, weights: list[float], j: int) -> float:
        """Worker ``j``'s weight relative to an unweighted part's: ``n w_j / sum w`` over the
        ``n`` workers of weight > 0 (1 when they are equal)."""
        n = sum(1 for w in weights if w > 0)
        return n * weights[j] / sum(weights)

    def unapplied(self, parts: Parts, j: int) -> torch.Tensor:
        """``(1 - share) x_j``: the sum applied ``w_j / sum w`` of it where the unweighted rule
        applies ``1 / n`` (a negative share over-applied: it is taken back)."""
        assert parts.weights is not None
        return parts[j] * (1.0 - self.share(parts.weights, j))

    def combine(self, parts: Parts, out: torch.Tensor) -> torch.Tensor:
        out.zero_()
        for j, x in enumerate(parts):
            # unweighted, the plain sum: x * 1.0 would round the same, but costs a copy
            out += x * parts.weights[j] if parts.weights is not None else x
        return self.finish(out, parts.total_weight())


def combine_for(rule: str | Combine) -> Combine:
    """The rule named ``rule`` (a rule object is returned as it is); ConfigError if none is."""
    if isinstance(rule, Combine):
        return rule
    from . import rules  # noqa: F401  (importing the rules registers them)

    if rule not in COMBINES:
        raise ConfigError(f"unknown aggregation '{rule}': choose one of {', '.join(COMBINES)}")
    return COMBINES[rule]()


def check_sum_only(rule: Combine, method: str) -> None:
    """ConfigError if the exchange ``method`` (which can only sum) cannot run ``rule``."""
    if not rule.sum_decomposable:
        raise ConfigError(
            f"aggregation={rule.name} is not a sum and reduce={method} can only sum: "
            f"use reduce=gather"
        )


def check_codec(rule: Combine, codec: Codec | None) -> None:
    """ConfigError if ``rule`` is not defined on ``codec``'s contributions (a dense-only rule
    on a sparse codec: at top-k's density most coordinates have one sender or none)."""
    if rule.dense_only and codec is not None and hasattr(codec, "decode_sparse"):
        raise ConfigError(
            f"aggregation={rule.name} defends nothing on top-k payloads (most coordinates have "
            f"one sender or none): use aggregation=cosine-clip (or norm-clip), or a dense "
            f"codec"
        )
