"""``kvroute.up.free_ports``: ports for processes not started yet come from below the kernel's
ephemeral range, so no port-0 bind (vLLM's engine sockets, ZMQ's wildcard binds, outgoing
connections) can take one before its process binds it; ports in use are never returned."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from kvroute import up


@pytest.mark.parametrize(("text", "want"), [
    ("32768\t60999\n", range(10000, 32768)),
    ("40000 60999", range(10000, 40000)),
    ("10500 60999", None),   # under 1,000 ports below it
    ("1024 65535", None),
    ("garbled", None),
])
def test_the_chosen_range_ends_where_the_ephemeral_range_starts(tmp_path: Path, text: str, want) -> None:
    path = tmp_path / "ip_local_port_range"
    path.write_text(text)
    assert up.below_ephemeral_range(path) == want


def test_a_missing_range_file_means_port_zero(tmp_path: Path) -> None:
    assert up.below_ephemeral_range(tmp_path / "absent") is None


def test_ports_come_from_below_the_ephemeral_range_and_are_distinct() -> None:
    chosen_from = up._chosen_port_range()
    if chosen_from is None:
        pytest.skip("this host's ephemeral range leaves no room below it")
    ports = up.free_ports(40, avoid={chosen_from.start, chosen_from.start + 1})
    assert len(set(ports)) == 40
    assert all(p in chosen_from for p in ports), sorted(ports)
    assert not {chosen_from.start, chosen_from.start + 1} & set(ports)


def test_ports_in_use_or_avoided_are_skipped_then_port_zero_fills_in(monkeypatch) -> None:
    monkeypatch.delenv(up.PORT_RANGE_ENV, raising=False)  # set per worker under xdist (conftest)
    held: list[socket.socket] = []
    try:
        # a 6-port range: 4 held by listeners here, 1 avoided, so 1 is left to choose
        start = up.free_port_runs(1, 6, set())[0]
        window = range(start, start + 6)
        for port in window[:4]:
            s = socket.socket()
            s.bind(("127.0.0.1", port))
            s.listen()
            held.append(s)
        monkeypatch.setattr(up, "_chosen_port_range", lambda: window)
        first = up.free_ports(1, avoid={window[4]})
        assert first == [window[5]]
        two = up.free_ports(2, avoid={window[4]})
        assert window[5] in two and len(set(two)) == 2
        (other,) = set(two) - {window[5]}
        assert other not in window  # drawn by the kernel (port 0) once the range ran out
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", other))
    finally:
        for s in held:
            s.close()


def test_a_port_range_from_the_environment_bounds_every_choice(monkeypatch) -> None:
    held: list[socket.socket] = []
    try:
        start = up.free_port_runs(1, 6, set())[0]
        window = range(start, start + 6)
        monkeypatch.setenv(up.PORT_RANGE_ENV, f"{window[0]}-{window[-1]}")
        assert up._chosen_port_range() == window
        assert sorted(up.free_ports(6)) == list(window)
        for port in window[:5]:
            s = socket.socket()
            s.bind(("127.0.0.1", port))
            s.listen()
            held.append(s)
        assert up.free_ports(1) == [window[5]]
        with pytest.raises(RuntimeError, match=f"no 2 free TCP ports on 127.0.0.1 in {up.PORT_RANGE_ENV}="):
            up.free_ports(2)  # never port 0 outside the range
        with pytest.raises(RuntimeError, match="runs of 2 free consecutive ports"):
            up.free_port_runs(1, 2, set(), tries=20)  # the only free port ends the range
    finally:
        for s in held:
            s.close()


@pytest.mark.parametrize("value", ["20000", "20000-", "a-b", "30000-20000", "0-10", "60000-70000", "1-2-3"])
def test_a_malformed_port_range_is_refused_naming_the_variable(value: str) -> None:
    with pytest.raises(ValueError, match=f"{up.PORT_RANGE_ENV}="):
        up.port_range_from_env(value)


def test_kvroute_up_refuses_a_malformed_port_range_at_start(tmp_path: Path) -> None:
    env = {**os.environ, up.PORT_RANGE_ENV: "20000:21000"}
    r = subprocess.run([sys.executable, "-m", "kvroute", "up", "--workers", "1", "--model", "tests/fixtures/tiny-model",
                        "--port", "1", "--log-dir", str(tmp_path)], env=env, capture_output=True, text=True,
                       timeout=120, cwd=Path(__file__).resolve().parents[1])
    assert r.returncode == 2, r.stderr
    assert f"{up.PORT_RANGE_ENV}='20000:21000': expected LOW-HIGH" in r.stderr
    assert not list(tmp_path.iterdir())  # nothing was started
