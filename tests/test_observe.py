"""GET /health and GET /metrics of a real broker, worker and rank, scraped after a known run: values, not names."""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from conftest import FAST_LIVENESS, WORKER_ENV, make_batch, raw_peer, wait_until
from support.lines import wait_for_line
from support.metrics import metric

from draftfeed import RemoteEagle3Target
from draftfeed.contract.supervision import Eagle3Supervision
from draftfeed.net import free_port
from draftfeed.processes import commands
from draftfeed.schemas.protocol import SIGNATURE

pytestmark = pytest.mark.timeout(180)
SERVICE = "observed"
BATCHES = 5


def get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def value(port: int, name: str, **labels: str) -> float | None:
    """The sample ``name`` (summed over those whose labels include ``labels``) on the /metrics page at ``port``."""
    status, text = get(port, "/metrics")
    assert status == 200, text
    return metric(text, name, **labels)


@pytest.fixture(scope="module")
def observed(tiny_target):
    broker_port, worker_port = free_port(), free_port()
    broker = commands.start_broker(extra=["--http-port", str(broker_port), "--http-host", "127.0.0.1", *FAST_LIVENESS])
    worker = None
    try:
        worker = commands.start_worker(
            broker.ready["backend"],
            str(tiny_target),
            "--service",
            SERVICE,
            "--name",
            "observed-0",
            "--http-port",
            str(worker_port),
            "--http-host",
            "127.0.0.1",
            env=WORKER_ENV,
        )
        yield broker, broker_port, worker, worker_port
    finally:
        if worker is not None:
            worker.stop()
        broker.stop()


def test_health_and_metrics_of_a_known_run(observed):
    broker, broker_port, worker, worker_port = observed
    assert broker.ready["http_port"] == broker_port and worker.ready["http_port"] == worker_port
    assert get(broker_port, "/health") == (200, json.dumps({"status": "ready"}))
    assert get(worker_port, "/health") == (200, json.dumps({"status": "ready", "tensor_parallel": 1, "devices": ["cpu"]}))
    assert get(broker_port, "/nothing")[0] == 404
    rank_port = free_port()
    with RemoteEagle3Target(broker.ready["frontend"], SERVICE, metrics_port=rank_port) as target:
        wire_bytes = 0
        for seed in range(BATCHES):
            supervision = target.generate_batch(**make_batch(2, 16, 1000, seed=seed))
            wire_bytes += sum(getattr(supervision, f).numel() * getattr(supervision, f).element_size() for f in Eagle3Supervision.WIRE_FIELDS)
        rank = {"rank": target.rank_id}
        assert get(rank_port, "/health")[0] == 200
        assert value(rank_port, "draftfeed_rank_batches_received_total", **rank) == BATCHES
        assert value(rank_port, "draftfeed_rank_supervision_bytes_total", **rank) == wire_bytes
        assert value(rank_port, "draftfeed_rank_wait_seconds_count", **rank) == BATCHES
        assert value(rank_port, "draftfeed_rank_requests_outstanding", **rank) == 0
        assert value(rank_port, "draftfeed_rank_retries_total", **rank, why="busy_retries") == 0
        # The broker publishes its numbers once per heartbeat interval (0.2 s here), and a request counts as served
        # there once the worker's done arrives, which may be after the rank has its result.
        worker_labels = {"service": SERVICE, "worker": "observed-0"}
        wait_until(
            lambda: value(broker_port, "draftfeed_broker_worker_served_total", **worker_labels) == BATCHES,
            what="5 served requests in the broker's metrics",
        )
        assert value(broker_port, "draftfeed_broker_requests_routed_total") == BATCHES
        assert value(broker_port, "draftfeed_broker_worker_in_flight", **worker_labels) == 0
        assert value(broker_port, "draftfeed_broker_ready_workers", service=SERVICE) == 1
        assert value(broker_port, "draftfeed_broker_queue_depth", service=SERVICE) == 0
        assert value(broker_port, "draftfeed_broker_rank_outstanding", service=SERVICE, **rank) == 0
    # The worker counts an answer once it is delivered, which may be just after the rank has it.
    wait_until(lambda: value(worker_port, "draftfeed_worker_requests_total", outcome="served") == BATCHES, what="5 served in the worker's metrics")
    assert value(worker_port, "draftfeed_worker_forward_seconds_count") == BATCHES
    assert value(worker_port, "draftfeed_worker_supervision_bytes_total", plane="frames") == wire_bytes  # small answers go as frames
    assert value(worker_port, "draftfeed_worker_registered") == 1


def test_a_rejected_message_is_counted_by_reason(observed):
    broker, broker_port, _worker, _worker_port = observed
    before = value(broker_port, "draftfeed_broker_messages_rejected_total", reason="malformed") or 0
    with raw_peer(broker.ready["frontend"]) as peer:
        peer.send_multipart([SIGNATURE, b'{"type":"submit","request_id":"not a number"}'])
        assert peer.poll(10_000), "the broker did not answer the malformed message"
        peer.recv_multipart()
    wait_until(lambda: value(broker_port, "draftfeed_broker_messages_rejected_total", reason="malformed") == before + 1, what="the rejection counted")


def test_a_worker_without_a_broker_is_not_ready_and_says_why(tiny_target):
    port = free_port()
    worker = commands.start_worker(
        "tcp://127.0.0.1:9",
        str(tiny_target),
        "--http-port",
        str(port),
        "--http-host",
        "127.0.0.1",
        env=WORKER_ENV,
        ready_pattern="registering with the broker",
    )
    try:

        def not_registered() -> bool:
            status, body = get(port, "/health")
            return status == 503 and "not registered with a broker at tcp://127.0.0.1:9" in json.loads(body)["reason"]

        wait_until(not_registered, what="/health answering 503 with the reason")
        assert value(port, "draftfeed_worker_registered") == 0
    finally:
        worker.kill()


def test_a_port_given_and_taken_is_one_line(tiny_target):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(RuntimeError, match=rf"cannot serve health and metrics on 127.0.0.1:{port} \(--http-port\).*choose another port"):
            commands.start_broker(extra=["--http-port", str(port), "--http-host", "127.0.0.1"])


def test_json_logs_are_one_object_per_line():
    broker = commands.start_broker(extra=["--log-format", "json"])
    try:
        line = wait_for_line(broker, r'^\{"time": ".*"logger": "draftfeed.broker"', timeout_s=30)
        entry = json.loads(line)
        assert entry["level"] == "INFO" and entry["pid"] == broker.pid
        assert f"ranks on {broker.ready['frontend']}, workers on {broker.ready['backend']}" in entry["message"]
        assert entry["time"].endswith("Z")
    finally:
        broker.stop()


def test_status_watch_prints_again_until_interrupted(observed):
    """A thread reads the watch's output to its end, so the pipe never fills: a watch blocked writing to a full pipe
    cannot see its Ctrl-C (seen once under load, when this test read a line per wake-up)."""
    import queue
    import signal
    import subprocess
    import sys
    import threading
    import time

    broker = observed[0]
    watch = subprocess.Popen(
        [sys.executable, "-m", "draftfeed", "status", "--broker", broker.ready["frontend"], "--watch", "0.2"], stdout=subprocess.PIPE, text=True
    )
    lines: queue.Queue[str | None] = queue.Queue()

    def read() -> None:
        assert watch.stdout is not None
        for line in watch.stdout:
            lines.put(line)
        lines.put(None)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        refreshes, tables, deadline = 0, 0, time.monotonic() + 60
        while refreshes < 3 and (remaining := deadline - time.monotonic()) > 0:
            try:
                line = lines.get(timeout=remaining)
            except queue.Empty:
                break
            assert line is not None, f"the watch ended by itself with {watch.wait(10)} after {refreshes} refreshes"
            refreshes += line.startswith("---- ")
            tables += SERVICE in line
        assert refreshes >= 3 and tables >= 2, f"{refreshes} refreshes, {tables} lines naming the service"
        watch.send_signal(signal.SIGINT)
        assert watch.wait(30) == 0
    finally:
        watch.kill()
        watch.wait(10)
        reader.join(10)


def test_free_ports_are_drawn_below_the_ephemeral_range():
    """A port the kernel hands to connections and port-0 binds can be taken by any test running beside this one
    before its server binds it (seen once: a rank's metrics port taken in a parallel run)."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = [free_port() for _ in range(20)]
    assert all(10_000 <= port < low for port in ports), ports
    assert len(set(ports)) > 1, "drawn at random"
