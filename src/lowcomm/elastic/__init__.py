"""Sites that come and go: membership on torchft's lighthouse, our own data plane.

``Elastic`` configures it (``LowComm(..., elastic=Elastic(...))``); ``Membership`` asks the
lighthouse who is in at each outer sync and builds that quorum's gloo group; ``Runner`` runs a
sync's collectives on it, settles them with a commit quorum and retries among the survivors.
"""

from .decide import View
from .membership import Elastic, Membership
from .runner import Runner

__all__ = ["Elastic", "Membership", "Runner", "View"]
