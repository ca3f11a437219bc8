"""arbor.engines.interfaces: the interface gloo and NCCL bind, chosen from an address."""

from __future__ import annotations

import os

import pytest

from arbor.engines.interfaces import (
    SOCKET_IFNAME_VARIABLES,
    bind_collectives,
    bind_collectives_towards,
    interface_addresses,
    interface_of,
    route_source,
    user_socket_ifnames,
)

linux = pytest.mark.skipif(not os.path.exists("/proc/net"), reason="reads interfaces with Linux ioctls")


@pytest.fixture
def unset():
    """No *_SOCKET_IFNAME variable during the test; the previous ones back after it."""
    saved = {v: os.environ.pop(v) for v in SOCKET_IFNAME_VARIABLES if v in os.environ}
    yield
    for variable in SOCKET_IFNAME_VARIABLES:
        os.environ.pop(variable, None)
    os.environ.update(saved)


@linux
def test_loopback_is_found_by_its_address_and_a_route_to_it_leaves_from_it():
    assert interface_addresses()["lo"] == "127.0.0.1"
    assert interface_of("127.0.0.1") == "lo" and interface_of("localhost") == "lo"
    assert route_source("127.0.0.1") == "127.0.0.1"
    assert interface_of("192.0.2.254") is None or "192.0.2.254" in interface_addresses().values()


@linux
def test_both_variables_name_the_interface_of_the_address(unset):
    assert bind_collectives("127.0.0.1") == "lo"
    assert [os.environ[v] for v in SOCKET_IFNAME_VARIABLES] == ["lo", "lo"]


@linux
def test_the_users_setting_wins_and_only_it_goes_to_other_nodes(unset, monkeypatch):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth7")
    bind_collectives_towards("127.0.0.1")
    assert os.environ["GLOO_SOCKET_IFNAME"] == "eth7" and os.environ["NCCL_SOCKET_IFNAME"] == "lo"
    # The driver hands actors the user's choice, never the interface it chose for itself.
    assert user_socket_ifnames() == {"GLOO_SOCKET_IFNAME": "eth7"}


def test_an_address_no_interface_holds_warns_and_sets_nothing(unset, capsys):
    assert bind_collectives("203.0.113.9", reason="a test") is None
    assert not any(os.environ.get(v) for v in SOCKET_IFNAME_VARIABLES)
    assert "no network interface of this machine holds 203.0.113.9 (a test)" in capsys.readouterr().err
