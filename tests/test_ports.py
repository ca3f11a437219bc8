import socket

from arbor.engines import ports
from arbor.engines.ports import ephemeral_range, free_port


def test_ports_are_free_distinct_and_below_the_ephemeral_range():
    low, _ = ephemeral_range()
    picked = [free_port() for _ in range(20)]
    assert len(set(picked)) == 20
    assert all(ports.LOWEST <= p < low for p in picked), (picked, low)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", picked[0]))  # free when handed out


def test_a_port_in_use_is_never_handed_out(monkeypatch):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        monkeypatch.setattr(ports, "LOWEST", taken)
        monkeypatch.setattr(ports, "ephemeral_range", lambda: (taken + 1000, 60999))
        assert all(free_port(tries=1000) != taken for _ in range(5))  # every candidate tried


def test_without_room_below_the_range_the_os_picks(tmp_path, monkeypatch):
    table = tmp_path / "ip_local_port_range"
    table.write_text("1024\t65535\n")
    monkeypatch.setattr(ports, "PORT_RANGE_FILE", table)
    assert ephemeral_range() == (1024, 65535)
    port = free_port()
    assert 1024 <= port <= 65535
    table.write_text("garbage\n")
    assert ephemeral_range() == (32768, 60999)  # Linux's default
