"""
A network namespace joined to this one by a veth pair, for cutting the
path between an agent (and its engines) and the server without removing
routes (issue 14: "network cuts ... network namespaces made by the
test").

The cut drops every packet silently at both ends' egress qdisc: netem
C{loss 100%} where the kernel has netem, else C{pfifo limit 0} (a queue
that holds nothing; checked here, on a kernel without sch_netem, to time
out connects both ways).  Setting a link down is not a cut: traffic to the
namespace's address then takes the default route and is answered from
elsewhere.
"""

from __future__ import annotations

import itertools
import os
import shutil
import signal
import subprocess
from dataclasses import dataclass

from twisted.trial.unittest import SkipTest

_made = itertools.count()


class NetnsUnavailable(Exception):
    """
    This machine or user cannot make a namespace or its veth pair.
    """


def _run(command: str, netns: str | None = None) -> None:
    """
    Run C{command} (words split on spaces), inside C{netns} if given.

    @raise NetnsUnavailable: it failed, with its error output.
    """
    argv = command.split()
    if netns is not None:
        argv = ["ip", "netns", "exec", netns, *argv]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=20)
    if done.returncode != 0:
        raise NetnsUnavailable(f"{' '.join(argv)}: {done.stderr.strip()}")


@dataclass
class Netns:
    """
    A namespace C{name} with C{ns_veth} at C{ns_address}, joined to
    C{host_veth} at C{host_address} in this one (a private /30).

    @ivar cut_qdisc: the qdisc (C{tc} words) that drops everything here.
    """

    name: str
    host_veth: str
    ns_veth: str
    host_address: str
    ns_address: str
    cut_qdisc: str = ""
    is_cut: bool = False

    def prefix(self) -> list[str]:
        """
        @return: the argv prefix that runs a command inside.
        """
        return ["ip", "netns", "exec", self.name]

    def cut(self) -> None:
        """
        Drop every packet both ways, silently: no reset, no ICMP, routes
        left as they are.
        """
        self.is_cut = True
        _run(f"tc qdisc add dev {self.host_veth} root {self.cut_qdisc}")
        _run(f"tc qdisc add dev {self.ns_veth} root {self.cut_qdisc}", self.name)

    def heal(self) -> None:
        """
        Remove the cut's qdiscs, if cut.
        """
        if not self.is_cut:
            return
        self.is_cut = False
        _run(f"tc qdisc del dev {self.host_veth} root")
        _run(f"tc qdisc del dev {self.ns_veth} root", self.name)

    def pids(self) -> list[int]:
        """
        @return: the processes running inside (C{ip netns pids}).
        """
        done = subprocess.run(
            ["ip", "netns", "pids", self.name],
            capture_output=True,
            text=True,
            timeout=20,
        )
        return sorted(int(p) for p in done.stdout.split())

    def remove(self) -> None:
        """
        Kill what runs inside, delete the namespace and the veth pair.
        """
        for pid in self.pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        for argv in (
            ["ip", "netns", "del", self.name],
            ["ip", "link", "del", self.host_veth],
        ):
            subprocess.run(argv, capture_output=True, timeout=20)


def _cut_qdisc(device: str) -> str:
    for qdisc in ("netem loss 100%", "pfifo limit 0"):
        try:
            _run(f"tc qdisc add dev {device} root {qdisc}")
        except NetnsUnavailable:
            continue
        _run(f"tc qdisc del dev {device} root")
        return qdisc
    raise NetnsUnavailable("tc: neither the netem nor the pfifo qdisc is available")


def make_netns() -> Netns:
    """
    Make a namespace, a veth pair and a /30 in 10.231.0.0/16, named from
    this process's id and a counter.

    @raise NetnsUnavailable: C{ip} or C{tc} (iproute2) is missing, or this
        user lacks CAP_NET_ADMIN; what was made is removed first.
    """
    if shutil.which("ip") is None or shutil.which("tc") is None:
        raise NetnsUnavailable("no ip or tc command: install iproute2")
    n = next(_made)
    tag = f"{os.getpid() % 100000}x{n}"
    taken = subprocess.run(
        ["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True, timeout=20
    ).stdout
    subnet = (os.getpid() * 16 + n) % 16384
    # Another test process's /30 (its pid alike modulo 1024) is skipped.
    while f" 10.231.{subnet // 64}.{subnet % 64 * 4 + 1}/" in taken:
        subnet = (subnet + 1) % 16384
    prefix, last = f"10.231.{subnet // 64}", subnet % 64 * 4
    net = Netns(
        name=f"llmgw-netcut-{tag}",
        host_veth=f"lgh{tag}",
        ns_veth=f"lgn{tag}",
        host_address=f"{prefix}.{last + 1}",
        ns_address=f"{prefix}.{last + 2}",
    )
    try:
        _run(f"ip netns add {net.name}")
        _run(f"ip link add {net.host_veth} type veth peer name {net.ns_veth}")
        _run(f"ip link set {net.ns_veth} netns {net.name}")
        _run(f"ip addr add {net.host_address}/30 dev {net.host_veth}")
        _run(f"ip link set {net.host_veth} up")
        _run(f"ip addr add {net.ns_address}/30 dev {net.ns_veth}", net.name)
        _run(f"ip link set {net.ns_veth} up", net.name)
        _run("ip link set lo up", net.name)
        net.cut_qdisc = _cut_qdisc(net.host_veth)
    except (NetnsUnavailable, OSError, subprocess.TimeoutExpired) as e:
        net.remove()
        raise NetnsUnavailable(str(e)) from None
    return net


def netns_or_skip() -> Netns:
    """
    L{make_netns}, or skip the test with the reason; under C{CI=true}
    (root there) a failure instead: CI must not skip the network cuts.
    """
    try:
        return make_netns()
    except NetnsUnavailable as e:
        reason = f"cannot make a network namespace (iproute2, CAP_NET_ADMIN): {e}"
        if os.environ.get("CI") == "true":
            raise AssertionError(reason) from None
        raise SkipTest(reason) from None
