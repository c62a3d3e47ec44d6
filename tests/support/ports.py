"""Free TCP ports for servers a test starts later, out of everyone else's way.

A port found free by binding to port 0 comes from the kernel's ephemeral range, from which
every other ``bind(0)`` and outgoing connection also draws: vLLM, ZMQ, gloo and Ray take
many such ports while an engine starts, so one of them can take the port before the test's
server binds it ("Address already in use"). A block below that range is never handed out
by the kernel; it is only checked to be free now.
"""

from __future__ import annotations

import random
import socket

# The lowest port handed out here: above the well-known and most registered services.
LOWEST_PORT = 10_000


def ephemeral_range() -> tuple[int, int]:
    """The kernel's ephemeral port range (Linux's ``ip_local_port_range``)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as file:
            low, high = (int(field) for field in file.read().split())
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default
    return low, high


def is_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as probe:
        try:
            probe.bind((host, port))
        except OSError:
            return False
    return True


def free_port_block(length: int = 1, host: str = "127.0.0.1") -> int:
    """A port ``p`` with ``p`` .. ``p + length - 1`` free now, all below the kernel's
    ephemeral range, so that no ``bind(0)`` or outgoing connection takes one meanwhile.

    Raises:
        AssertionError: No such block in 200 tries, or no room below the ephemeral range.
    """
    low, _ = ephemeral_range()
    highest_base = low - length
    if highest_base < LOWEST_PORT:
        raise AssertionError(f"no room for {length} ports below the ephemeral range ({low})")
    for _ in range(200):
        base = random.randint(LOWEST_PORT, highest_base)
        if all(is_free(port, host) for port in range(base, base + length)):
            return base
    raise AssertionError(f"no {length} consecutive free ports below {low}")
