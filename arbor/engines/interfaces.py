"""Which network interface a process's gloo/NCCL traffic uses: the one carrying its node's address.

    bind_collectives("10.0.0.2")         # GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME = that address's interface
    route_source("10.0.0.1")             # the local address packets to 10.0.0.1 leave from

Without ``GLOO_SOCKET_IFNAME`` gloo takes the address its peers should dial from the host
name, which on many hosts (Debian-style ``/etc/hosts`` entries ``127.0.1.1 host``, containers)
resolves to a loopback address: the other nodes then dial their own loopback and the group
fails with ``Connection refused, remote=[127.0.0.1]``. NCCL's bootstrap picks an interface
by its own rules too. A process about to open a group therefore names the interface that
holds the address the others reach it by (the node's address Ray knows, or the one it uses
to reach the rendezvous); a variable the user set wins. Interface names may differ between
nodes, so each process chooses its own: a value copied from another node would be wrong.
"""

from __future__ import annotations

import fcntl
import os
import socket
import struct
import sys

# The variables torch's gloo and NCCL read to choose an interface.
SOCKET_IFNAME_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
_chosen: dict[str, str] = {}  # what bind_collectives set in this process (not the user's choice)
_SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's IPv4 address


def interface_addresses() -> dict[str, str]:
    """IPv4 address of each interface of this machine that has one (Linux; empty elsewhere)."""
    if not sys.platform.startswith("linux"):
        return {}
    found = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            request = struct.pack("256s", name.encode()[:15])
            try:
                reply = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, request)
            except OSError:  # no IPv4 address on it
                continue
            found[name] = socket.inet_ntoa(reply[20:24])
    return found


def interface_of(address: str) -> str | None:
    """The interface holding ``address`` (a host name is resolved first), or None."""
    try:
        address = socket.gethostbyname(address)
    except OSError:
        return None
    for name, held in interface_addresses().items():
        if held == address:
            return name
    return None


def route_source(peer: str) -> str:
    """The local address this machine sends from to reach ``peer`` (nothing is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.connect((socket.gethostbyname(peer), 9))  # a UDP connect only chooses the route
        return sock.getsockname()[0]


def bind_collectives(address: str, reason: str = "") -> str | None:
    """Make gloo and NCCL groups opened by this process use the interface holding ``address``
    (``GLOO_SOCKET_IFNAME``, ``NCCL_SOCKET_IFNAME`` in ``os.environ``, unless set already);
    returns the interface, or None (with a warning on stderr naming ``address`` and ``reason``)
    when no interface of this machine holds it."""
    if all(os.environ.get(v) for v in SOCKET_IFNAME_VARIABLES):
        return os.environ["GLOO_SOCKET_IFNAME"]
    interface = interface_of(address)
    if interface is None:
        print(f"arbor: no network interface of this machine holds {address}{f' ({reason})' if reason else ''}; "
              "gloo and NCCL choose one themselves (set GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME to the "
              "interface the other nodes reach this one by)", file=sys.stderr, flush=True)
        return None
    for variable in SOCKET_IFNAME_VARIABLES:
        if not os.environ.get(variable):
            os.environ[variable] = _chosen[variable] = interface
    return interface


def user_socket_ifnames() -> dict[str, str]:
    """The ``*_SOCKET_IFNAME`` variables of this process the user set (not :func:`bind_collectives`,
    whose choice holds for this machine only): what a driver hands its actors on other nodes."""
    return {v: os.environ[v] for v in SOCKET_IFNAME_VARIABLES
            if os.environ.get(v) and os.environ[v] != _chosen.get(v)}


def bind_collectives_towards(peer: str) -> str | None:
    """:func:`bind_collectives` to the address this machine reaches ``peer`` from (a process
    joining a rendezvous at ``peer`` that knows no node address of its own)."""
    try:
        source = route_source(peer)
    except OSError as e:
        print(f"arbor: no route to {peer} ({e}); gloo and NCCL choose an interface themselves",
              file=sys.stderr, flush=True)
        return None
    return bind_collectives(source, reason=f"the address that reaches {peer}")
