"""The two ways a shaped network can fail: unavailable here, or not carrying its rate."""

from __future__ import annotations


class NetworkUnavailable(RuntimeError):
    """Namespaces or traffic control cannot be used here (not root, no iproute2, no netns...)."""


class LinkCheckFailed(RuntimeError):
    """The shaped link does not carry the requested rate (within the tolerance)."""

    def __init__(
        self,
        requested_mbit: float,
        measured_mbit: float,
        tolerance: float,
        where: str,
        detail: str = "",
    ):
        self.requested_mbit = requested_mbit
        self.measured_mbit = measured_mbit
        self.tolerance = tolerance
        hint = detail or (
            "At high rates the CPU may not keep up with the transfer (a few Gbit/s here); "
            "choose a lower rate, or pass check=False to use the link anyway"
        )
        super().__init__(
            f"link check failed on {where}: measured {measured_mbit:.1f} Mbit/s, requested "
            f"{requested_mbit:.1f} Mbit/s (tolerance {tolerance:.0%}). {hint}"
        )
