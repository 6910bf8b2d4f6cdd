"""TCP ports on this machine: a free one to listen on, and a user's ``--port`` checked."""

from __future__ import annotations

import socket

from ..config import ConfigError


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now ("": every interface)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def check_port(port: int) -> None:
    """ConfigError when ``port`` is out of range or cannot be bound on this machine."""
    if not 1 <= port <= 65535:
        raise ConfigError(
            f"--port {port} is not a TCP port: give 1-65535, or omit it to pick a free one"
        )
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            raise ConfigError(
                f"port {port} is in use: pass another --port or omit it to pick a free one"
            ) from None
