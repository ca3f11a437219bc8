"""Free TCP ports: for engine servers, the weight-update group and the learners' rendezvous.

    port = free_port()            # on 127.0.0.1
    port = free_port("")          # on every interface of this node

A port is free when this returns, but its caller binds it seconds later (a server starting, a
learner rank importing DeepSpeed). Ports the OS hands out for ``bind(0)`` come from the
ephemeral range, the same range every outgoing connection on the machine draws its local port
from, so in that window Ray's or gloo's connections could take it (seen in CI: a learner
rendezvous failing with EADDRINUSE). So the port is drawn at random *below* the ephemeral range
(``/proc/sys/net/ipv4/ip_local_port_range``), where only another listening server could take
it, and the OS's pick is the fallback when nothing there is free.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

PORT_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LOWEST = 20000  # below: registered services' usual ports
_handed_out: set[int] = set()  # this process's picks: never the same port twice
_rng = random.SystemRandom()  # not the seeded global generator: two seeded processes would pick alike


def ephemeral_range() -> tuple[int, int]:
    """The OS's range for outgoing connections' local ports (Linux's default if unreadable)."""
    try:
        low, high = (int(x) for x in PORT_RANGE_FILE.read_text().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
        return True


def free_port(host: str = "127.0.0.1", tries: int = 50) -> int:
    """A TCP port free on ``host`` now, outside the ephemeral range where one is free."""
    low, _ = ephemeral_range()
    candidates = range(LOWEST, low) if low - LOWEST >= 1000 else range(0)
    for port in _rng.sample(candidates, min(tries, len(candidates))):
        if port not in _handed_out and _bindable(host, port):
            _handed_out.add(port)
            return port
    with socket.socket() as sock:
        sock.bind((host, 0))
        port = sock.getsockname()[1]
    _handed_out.add(port)
    return port
