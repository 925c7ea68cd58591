"""Shared fixtures: a tiny target built locally, real broker and worker processes, and the contract's reference.

Every process a fixture starts is stopped by the fixture, also when the test fails.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import zmq
from reference import assert_supervision_equal, make_batch, reference_dspark, reference_eagle3, zero_padding  # noqa: F401 (shared with the tests)
from support import preload

from draftfeed.processes import commands

TESTS_DIR = str(Path(__file__).parent)
# One thread per worker (two cores here); tests/ on the path for the fake engines.
THREADS = 1
WORKER_ENV = {"OMP_NUM_THREADS": str(THREADS), "PYTHONPATH": os.pathsep.join(filter(None, [TESTS_DIR, os.environ.get("PYTHONPATH")]))}
# The in-process references run here under the workers' thread count: bit-exactness holds for the same engine, dtype,
# device and threads, and on some CPUs (AMD EPYC among them) a matmul's result changes with the number of threads.
torch.set_num_threads(THREADS)
# Workers and rank processes are forked from a process that has imported torch and transformers once
# (tests/support/preload.py): about 3.8 s of CPU less per start, which is most of what the suite spends.
preload.use_preloaded_starts()
# Fault tests run with a short liveness period: 0.2 s heartbeats, dead after 8 missed (1.6 s). 5 (1 s) was seen to
# expire a live rank and worker on CI's loaded 2 cores.
FAST_LIVENESS = ["--heartbeat-interval", "0.2", "--liveness", "8"]


# The modules that take longest from start to end (most of it waiting on processes), run first: make test hands
# whole modules to 4 processes in collection order (--dist loadscope --no-loadscope-reorder), and one of these started
# last would leave the other processes idle at the end. Seconds from start to end, as the suite ran them (--durations=0).
LONGEST_FIRST = (
    "test_tensor_parallel.py",  # 145
    "test_nodes.py",  # 134
    "test_reliability.py",  # 70-97
    "test_automodel_engine.py",  # 83
    "test_frontier_rows.py",  # 74
    "test_nemo_frontier.py",  # 65
    "test_demo.py",  # 50-63
    "test_mistakes.py",  # 55
    "test_nixl_plane.py",  # 52
    "test_preload.py",  # 49
    "test_nemo_resume.py",  # 46
)


def long_run() -> bool:
    """Whether the long variants run too (pyproject.toml's `long` marker): `make test-long` sets DRAFTFEED_LONG=1."""
    return os.environ.get("DRAFTFEED_LONG") == "1"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    first = {name: place for place, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: first.get(item.path.name, len(first)))  # stable: the rest keep their order
    if not long_run():
        kept = [item for item in items if item.get_closest_marker("long") is None]
        if len(kept) != len(items):
            config.hook.pytest_deselected(items=[item for item in items if item.get_closest_marker("long") is not None])
            items[:] = kept


def suite_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder every process of this run of the suite shares: pytest-xdist's workers each have a base temp folder,
    all under one for the run."""
    base = tmp_path_factory.getbasetemp()
    return (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "shared"


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from draftfeed.tiny import build_tiny_target

    return build_tiny_target(tmp_path_factory.mktemp("targets") / "tiny-llama", num_hidden_layers=8, hidden_size=64, vocab_size=1000)


@pytest.fixture(scope="session")
def moe_target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random-weight DeepSeek-V3 in the real configuration's proportions (also Kimi-K2's architecture), the
    mixture-of-experts target of the tensor-parallel tests, on one machine and over two."""
    from draftfeed.tiny import build_tiny_target

    return build_tiny_target(tmp_path_factory.mktemp("targets") / "tiny-deepseek-v3", arch="deepseek-v3")


@pytest.fixture(scope="session")
def tp_targets(tiny_target: Path, moe_target: Path) -> dict[str, Path]:
    """The targets of the tensor-parallel reference (support/tensor_parallel.py), by name."""
    return {"llama": tiny_target, "deepseek-v3": moe_target}


@pytest.fixture(scope="session")
def tiny_model(tiny_target: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).eval()


class Cluster:
    """One broker and the workers a test starts on it; stops them all at teardown."""

    def __init__(self, *broker_args: str) -> None:
        self.broker_args = list(broker_args)
        self.broker = commands.start_broker(extra=self.broker_args)
        self.workers: list[commands.Process] = []
        self.others: list[commands.Process] = []

    def restart_broker(self) -> commands.Process:
        """A new broker on the endpoints of the last one (after that one was stopped or killed)."""
        old = self.broker.ready
        self.others.append(self.broker)
        self.broker = commands.start(["broker", "--frontend", old["frontend"], "--backend", old["backend"], "--http-port", "0", *self.broker_args])
        return self.broker

    @property
    def frontend(self) -> str:
        return self.broker.ready["frontend"]

    @property
    def backend(self) -> str:
        return self.broker.ready["backend"]

    def add_worker(self, target: Path | str, *args: str, env: dict[str, str] | None = None) -> commands.Process:
        worker = commands.start_worker(self.backend, str(target), *args, env={**WORKER_ENV, **(env or {})})
        self.workers.append(worker)
        return worker

    def status(self) -> dict:
        from draftfeed.observe.status_client import fetch_status

        return fetch_status(self.frontend, timeout_s=10)

    def worker_status(self, name: str) -> dict | None:
        for service in self.status()["services"].values():
            for worker in service["workers"]:
                if worker["worker"] == name:
                    return worker
        return None

    def stop(self) -> None:
        for process in [*self.workers, *self.others, self.broker]:
            process.stop(timeout_s=5)


def add_service(cluster: Cluster, target: Path | str, service: str, *flags: str, workers: int = 1) -> Cluster:
    """Start ``workers`` workers of ``target`` serving ``service`` on ``cluster`` with the worker ``flags`` (none: a
    standard eagle3 service), named ``{service}-0``, ``{service}-1``, ...; returns the cluster, for a module's fixture."""
    for index in range(workers):
        cluster.add_worker(target, "--service", service, *flags, "--name", f"{service}-{index}")
    return cluster


@contextmanager
def raw_peer(endpoint: str, identity: bytes | None = None, curve: tuple[bytes, bytes, bytes] | None = None) -> Iterator[zmq.Socket]:
    """A bare DEALER for speaking the protocol by hand (or breaking it); closed with linger 0 on exit.

    ``curve``: (own public key, own secret key, the server's public key) for a CURVE client.
    """
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if identity is not None:
        sock.setsockopt(zmq.ROUTING_ID, identity)
    if curve is not None:
        sock.curve_publickey, sock.curve_secretkey, sock.curve_serverkey = curve
    sock.connect(endpoint)
    try:
        yield sock
    finally:
        sock.close(0)
        context.term()


@contextmanager
def raw_router(address: str = "tcp://127.0.0.1") -> Iterator[tuple[zmq.Socket, str]]:
    """A bare ROUTER bound to a free port of ``address``, standing in for a broker's backend or a rank's data socket.

    Yields the socket and its endpoint; closed with linger 0 on exit.
    """
    context = zmq.Context()
    sock = context.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        port = sock.bind_to_random_port(address)
        yield sock, f"{address}:{port}"
    finally:
        sock.close(0)
        context.term()


def wait_until(condition, timeout_s: float = 30.0, what: str = "the condition", poll_s: float = 0.05):
    """Poll ``condition()`` until it returns something truthy; fail the test after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(poll_s)


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    cluster = Cluster()
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def fast_cluster() -> Iterator[Cluster]:
    """A cluster of its own for a fault test, with the short liveness period (FAST_LIVENESS)."""
    cluster = Cluster(*FAST_LIVENESS)
    try:
        yield cluster
    finally:
        cluster.stop()


def run_concurrently(*calls, timeout_s: float = 180.0) -> None:
    """Run each zero-argument call on its own thread and wait for all; re-raise the first error here."""
    import threading

    errors: list[BaseException] = []

    def guarded(call) -> None:
        try:
            call()
        except BaseException as exc:  # surfaces in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=guarded, args=(call,), daemon=True) for call in calls]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + timeout_s
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    if errors:
        raise errors[0]
    assert not any(thread.is_alive() for thread in threads), f"a concurrent call ran past {timeout_s:.0f} s"


os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def hosts_available() -> None:
    """Skips the test, with the reason, where hosts cannot be made as network namespaces (draftfeed/bench/hosts.py)."""
    from draftfeed.bench.hosts import unavailable_reason

    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
