"""The one network helper that both sides need: a port that is free on this node now."""

from __future__ import annotations

import socket


def free_port(host: str = "") -> int:
    """A TCP port free on `host` (every interface by default) at this moment, as torchrun picks its
    store's: the OS hands out an unused one, so two jobs on one node never collide on a fixed port."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
