"""How the decoded contributions become one tensor: the :class:`Combine` rule, apart from the
exchange that moves the bytes (all-reduce, gather, two-phase).

A rule is one class in one file under ``aggregate/rules/``: it sets ``name`` (which registers
it in :data:`COMBINES`) and implements :meth:`Combine.combine`, which sees one fragment's
contributions, one per worker that sent one, decoded by the codec's plan
(:class:`Contributions`), with the workers' weights. A rule that decides per tensor (a robust
rule's norms, its medians) does so over the fragment at once, tensor by tensor as segments of
the flat values (:class:`~lowcomm.segments.Segments`): launches that do not grow with the
number of tensors. The rule is chosen once, when the aggregator is built (:func:`combine_for`).

The all-reduce and two-phase exchanges can only sum: they run a rule only if it is a
:class:`SumCombine` (the result is ``finish(sum_j w_j x_j, sum_j w_j)``); anything else needs
the gather exchange, which hands the rule every contribution.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, ClassVar

import torch

from ..errors import ConfigError
from ..segments import Segments

if TYPE_CHECKING:
    from ..codecs.base import Codec, Plan

#: every rule by its name (the config's ``aggregation``), filled by the classes themselves
COMBINES: dict[str, type[Combine]] = {}


class Contributions:
    """One fragment's contributions from the workers that sent one, as the codec's plan decodes
    them: ``values(j)`` (flat FP32: every element for a dense codec, the kept values for a
    sparse one), ``index(j)`` (a sparse codec's flat indices), each with its ``weights[j]``.
    Given as ``decoded`` (index, values) pairs, or as the ``payloads``, decoded when read (a
    sum adds a dense one straight into its total: :meth:`add_into`).

    ``present``: None when every part is a real contribution (the plain rules: the exchange
    knows its senders); else a 0-d bool per part on the device, whether it is one (a robust
    rule combines every worker's decode without reading the device first, and leaves out the
    rest itself)."""

    def __init__(
        self,
        plan: Plan,
        decoded: list[tuple[torch.Tensor | None, torch.Tensor]] | None = None,
        weights: list[float] | None = None,
        present: torch.Tensor | None = None,
        payloads: list[torch.Tensor] | None = None,
    ) -> None:
        assert decoded is not None or payloads is not None
        self.plan, self.codec = plan, plan.codec
        self.sparse = plan.sparse
        self.decoded = decoded
        self.payloads = payloads
        self.weights = weights  # one per part, or None: every part counts once
        self.present = present
        self.numel = plan.numel
        device = plan.device
        kept = getattr(plan, "kept_sizes", None) if self.sparse else None
        #: the tensors as segments of ``values(j)`` (of the fragment's elements for ``elements``)
        self.segments = Segments(kept if kept is not None else plan.sizes, device)
        self.elements = Segments(plan.sizes, device)

    def __len__(self) -> int:
        return len(self.decoded) if self.decoded is not None else len(self.payloads or [])

    def _pair(self, j: int) -> tuple[torch.Tensor | None, torch.Tensor]:
        if self.decoded is not None:
            return self.decoded[j]
        assert self.payloads is not None
        idx, values, _ = self.plan.decode(self.payloads[j])
        return idx, values

    def values(self, j: int) -> torch.Tensor:
        """Part ``j``'s decoded values (dense: the fragment's elements)."""
        return self._pair(j)[1]

    def index(self, j: int) -> torch.Tensor:
        """A sparse part's flat indices into the fragment."""
        idx = self._pair(j)[0]
        assert idx is not None
        return idx

    def add_into(
        self, j: int, total: torch.Tensor, weight: float | None = None, write: bool = False
    ) -> None:
        """``total += weight * part j`` (unweighted: the part itself, decoded straight into it
        where it is a dense payload; with ``write`` (see :meth:`writes_first`), written over
        ``total`` instead: the same bits as added to zeros, one pass less)."""
        if self.decoded is None and not self.sparse and weight is None:
            assert self.payloads is not None
            self.plan.decode(self.payloads[j], into=total, add=not write)
            return
        assert not write
        idx, x = self._pair(j)
        # unweighted, the plain sum: x * 1.0 would round the same, but costs a copy
        part = x * weight if weight is not None else x
        if idx is None:
            total += part
        else:
            total.index_add_(0, idx, part)

    def writes_first(self) -> bool:
        """Whether a sum may write its first part over its total rather than add it to zeros:
        unweighted dense payloads whose decode never gives -0.0 (0 + x is then x, bit for
        bit)."""
        return (
            self.decoded is None
            and not self.sparse
            and self.weights is None
            and len(self) > 0
            and not self.plan.negative_zeros
        )

    def rows(self) -> torch.Tensor:
        """Every part's values stacked: [m, V]."""
        return torch.stack([self.values(j) for j in range(len(self))])

    def total_weight(self) -> float:
        """The sum of the parts' weights (their count when unweighted)."""
        return sum(self.weights) if self.weights is not None else len(self)


class Combine(ABC):
    """A rule that turns one fragment's decoded contributions into one flat tensor."""

    name: ClassVar[str]  # the config's ``aggregation`` value
    sum_decomposable: ClassVar[bool] = False  # set by SumCombine: all-reduce/two-phase can run it
    # not defined on a sparse codec's contributions (refused for top-k: see check_codec)
    dense_only: ClassVar[bool] = False
    # unapplied() asked of an unweighted merge too (share-clip hands back what it held back)
    restores: ClassVar[bool] = False
    # trusts nothing a part says about itself: the exchange hands it every worker's decode,
    # with which are present, and it leaves out what is not finite or does not decode
    robust: ClassVar[bool] = False

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
    def combine(self, parts: Contributions, out: torch.Tensor) -> torch.Tensor:
        """Write the combination of ``parts`` (at least one) into ``out`` (flat FP32 over the
        fragment, contents unspecified) and return it. Weighted by ``parts.weights``."""

    def unapplied(
        self, parts: Contributions, j: int
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Of part ``j`` (weighted parts), what the weighted combination did not apply, in the
        unweighted rule's units: error feedback counted all of it as sent, as it may when the
        rule is unweighted (then every part is applied as the rule applies one part), and adds
        this back (docs/algorithms.md, "Token-weighted merge"). A flat FP32 tensor over the
        fragment, or (flat indices, values) where the rest is 0. Every rule that takes weights
        gives it."""
        raise NotImplementedError(f"aggregation={self.name} does not say what a weight left out")

    def left_out(self) -> torch.Tensor | None:
        """After :meth:`combine`: which (part, tensor) it left out, [m, T] bool on the device
        (the gather exchange counts a sender left out of most of its contribution as
        offending: engine/check.py); None when it leaves nothing out."""
        return None


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

    def unapplied(
        self, parts: Contributions, j: int
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``(1 - share) x_j``: the sum applied ``w_j / sum w`` of it where the unweighted rule
        applies ``1 / n`` (a negative share over-applied: it is taken back)."""
        assert parts.weights is not None
        kept = parts.values(j) * (1.0 - self.share(parts.weights, j))
        return (parts.index(j), kept) if parts.sparse else kept

    def combine(self, parts: Contributions, out: torch.Tensor) -> torch.Tensor:
        first = parts.writes_first()
        if not first:
            out.zero_()
        for j in range(len(parts)):  # sender after sender: the same bits on every receiver
            w = parts.weights[j] if parts.weights is not None else None
            parts.add_into(j, out, w, write=first and j == 0)
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
