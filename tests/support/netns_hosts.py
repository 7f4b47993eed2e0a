"""Several hosts on one machine for tests: network namespaces on one bridge.

Each host is a network namespace with its own address on a Linux bridge; the
root namespace is a host on that bridge too (``.1``), so the test process
reaches every host and every host reaches the others. Faults come from what
this kernel has (no ``tc netem`` here): a host's link taken down, a blackhole
route on one host towards another, and - outside this module - pausing a
process (SIGSTOP/SIGCONT).

Names carry the owner's pid (``vpd<pid>...``), so leftovers of a killed
earlier run are found and removed (``remove_leftovers``) without touching a
live run's. Needs root (CAP_NET_ADMIN); ``netns_unavailable()`` says why not.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import re
import subprocess
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

PREFIX = "vpd"
_NAME = re.compile(rf"^{PREFIX}(\d+)")


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True, timeout=30)


def netns_unavailable() -> str | None:
    """None if namespaces, veth pairs and bridges can be made here; else the kernel's refusal."""
    probe = f"{PREFIX}{os.getpid()}probe"
    try:
        r = _ip("netns", "add", probe, check=False)
        if r.returncode != 0:
            return f"ip netns add refused: {r.stderr.strip()}"
        r = _ip("link", "add", probe[:15], "type", "bridge", check=False)
        if r.returncode != 0:
            return f"ip link add type bridge refused: {r.stderr.strip()}"
        _ip("link", "del", probe[:15], check=False)
        return None
    except (OSError, subprocess.SubprocessError) as e:
        return f"ip (iproute2) not usable: {e}"
    finally:
        _ip("netns", "del", probe, check=False)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_leftovers() -> list[str]:
    """Delete namespaces and links named by this module whose owning process is gone."""
    removed = []
    for ns in _ip("netns", "list").stdout.split():
        m = _NAME.match(ns)
        if m and not _pid_alive(int(m.group(1))):
            _ip("netns", "del", ns, check=False)
            removed.append(ns)
    for line in _ip("-o", "link", "show").stdout.splitlines():
        name = line.split(":")[1].strip().split("@")[0]
        m = _NAME.match(name)
        if m and not _pid_alive(int(m.group(1))):
            _ip("link", "del", name, check=False)
            removed.append(name)
    if removed:
        logger.info("removed leftovers of an earlier run: %s", " ".join(removed))
    return removed


def _free_subnet() -> ipaddress.IPv4Network:
    """A /24 in 10.213.0.0/16 that no address in the root namespace is in."""
    taken = [ipaddress.ip_interface(w).network for w in re.findall(r"inet (\S+)", _ip("-o", "addr").stdout)]
    for net in ipaddress.ip_network("10.213.0.0/16").subnets(new_prefix=24):
        if not any(net.overlaps(t) for t in taken):
            return net
    raise RuntimeError("no free /24 in 10.213.0.0/16 for test hosts")


@dataclass
class Host:
    name: str  # the test's name for it ("prefill", "A")
    netns: str
    address: str
    link: str  # its veth end on the bridge, in the root namespace

    def command(self, argv: list[str]) -> list[str]:
        """``argv`` run inside this host."""
        return ["ip", "netns", "exec", self.netns, *argv]


@dataclass
class NetnsHosts:
    """Hosts on one bridge; use as a context manager - the ``with`` block's end always tears down."""

    names: list[str]
    hosts: dict[str, Host] = field(default_factory=dict)
    root_address: str = ""
    _tag: str = ""
    _bridge: str = ""
    _blackholes: set[tuple[str, str]] = field(default_factory=set)

    def __enter__(self) -> NetnsHosts:
        remove_leftovers()
        try:
            self._create()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _create(self) -> None:
        if len(set(self.names)) != len(self.names) or len(self.names) > 200:
            raise ValueError(f"host names must be distinct and at most 200: {self.names}")
        self._tag = f"{PREFIX}{os.getpid()}"
        self._bridge = f"{self._tag}b"
        net = _free_subnet()
        addrs = list(net.hosts())
        self.root_address = str(addrs[0])
        _ip("link", "add", self._bridge, "type", "bridge")
        _ip("addr", "add", f"{self.root_address}/{net.prefixlen}", "dev", self._bridge)
        _ip("link", "set", self._bridge, "up")
        for i, name in enumerate(self.names):
            host = Host(name, f"{self._tag}-{i}", str(addrs[i + 1]), f"{self._tag}v{i}")
            self.hosts[name] = host
            _ip("netns", "add", host.netns)
            _ip("link", "add", host.link, "type", "veth", "peer", "name", f"{self._tag}p{i}")
            _ip("link", "set", f"{self._tag}p{i}", "netns", host.netns, "name", "eth0")
            _ip("link", "set", host.link, "master", self._bridge, "up")
            _ip("-n", host.netns, "addr", "add", f"{host.address}/{net.prefixlen}", "dev", "eth0")
            _ip("-n", host.netns, "link", "set", "eth0", "up")
            _ip("-n", host.netns, "link", "set", "lo", "up")

    def __getitem__(self, name: str) -> Host:
        return self.hosts[name]

    # ---- faults ---------------------------------------------------------------------------------
    def cut(self, name: str) -> None:
        """Take the host's link down: every packet to or from it is lost, no peer is told."""
        _ip("link", "set", self[name].link, "down")

    def restore(self, name: str) -> None:
        _ip("link", "set", self[name].link, "master", self._bridge, "up")

    def blackhole(self, on: str, towards: str) -> None:
        """Host ``on`` silently drops what it sends to host ``towards`` (a one-way partition)."""
        _ip("-n", self[on].netns, "route", "add", "blackhole", f"{self[towards].address}/32")
        self._blackholes.add((on, towards))

    def unblackhole(self, on: str, towards: str) -> None:
        _ip("-n", self[on].netns, "route", "del", "blackhole", f"{self[towards].address}/32")
        self._blackholes.discard((on, towards))

    # ---- teardown -------------------------------------------------------------------------------
    def close(self) -> None:
        # deleting a namespace deletes its veth end, and with it the pair
        for host in self.hosts.values():
            _ip("netns", "del", host.netns, check=False)
            _ip("link", "del", host.link, check=False)
        if self._bridge:
            _ip("link", "del", self._bridge, check=False)
        self.hosts.clear()
