"""A pytest plugin for vLLM's own test files (run from vLLM's sdist, never copied here):
with ``--kvdefrag-mode=kvdefrag`` every scheduler they build is kvdefrag's, with real ranks.

Loaded with ``-p kvdefrag_substitution`` (this folder on ``PYTHONPATH``) by
``test_vllm_connector_tests.py``, in a pytest run of its own rooted in the extracted files.

Modes:

* ``vllm``: vLLM's scheduler, untouched; it only records, per test, the schedulers built.
* ``kvdefrag``: the names ``Scheduler`` and ``AsyncScheduler`` in vLLM's test modules and
  helpers (``tests.*``: ``create_scheduler`` picks its class from them) name subclasses of
  ``DefragScheduler`` and ``DefragAsyncScheduler``. Each one, before vLLM's ``__init__``,
  serves one kvdefrag rank on a CPU tensor of the scheduler's ``num_blocks`` and block size
  (threshold 0: it compacts whenever the pool has a hole) in a run directory of its own,
  publishes it there for the scheduler's engine id, and points ``KVDEFRAG_VLLM_RUN_DIR`` at
  it: the scheduler finds and verifies its rank as it does under vLLM. After the test every
  step in flight is settled (a step the rank refused fails the test), then the rank stops.

  A KV connector whose class is defined in vLLM's test files (``MockKVConnector``,
  ``TestExampleConnector``, a test's own ``KVConnectorBase_V1`` subclass) gets through
  kvdefrag's connector refusal (``refusals.check_kv_connector``); every other connector
  meets it as in production. A test whose configuration kvdefrag refuses at start-up
  (``UnsupportedByKvdefrag``: a hybrid model, an EAGLE drafter, ...) is skipped with reason
  ``kvdefrag refuses: ...`` and reported as refused.

For every test run, ``--kvdefrag-report`` receives (JSON, by node id): its outcome, the
number of schedulers built with a KV connector, how many of those were kvdefrag's, the
kvdefrag steps they sent, the ledger audits they ran, the KV blocks their ranks moved, and
any refusal or failure.
``--kvdefrag-select`` names a file of node ids: only those run.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import shutil
import sys
import tempfile
from typing import Any

import pytest

MODES = ("vllm", "kvdefrag")
REFUSED_PREFIX = "kvdefrag refuses: "
_RECORDS = pytest.StashKey[dict[str, "TestRecord"]]()


@dataclasses.dataclass
class TestRecord:
    """What one test did. ``outcome``: passed, failed, error, skipped or refused (then
    ``refusal`` says why); ``failure``: the exception a failed test ended with."""

    __test__ = False

    outcome: str = "passed"
    num_connector_schedulers: int = 0
    num_kvdefrag_schedulers: int = 0
    num_steps: int = 0
    num_audits: int = 0
    num_blocks_moved: int = 0
    num_async_restored: int = 0
    refusal: str = ""
    failure: str = ""


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("kvdefrag")
    group.addoption("--kvdefrag-mode", choices=MODES, default="vllm")
    group.addoption("--kvdefrag-report", default=None, help="JSON file written at the end")
    group.addoption("--kvdefrag-select", default=None, help="file of node ids to run")


def pytest_configure(config: pytest.Config) -> None:
    # vLLM's pyproject declares these; its tests run here without its pytest settings.
    for marker in ("slow_test", "skip_global_cleanup", "cpu_test", "core_model", "optional"):
        config.addinivalue_line("markers", marker)
    config.stash[_RECORDS] = {}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    path = config.getoption("--kvdefrag-select")
    if path is None:
        return
    with open(path) as selection:
        wanted = {line.strip() for line in selection if line.strip()}
    kept = [item for item in items if item.nodeid in wanted]
    config.hook.pytest_deselected(items=[item for item in items if item.nodeid not in wanted])
    items[:] = kept


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    report = yield
    record = item.config.stash[_RECORDS].setdefault(item.nodeid, TestRecord())
    if report.failed:
        record.outcome = "failed" if report.when == "call" else "error"
        crash = getattr(report.longrepr, "reprcrash", None)
        record.failure = str(getattr(crash, "message", report.longrepr))[:2000]
    elif report.skipped and record.outcome == "passed":
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else ""
        is_refused = str(reason).startswith(("Skipped: " + REFUSED_PREFIX, REFUSED_PREFIX))
        record.outcome = "refused" if is_refused else "skipped"
    return report


def pytest_sessionfinish(session: pytest.Session) -> None:
    path = session.config.getoption("--kvdefrag-report")
    if path is None:
        return
    records = session.config.stash[_RECORDS]
    with open(path, "w") as report:
        json.dump({nodeid: dataclasses.asdict(r) for nodeid, r in records.items()}, report)


@pytest.fixture(autouse=True)
def _kvdefrag_schedulers(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Any:
    """Records every scheduler the test builds; in kvdefrag mode, makes them kvdefrag's."""
    from vllm.v1.core.sched.scheduler import Scheduler

    record = request.config.stash[_RECORDS].setdefault(request.node.nodeid, TestRecord())
    built: list[Any] = []
    vllm_init = Scheduler.__init__

    def recording_init(self: Any, *args: Any, **kwargs: Any) -> None:
        vllm_init(self, *args, **kwargs)
        built.append(self)

    monkeypatch.setattr(Scheduler, "__init__", recording_init)
    ranks = _Ranks()
    if request.config.getoption("--kvdefrag-mode") == "kvdefrag":
        _substitute_kvdefrag(monkeypatch, ranks, record, inspect.signature(vllm_init))
    try:
        yield
    finally:
        _finish(built, ranks, record)


def _finish(built: list[Any], ranks: _Ranks, record: TestRecord) -> None:
    """Counts the test's schedulers, settles every kvdefrag step in flight (raising what a
    rank refused), closes the clients and stops the ranks."""
    from kvdefrag.vllm.scheduler import DefragScheduler

    try:
        for scheduler in built:
            if getattr(scheduler, "connector", None) is not None:
                record.num_connector_schedulers += 1
                if isinstance(scheduler, DefragScheduler):
                    record.num_kvdefrag_schedulers += 1
            bridge = getattr(scheduler, "kvdefrag", None)
            if bridge is not None:
                record.num_steps += bridge.totals.num_steps
                record.num_audits += bridge.totals.num_audits
        for scheduler in built:
            bridge = getattr(scheduler, "kvdefrag", None)
            if bridge is not None:
                bridge.settle()
                bridge.close()
        record.num_blocks_moved = ranks.num_blocks_moved()
    finally:
        ranks.stop()


class _Ranks:
    """The kvdefrag ranks one test serves: one per scheduler, each in its own run dir."""

    def __init__(self) -> None:
        self._served: list[tuple[Any, str]] = []

    def serve(self, vllm_config: Any, kv_cache_config: Any) -> str:
        """Serves and publishes a rank for a scheduler about to be built; returns its run
        directory (a short path: a unix socket path is at most 107 bytes)."""
        import torch

        from kvdefrag.server import EngineConfig, ServiceConfig, serve_in_process
        from kvdefrag.vllm._discovery import PublishedRank, publish_ranks, rank_address
        from kvdefrag.vllm.contract import engine_id

        run_dir = tempfile.mkdtemp(prefix="kvd-")  # mode 0700
        groups = kv_cache_config.kv_cache_groups
        block_size = int(groups[0].kv_cache_spec.block_size) if groups else 16
        num_blocks = int(kv_cache_config.num_blocks)
        secret = os.urandom(32)
        address = rank_address(run_dir, 0)
        key = torch.zeros(num_blocks * block_size, 1, dtype=torch.int64)
        handle = serve_in_process(
            [(key, None)],
            block_size,
            engine_config=EngineConfig(threshold=0),
            service_config=ServiceConfig(address=address),
            identity_secret=secret,
        )
        self._served.append((handle, run_dir))
        publish_ranks(run_dir, [PublishedRank(address, secret)], engine_id=engine_id(vllm_config))
        return run_dir

    def num_blocks_moved(self) -> int:
        """KV blocks the ranks moved (compactions) since they started."""
        num_moved = 0
        for handle, _ in self._served:
            with handle.kv_lock:
                found = handle.moves_since(0)
            num_moved += sum(len(batch) for batch in found[1]) if found else 0
        return num_moved

    def stop(self) -> None:
        for handle, run_dir in self._served:
            handle.stop(grace_s=0.5)
            shutil.rmtree(run_dir, ignore_errors=True)
        self._served.clear()


def _substitute_kvdefrag(
    monkeypatch: pytest.MonkeyPatch,
    ranks: _Ranks,
    record: TestRecord,
    signature: inspect.Signature,
) -> None:
    """Points vLLM's test modules at kvdefrag's scheduler classes and lets the test's own KV
    connectors through kvdefrag's refusal, for one test (``signature``: vLLM's
    ``Scheduler.__init__``)."""
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler

    from kvdefrag.vllm import refusals
    from kvdefrag.vllm.config import RUN_DIR_ENV
    from kvdefrag.vllm.errors import UnsupportedByKvdefrag
    from kvdefrag.vllm.scheduler import DefragAsyncScheduler, DefragScheduler

    monkeypatch.setenv(RUN_DIR_ENV, tempfile.gettempdir())  # replaced per scheduler

    def served(base: type) -> type:
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            bound = signature.bind(self, *args, **kwargs).arguments
            vllm_config = bound["vllm_config"]
            if (
                issubclass(base, AsyncScheduler)
                and not vllm_config.scheduler_config.async_scheduling
            ):
                # NOTE: vLLM's CPU platform turns async scheduling off in every config
                # (CpuPlatform.check_and_update_config) while the test asked for it and
                # builds an AsyncScheduler; kvdefrag refuses a class that does not match
                # the mode, so the mode the test asked for is restored.
                vllm_config.scheduler_config.async_scheduling = True
                record.num_async_restored += 1
            run_dir = ranks.serve(vllm_config, bound["kv_cache_config"])
            os.environ[RUN_DIR_ENV] = run_dir
            try:
                base.__init__(self, *args, **kwargs)
            except UnsupportedByKvdefrag as err:
                record.refusal = str(err)
                pytest.skip(REFUSED_PREFIX + str(err))

        return type(base.__name__, (base,), {"__init__": __init__, "__module__": __name__})

    substitutes = {Scheduler: served(DefragScheduler), AsyncScheduler: served(DefragAsyncScheduler)}
    for name, module in list(sys.modules.items()):
        if not (name == "tests" or name.startswith("tests.")) or module is None:
            continue
        for attribute in ("Scheduler", "AsyncScheduler"):
            found = getattr(module, attribute, None)
            if found in substitutes:
                monkeypatch.setattr(module, attribute, substitutes[found])

    check_kv_connector = refusals.check_kv_connector

    def letting_test_connectors_through(kv_transfer_config: Any) -> None:
        if not _is_test_connector(kv_transfer_config):
            check_kv_connector(kv_transfer_config)

    monkeypatch.setattr(refusals, "check_kv_connector", letting_test_connectors_through)


def _is_test_connector(kv_transfer_config: Any) -> bool:
    """Whether the connector's class is defined in vLLM's test files (``tests.*``)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    try:
        connector_cls = KVConnectorFactory.get_connector_class(kv_transfer_config)
    except (ValueError, ImportError, AttributeError):
        return False
    return str(connector_cls.__module__).startswith("tests.")
