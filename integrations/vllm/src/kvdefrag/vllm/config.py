"""The vLLM integration's settings, read once per process from the environment.

Both sides of the integration (the scheduler in vLLM's engine core, every worker) call
``load_integration_config`` once at start-up and pass the frozen result to what needs it,
as the server does with ``kvdefrag.server.load_config``. Every variable is checked there,
so a malformed one stops the process before anything starts, naming the variable and
the fix (``BadSetting``).

=============================  ==========================================================
variable                       meaning
=============================  ==========================================================
``KVDEFRAG_VLLM_RUN_DIR``      the engine's run directory (absolute; required)
``KVDEFRAG_VLLM_TCP_PORT``     set: ranks serve on TCP, this port plus the rank's offset
``KVDEFRAG_VLLM_TCP_HOST``     the interface TCP ranks listen on and announce
``KVDEFRAG_VLLM_TLS_*_FILE``   the scheduler's client TLS files (CA, CERT, KEY)
``KVDEFRAG_VLLM_STEP_WAIT_S``  how long a worker waits for its step (default 60 s)
``KVDEFRAG_VLLM_AUDIT_EVERY``  audit the scheduler's ledger every N steps (0: never)
=============================  ==========================================================
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping

from kvdefrag.common import InvalidArgument
from kvdefrag.common.durations import MAX_DURATION_S, check_duration
from kvdefrag.vllm.errors import BadSetting

__all__ = [
    "AUDIT_EVERY_ENV",
    "CLIENT_TLS_ENV",
    "RAY_ENV_PREFIXES_ENV",
    "RUN_DIR_ENV",
    "STEP_WAIT_ENV",
    "TCP_HOST_ENV",
    "TCP_PORT_ENV",
    "IntegrationConfig",
    "load_integration_config",
    "tcp_address",
]

RUN_DIR_ENV = "KVDEFRAG_VLLM_RUN_DIR"
"""The environment variable naming the run directory of one vLLM engine."""

TCP_PORT_ENV = "KVDEFRAG_VLLM_TCP_PORT"
"""Set: a rank serves on TCP port ``value + rank_port_offset`` (``value + local rank``
without data parallelism) instead of a unix socket."""

TCP_HOST_ENV = "KVDEFRAG_VLLM_TCP_HOST"
"""The interface TCP ranks listen on and announce (default: the IP vLLM uses for the host)."""

CLIENT_TLS_ENV = {
    "root_certificates": "KVDEFRAG_VLLM_TLS_CA_FILE",
    "certificate_chain": "KVDEFRAG_VLLM_TLS_CERT_FILE",
    "private_key": "KVDEFRAG_VLLM_TLS_KEY_FILE",
}
"""``DefragClient`` TLS argument -> the variable naming its PEM file (scheduler side)."""

STEP_WAIT_ENV = "KVDEFRAG_VLLM_STEP_WAIT_S"
"""How long a worker waits for its step to be applied (seconds; default 60)."""

AUDIT_EVERY_ENV = "KVDEFRAG_VLLM_AUDIT_EVERY"
"""Compare the scheduler side's ledger with vLLM's KV cache manager every N steps (O(pool)
each time; unset or 0: never). The tests run it every step."""

RAY_ENV_PREFIXES_ENV = "VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY"
"""vLLM's Ray executors copy to their workers only the variables whose names start with
one of their prefixes (``VLLM_``, ``NCCL_``, ``HF_``, ...; vLLM 0.32 and 0.33
``vllm/ray/ray_env.py`` ``DEFAULT_ENV_VAR_PREFIXES``) plus the ones this adds."""

DEFAULT_STEP_WAIT_S = 60.0


@dataclasses.dataclass(frozen=True)
class IntegrationConfig:
    """The integration's settings (``load_integration_config``).

    Attributes:
        run_dir: The base run directory (absolute); a data-parallel engine's own is
            ``contract.engine_run_dir``.
        tcp_port: The base TCP port ranks serve on; None: unix sockets in the run
            directory.
        tcp_host: The interface TCP ranks listen on; None: the host's IP as vLLM sees it.
        client_tls_files: ``DefragClient`` TLS argument -> PEM file path, for the
            scheduler's clients (read by ``client_tls``); empty: no TLS.
        step_wait_s: How long a worker's pass waits for its step to be applied.
        audit_every: Audit the scheduler's ledger every N steps; 0: never.
    """

    run_dir: str
    tcp_port: int | None = None
    tcp_host: str | None = None
    client_tls_files: Mapping[str, str] = dataclasses.field(default_factory=dict)
    step_wait_s: float = DEFAULT_STEP_WAIT_S
    audit_every: int = 0


def load_integration_config(
    environ: Mapping[str, str] | None = None, *, executor_backend: object = None
) -> IntegrationConfig:
    """Reads and checks every ``KVDEFRAG_VLLM_*`` variable.

    Args:
        environ: The environment (default ``os.environ``).
        executor_backend: ``ParallelConfig.distributed_executor_backend``, for the message
            when the run directory is unset in a Ray worker (vLLM's Ray executor copies
            only some variable prefixes to its workers).

    Raises:
        BadSetting: A variable is missing or malformed (the first one found, named with
            its fix).
    """
    env = os.environ if environ is None else environ
    return IntegrationConfig(
        run_dir=_run_dir(env, executor_backend),
        tcp_port=_tcp_port(env),
        tcp_host=env.get(TCP_HOST_ENV, "").strip() or None,
        client_tls_files={
            argument: path
            for argument, variable in CLIENT_TLS_ENV.items()
            if (path := env.get(variable, "").strip())
        },
        step_wait_s=_step_wait_s(env),
        audit_every=_audit_every(env),
    )


def tcp_address(
    config: IntegrationConfig, port_offset: int, default_host: Callable[[], str]
) -> str | None:
    """``HOST:PORT`` for a rank when ``KVDEFRAG_VLLM_TCP_PORT`` is set, else None.

    Args:
        config: The integration's settings.
        port_offset: What this rank adds to the port (``rank_port_offset``: the local rank
            without data parallelism).
        default_host: Asked only when the port is set and the host is not.

    Raises:
        BadSetting: This rank's port (the base plus its offset) is past 65535.
    """
    if config.tcp_port is None:
        return None
    port = config.tcp_port + port_offset
    if port > 65535:
        raise BadSetting(
            f"kvdefrag: {TCP_PORT_ENV}={config.tcp_port}: this rank serves on "
            f"{TCP_PORT_ENV} + {port_offset} (DP rank x world size + local rank) = {port}, "
            f"not a TCP port; choose {TCP_PORT_ENV} in 1..{65535 - port_offset}"
        )
    host = config.tcp_host or default_host()
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _run_dir(env: Mapping[str, str], executor_backend: object) -> str:
    run_dir = env.get(RUN_DIR_ENV, "")
    if os.path.isabs(run_dir):
        return run_dir
    fix = f"set {RUN_DIR_ENV} to an absolute directory private to this vLLM engine"
    if uses_ray(executor_backend) and not run_dir:
        fix = (
            f"{RUN_DIR_ENV} is unset in this Ray worker: vLLM's Ray executor copies only "
            f"variables with the prefixes VLLM_, NCCL_, HF_, ... to its workers; export "
            f"{RAY_ENV_PREFIXES_ENV}=KVDEFRAG_ where you start vLLM (with {RUN_DIR_ENV} "
            "set to an absolute directory private to this vLLM engine)"
        )
    raise BadSetting(f"kvdefrag: {fix} (e.g. $XDG_RUNTIME_DIR/kvdefrag/<engine>), got {run_dir!r}")


def uses_ray(executor_backend: object) -> bool:
    """Whether vLLM's executor runs its workers as Ray actors (``"ray"``, or a class that
    says so: ``Executor.uses_ray``)."""
    if executor_backend == "ray":
        return True
    return isinstance(executor_backend, type) and bool(getattr(executor_backend, "uses_ray", False))


def _tcp_port(env: Mapping[str, str]) -> int | None:
    text = env.get(TCP_PORT_ENV, "").strip()
    if not text:
        return None
    try:
        port = int(text)
    except ValueError:
        port = 0
    if not 0 < port < 65536:
        raise BadSetting(f"kvdefrag: {TCP_PORT_ENV} must be a TCP port (1..65535), got {text!r}")
    return port


def _step_wait_s(env: Mapping[str, str]) -> float:
    text = env.get(STEP_WAIT_ENV, "").strip()
    if not text:
        return DEFAULT_STEP_WAIT_S
    try:
        return check_duration(STEP_WAIT_ENV, float(text))
    except (ValueError, InvalidArgument):
        raise BadSetting(
            f"kvdefrag: {STEP_WAIT_ENV} must be a positive number of seconds, at most "
            f"{MAX_DURATION_S:g} (a day), got {text!r}"
        ) from None


def _audit_every(env: Mapping[str, str]) -> int:
    text = env.get(AUDIT_EVERY_ENV, "").strip()
    try:
        every = int(text) if text else 0
    except ValueError:
        every = -1
    if every < 0:
        raise BadSetting(f"kvdefrag: {AUDIT_EVERY_ENV} must be a whole number >= 0, got {text!r}")
    return every
