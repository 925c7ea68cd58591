"""Hosts as network namespaces: several "machines" on one bridge, for the tests and benchmarks of what crosses a network.

Each host is a network namespace with one veth into a bridge namespace and an address on a private /24
that exists only inside the namespaces made here. ``cut(host)`` sets the host's bridge port down (a
partition: the kernel here has no netem), ``restore(host)`` sets it up again. ``command(host)`` prefixes
a command line so that it runs on that host. Everything is torn down on ``close()``, processes still
inside the namespaces included, also when a test fails half-way through setting up.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import threading
from collections.abc import Sequence

_counter = iter(range(1 << 30))
_counter_lock = threading.Lock()


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20, check=check)


def unavailable_reason() -> str | None:
    """Why hosts cannot be made here (not root, no ``ip``, namespaces or bridges refused), or None."""
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2) on this machine"
    if os.geteuid() != 0:
        return "network namespaces need root"
    try:
        with Hosts(["probe"]):
            pass
    except (OSError, subprocess.SubprocessError) as exc:
        return f"network namespaces are not available here: {exc}"
    return None


class Hosts:
    """``Hosts(["broker", "worker", "rank"])``: one namespace each on a shared bridge, 10.79.0.1, .2, ... in order."""

    def __init__(self, names: Sequence[str], subnet: str = "10.79.0") -> None:
        with _counter_lock:
            tag = f"df{os.getpid() % 100000}x{next(_counter)}"
        self.names = list(names)
        self.bridge_ns = f"{tag}-br"
        self._ns = {name: f"{tag}-{index}" for index, name in enumerate(self.names)}
        self._port = {name: f"p{index}" for index, name in enumerate(self.names)}
        self._address = {name: f"{subnet}.{index + 1}" for index, name in enumerate(self.names)}
        self._made: list[str] = []
        try:
            self._make()
        except BaseException:
            self.close()
            raise

    def _make(self) -> None:
        self._add_namespace(self.bridge_ns)
        _ip("-n", self.bridge_ns, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.bridge_ns, "link", "set", "br0", "up")
        for name in self.names:
            ns, port = self._ns[name], self._port[name]
            self._add_namespace(ns)
            _ip("link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name", port, "netns", self.bridge_ns)
            _ip("-n", self.bridge_ns, "link", "set", port, "master", "br0")
            _ip("-n", self.bridge_ns, "link", "set", port, "up")
            _ip("-n", ns, "addr", "add", f"{self._address[name]}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")

    def _add_namespace(self, ns: str) -> None:
        _ip("netns", "add", ns)
        self._made.append(ns)

    def address(self, host: str) -> str:
        return self._address[host]

    def namespace(self, host: str) -> str:
        return self._ns[host]

    def command(self, host: str) -> list[str]:
        """The prefix that runs a command line on ``host``."""
        return ["ip", "netns", "exec", self._ns[host]]

    def cut(self, host: str) -> None:
        """Partition ``host`` from every other: its bridge port goes down (nothing is sent or received)."""
        _ip("-n", self.bridge_ns, "link", "set", self._port[host], "down")

    def restore(self, host: str) -> None:
        _ip("-n", self.bridge_ns, "link", "set", self._port[host], "up")

    def close(self) -> None:
        """Kill whatever still runs inside the namespaces, then delete them (their veths go with them)."""
        for ns in reversed(self._made):
            pids = _ip("netns", "pids", ns, check=False).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            _ip("netns", "del", ns, check=False)
        self._made.clear()

    def __enter__(self) -> Hosts:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
