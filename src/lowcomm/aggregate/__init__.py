"""Turn every worker's contribution into one tensor: encode, exchange, decode, combine in FP32.

Two choices, both made once by :func:`make_aggregator` (from a SyncConfig) or
:func:`aggregator_for` (by name): the exchange, which moves the bytes, and the combine rule
(``SyncConfig.aggregation``), which turns the decoded contributions into one tensor. Rules are
:class:`Combine` subclasses, one file each in ``aggregate/rules/`` (``mean``, ``selected-mean``,
and the robust ``norm-clip``, ``median``, ``trimmed-mean``, ``centered-clip``),
registered in :data:`COMBINES` by their ``name``; see :mod:`~lowcomm.aggregate.combine`.

One class per exchange, chosen by ``SyncConfig.reduce``, all behind the abstract
:class:`Aggregator`:

- ``allreduce`` (:class:`AllReduceAggregator`): dense codecs (fp32/bf16/fp16) cast the flat
  buffer and all-reduce it.
- ``gather`` (:class:`GatherAggregator`): every worker encodes its fragment, the packed
  payloads are all-gathered, and each receiver decodes all M payloads and combines them in FP32
  (never in the low-bit format). Exact for any codec and fine for small M; wire bytes grow as
  (M-1) x payload.
- ``two-phase`` (:class:`TwoPhaseAggregator`): M shards, all-to-all to their owners, FP32 sum,
  re-encode (compensated with ``reduce_compensation``) and all-gather. Wire bytes stay about
  2 x payload whatever M is. Element-wise codecs only.

All-reduce and two-phase only sum, so they run only rules that are sums (:class:`SumCombine`);
gather runs any rule.

An aggregator works a fragment at a time, through the codec's plan of all its tensors (see
:mod:`~lowcomm.codecs.base`): the launches of a sync do not depend on its number of tensors or
buckets, only the collectives (one per bucket) do. Every payload carries a validity flag (one
element after an all-reduce's values; a byte after each gathered bucket, each two-phase row): 1
if this worker's contribution is valid, 0 if it was left out (a non-finite pseudo-gradient).
The average divides by the number of valid workers, which every worker learns from the same
exchange, with no extra collective; a left-out worker's contribution never reaches the rule.

The math lives here; the bytes move through :class:`~lowcomm.transport.Transport`.
``encode`` runs on the compute thread (it is also what error compensation needs to see), and
``exchange`` is the blocking part that may run on the transport's comm thread.
"""

from . import rules  # noqa: F401  (registers the shipped combine rules)
from .allreduce import AllReduceAggregator
from .base import Aggregator, Encoded, Reduced, encode_compensated, encode_tensors
from .combine import COMBINES, Combine, Contributions, SumCombine, combine_for
from .factory import METHODS, aggregator_for, make_aggregator
from .gather import GatherAggregator
from .two_phase import TwoPhaseAggregator

__all__ = [
    "COMBINES",
    "METHODS",
    "AllReduceAggregator",
    "Aggregator",
    "Combine",
    "Contributions",
    "Encoded",
    "GatherAggregator",
    "Reduced",
    "SumCombine",
    "TwoPhaseAggregator",
    "aggregator_for",
    "combine_for",
    "encode_compensated",
    "encode_tensors",
    "make_aggregator",
]
