"""Addresses and ports for the processes a run starts: the one place that asks the OS for them."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on `host` now; the caller binds it soon after (another process may take it first)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def node_address() -> str:
    """This node's address as Ray sees it, the one other nodes reach it by."""
    import ray

    return ray.util.get_node_ip_address()
