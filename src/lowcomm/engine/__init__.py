"""The one outer loop. DiLoCo, Streaming DiLoCo, SparseLoCo and CO2 are configurations of it.

After every inner ``optimizer.step()`` the engine asks the schedule what is due at this global
step and, in this order:

1. waits for the in-flight results that are due now (so at most one exchange per fragment is
   in flight: CO2 waits for round r-1's all-reduce before it starts round r's);
2. for each fragment due to be sent: its pseudo-gradient (``theta_global - theta_local``, or
   with the continue merge the progress since its last send), optional error compensation,
   encode, and start the exchange (blocking when overlap tau = 0, else on the transport's comm
   thread while training continues). Every exchange starts with a small control all-gather of
   each worker's flags (has it left its loop, its step, was its update finite, unsent steps);
3. applies each result: outer step on the fragment's global copy, then merge into the local
   weights: replace (tau = 0, or CO2's ``reset``), the alpha-mix, or *continue*: the new
   global copy minus this worker's own progress that the global copy does not hold yet (of
   its round still in flight, CO2 keeps only the share ``co2_keep``).

Leaving the ``with`` block (``finish``) follows the own-loop contract of docs/api.md: a worker
that is done takes part in its peers' remaining syncs (contributing its unsent progress once),
then every worker drains what is in flight, runs one more blocking outer step per fragment
with unsent inner steps, averages buffers, and loads that consolidated model; the run's own
state (local weights, global copies, outer and error state, results in flight) is kept, so
entering the block again continues the same run as if it had never been left.

The parts, one job each (docs/design.md draws the path of one sync through them):
``core`` (``LowComm``: the hook and ``run_due`` as named calls), ``build`` (argument checks,
fragments from rank 0), ``fragment`` (a fragment's global copy, snapshot, pseudo-gradient),
``placement`` (groups, parts inside a worker, broadcasts), ``sync`` (one sync top to bottom:
encode, the collectives, the pending table, the outer step and the merge rules), ``guards``
(non-finite updates, replica check), ``leave`` (the exit path),
``state`` (the run state declared once), ``stats`` (counters and stage timing), ``tensors``;
with membership, ``join`` (a site joining, or back from a sync it missed) and ``quorum``
(quorum rounds: a round cut short, a site's arrival at a sync).
"""

from ..errors import NonFiniteError, ReplicaMismatchError
from .core import LowComm
from .stats import SyncStats, SyncTimes

__all__ = ["LowComm", "NonFiniteError", "ReplicaMismatchError", "SyncStats", "SyncTimes"]
