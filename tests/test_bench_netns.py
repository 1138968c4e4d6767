"""lab.netns: the shaped namespace link of bench_peer_pull (needs root; a few seconds).

Made and removed for real: namespace, veth pair, addresses, a tbf qdisc at 1 Gbit/s that a raw TCP
transfer must feel, removal leaving nothing, leftovers of a dead run removed, a clear refusal
without root. Skipped when not root (namespaces and tc need it)."""
from __future__ import annotations

import os
import subprocess

import pytest

from lab import netns
from lab.netns import NetnsError, ShapedLink, remove_stale, tcp_throughput_bytes_per_s

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces and tc need root")


def _names() -> tuple[list[str], str]:
    ns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    return ns, links


def test_link_is_made_shaped_and_removed():
    link = ShapedLink("kvrpt" + str(os.getpid() % 100000))
    try:
        link.open()
        ns, links = _names()
        assert link.ns in ns and link.host_dev in links
        done = subprocess.run(link.exec_argv(["ip", "-o", "-4", "addr", "show", "dev", link.ns_dev]),
                              capture_output=True, text=True, check=True)
        assert link.ns_ip in done.stdout
        unshaped = tcp_throughput_bytes_per_s(link, 32 << 20)
        link.shape(1e9)
        assert "rate 1Gbit" in link.qdisc() and link.shaped_dev == link.ns_dev
        tx0 = link.ns_tx_bytes()
        shaped = tcp_throughput_bytes_per_s(link, 16 << 20)
        assert link.ns_tx_bytes() - tx0 >= 16 << 20           # the bytes left through the shaped end
        assert 0.8e9 / 8 < shaped < 1.05e9 / 8, shaped * 8
        assert unshaped > 1.5 * shaped
        link.shape(None)
        assert link.qdisc() == "" and link.rate_bits_per_s is None
    finally:
        assert link.close() == []
    ns, links = _names()
    assert link.ns not in ns and link.host_dev not in links and link.ns_dev not in links
    assert link.close() == []                                  # idempotent


def test_leftovers_of_a_dead_run_are_removed():
    dead_pid = int(open("/proc/sys/kernel/pid_max").read()) + 1   # never a live process
    link = ShapedLink(f"{netns.PREFIX}{dead_pid}")
    link.open()                                                # and never closed: as after SIGKILL
    try:
        removed = remove_stale()
        assert f"netns {link.ns}" in removed and f"link {link.host_dev}" in removed
        ns, links = _names()
        assert link.ns not in ns and link.host_dev not in links
    finally:
        link.close()


def test_refuses_clearly_without_root(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(NetnsError, match="need root"):
        ShapedLink().open()


def test_a_failing_command_names_itself_and_leaves_nothing():
    link = ShapedLink("kvrpdup" + str(os.getpid() % 1000))
    link.open()
    try:
        with pytest.raises(NetnsError, match="ip netns add"):
            ShapedLink(link.ns).open()                         # the name is taken
        assert link.exists()                                   # the failed one removed nothing of it
    finally:
        link.close()
    assert not link.exists()
