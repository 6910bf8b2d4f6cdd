"""Turn every worker's contribution into one averaged tensor: encode, exchange, decode, FP32 sum.

One class per exchange, chosen once by ``SyncConfig.reduce`` (:func:`make_aggregator`) or by
name (:func:`aggregator_for`), all behind the abstract :class:`Aggregator`:

- ``allreduce`` (:class:`AllReduceAggregator`): dense codecs (fp32/bf16/fp16) cast the flat
  buffer and all-reduce it.
- ``gather`` (:class:`GatherAggregator`): every worker encodes each tensor, the packed payloads
  are all-gathered, and each receiver decodes all M payloads and sums them in FP32 (never in the
  low-bit format). Exact for any codec and fine for small M; wire bytes grow as (M-1) x payload.
- ``two-phase`` (:class:`TwoPhaseAggregator`): M shards, all-to-all to their owners, FP32 sum,
  re-encode (compensated with ``reduce_compensation``) and all-gather. Wire bytes stay about
  2 x payload whatever M is. Element-wise codecs only.

Every payload carries one extra element or byte: 1 if this worker's contribution is valid, 0
if it was left out (a non-finite pseudo-gradient). The average divides by the number of valid
workers, which every worker learns from the same exchange, with no extra collective.

The math lives here; the bytes move through :class:`~lowcomm.transport.Transport`.
``encode`` runs on the compute thread (it is also what error compensation needs to see), and
``exchange`` is the blocking part that may run on the transport's comm thread.
"""

from .allreduce import AllReduceAggregator
from .base import Aggregator, Encoded, Reduced, encode_compensated
from .factory import METHODS, aggregator_for, make_aggregator
from .gather import GatherAggregator
from .two_phase import TwoPhaseAggregator

__all__ = [
    "METHODS",
    "AllReduceAggregator",
    "Aggregator",
    "Encoded",
    "GatherAggregator",
    "Reduced",
    "TwoPhaseAggregator",
    "aggregator_for",
    "encode_compensated",
    "make_aggregator",
]
