"""Free TCP ports: for engine servers, the weight-update group and the learners' rendezvous.

    port = free_port()            # on 127.0.0.1
    port = free_port("")          # on every interface of this node

The OS picks the port; it is free when this returns (another process may take it before
the caller binds it: callers bind at once).
"""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (the OS picks it)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]
