"""Addresses and ports for the processes a run starts: the one place that asks the OS for them."""

from __future__ import annotations

import datetime
import random
import socket
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch.distributed as dist


PORTS_FROM = 20000
"""Where `free_port` looks first: above Ray's default worker ports (10002-19999)."""


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on `host` now, below the kernel's ephemeral range when there is room: the
    caller binds it later (an SGLang server only after loading, ~20 s), and in the ephemeral range
    any outgoing connection can take it meanwhile (a clean clone lost an SGLang start so)."""
    low = _ephemeral_low()
    for port in random.sample(range(PORTS_FROM, low), min(64, max(low - PORTS_FROM, 0))):
        with socket.socket() as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def listening_socket(host: str = "127.0.0.1") -> socket.socket:
    """A TCP socket listening on `host` at a port the OS picks (no race: it is bound already)."""
    return socket.create_server((host, 0))


def node_address() -> str:
    """This node's address as Ray sees it, the one other nodes reach it by."""
    import ray

    return ray.util.get_node_ip_address()


def bound_tcp_store(
    address: str, port: int, world_size: int, is_master: bool, timeout: datetime.timedelta
) -> dist.TCPStore:
    """A torch TCPStore whose master listens on `address` only: torch's own listener (and its
    `tcp://` rendezvous) binds every interface of the node, exposing the store on cluster networks."""
    import torch.distributed as dist

    if not is_master:
        return dist.TCPStore(address, port, world_size, False, timeout)
    family, _, _, _, sockaddr = socket.getaddrinfo(address, port, type=socket.SOCK_STREAM)[0]
    listener = socket.create_server(sockaddr[:2], family=family, backlog=world_size + 16)
    # The store owns the listening socket from here (detach: Python must not close it).
    return dist.TCPStore(
        address, port, world_size, True, timeout, wait_for_workers=False, master_listen_fd=listener.detach()
    )
