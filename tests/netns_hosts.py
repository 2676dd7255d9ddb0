"""Hosts for tests that must cross a network: each a network namespace with its own address on a
bridge (what `slurm/local/start_multinode.sh` builds for the Slurm tests, without Slurm). A
process started with `Hosts.command(k, ...)` runs on host k: it binds and is reached at that
host's address only. The hosts share the machine's filesystem, as cluster nodes share one."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

PREFIX = "slimrl-mx"
SUBNET = "10.78.0"
BRIDGE = f"{PREFIX}br"


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


@dataclass(frozen=True)
class Hosts:
    count: int

    def name(self, k: int) -> str:
        return f"{PREFIX}{k}"

    def address(self, k: int) -> str:
        return f"{SUBNET}.{k}"

    def command(self, k: int, *argv: str) -> list[str]:
        return ["ip", "netns", "exec", self.name(k), *argv]

    @property
    def env(self) -> dict[str, str]:
        """gloo binds the host's own link, not whatever the machine's hostname resolves to."""
        return {"GLOO_SOCKET_IFNAME": "eth0", "NO_PROXY": "*", "no_proxy": "*"}


def _teardown(count: int) -> None:
    for k in range(1, count + 1):
        name = f"{PREFIX}{k}"
        if os.path.exists(f"/run/netns/{name}"):
            pids = subprocess.run(
                ["ip", "netns", "pids", name], capture_output=True, text=True
            ).stdout.split()
            for pid in pids:
                subprocess.run(["kill", "-9", pid], capture_output=True)
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
        subprocess.run(["ip", "link", "del", f"{PREFIX}v{k}"], capture_output=True)
    subprocess.run(["ip", "link", "del", BRIDGE], capture_output=True)


@contextmanager
def network_hosts(count: int = 2) -> Iterator[Hosts]:
    """`count` hosts on one bridge; everything made is gone afterwards. Needs root."""
    if os.geteuid() != 0:
        raise PermissionError("network-namespace hosts need root (CI and the dev machines run tests as root)")
    _teardown(count)  # what a killed earlier run left
    try:
        _ip("link", "add", BRIDGE, "type", "bridge")
        _ip("addr", "add", f"{SUBNET}.254/24", "dev", BRIDGE)  # the machine reaches every host
        _ip("link", "set", BRIDGE, "up")
        for k in range(1, count + 1):
            name = f"{PREFIX}{k}"
            _ip("netns", "add", name)
            _ip("-n", name, "link", "set", "lo", "up")
            _ip("link", "add", f"{PREFIX}v{k}", "type", "veth", "peer", "name", "eth0", "netns", name)
            _ip("link", "set", f"{PREFIX}v{k}", "master", BRIDGE, "up")
            _ip("-n", name, "addr", "add", f"{SUBNET}.{k}/24", "dev", "eth0")
            _ip("-n", name, "link", "set", "eth0", "up")
        yield Hosts(count)
    finally:
        _teardown(count)
