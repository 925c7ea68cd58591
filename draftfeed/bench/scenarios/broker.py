"""The broker's routing rate and a rank's latency against a direct DEALER->ROUTER echo."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import zmq

from draftfeed.bench.harness import Pipeline, Row, cpu_seconds, last_json, probe
from draftfeed.processes import children, commands


def run(quick: bool, workdir: Path) -> list[Row]:
    count = 2000 if quick else 20000
    with Pipeline(workers=2, tokens=1, compute_ms=0, capacity=32) as pipeline:
        from draftfeed import RemoteEagle3Target

        batch = {k: torch.zeros(1, 1, dtype=torch.int64) for k in ("input_ids", "attention_mask", "loss_mask")}
        with RemoteEagle3Target(pipeline.frontend, "bench", prefetch_depth=64) as target:
            target.model_info()
            latencies = []
            for _ in range(100 if quick else 1000):
                started = time.perf_counter()
                target.generate_batch(**batch)
                latencies.append(time.perf_counter() - started)
            started = time.perf_counter()
            for _ in target.iterate(batch for _ in range(count)):
                pass
            rate = count / (time.perf_counter() - started)
    broker = commands.start_broker(extra=["--log-level", "WARNING"])
    try:
        routed, broker_cpu = routed_rate(broker.ready, broker.pid, count)
    finally:
        broker.stop()
    forwarder = probe(["raw-forwarder", str(count)])
    try:
        assert forwarder.stdout is not None
        forwarded, forwarder_cpu = routed_rate(json.loads(forwarder.stdout.readline()), forwarder.pid, count)
        forwarder.communicate(timeout=60)
    finally:
        forwarder.kill()
    echo_rate, echo_latencies, echo_cpu = _echo_baseline(count, 100 if quick else 1000)
    p50, p99 = statistics.median(latencies), sorted(latencies)[int(0.99 * len(latencies))]
    e50, e99 = statistics.median(echo_latencies), sorted(echo_latencies)[int(0.99 * len(echo_latencies))]
    return [
        Row(
            "broker",
            "requests routed per second by the broker alone (raw-pyzmq rank and worker)",
            routed,
            echo_rate,
            "req/s",
            "direct DEALER->ROUTER echo",
            ">= 20,000; >= 0.4",
        ),
        Row(
            "broker",
            "requests routed per second by the broker against a policy-free forwarder of the same messages",
            routed,
            forwarded,
            "req/s",
            "raw-pyzmq forwarder, same rank and worker",
        ),
        Row(
            "broker",
            "broker CPU per routed request (a submit and a done in, a dispatch out)",
            broker_cpu * 1e6,
            echo_cpu * 1e6,
            "us",
            "echo server CPU per message (one in, one out)",
        ),
        Row(
            "broker",
            "broker CPU per routed request, against the policy-free forwarder's",
            broker_cpu * 1e6,
            forwarder_cpu * 1e6,
            "us",
            "forwarder CPU per routed request",
        ),
        Row("broker", "requests per second end to end (draftfeed rank, 2 synthetic workers)", rate, echo_rate, "req/s", "direct DEALER->ROUTER echo"),
        Row("broker", "request latency p50", p50 * 1e6, e50 * 1e6, "us", "direct echo p50"),
        Row("broker", "request latency p99", p99 * 1e6, e99 * 1e6, "us", "direct echo p99"),
    ]


def routed_rate(endpoints: dict, pid: int, count: int) -> tuple[float, float]:
    """Requests per second that ``raw-rank`` gets through the broker at ``endpoints`` (to ``raw-worker``), and the
    broker process's (``pid``) CPU seconds per request meanwhile."""
    worker = probe(["raw-worker", endpoints["backend"], str(count)])
    try:
        cpu_before = cpu_seconds(pid)
        rate = last_json(probe(["raw-rank", endpoints["frontend"], str(count), "64"]))["requests_per_s"]
        cpu = (cpu_seconds(pid) - cpu_before) / count
        worker.communicate(timeout=60)
    finally:
        worker.kill()
    return rate, cpu


_ECHO_SERVER = """
import sys, zmq
ctx = zmq.Context(); s = ctx.socket(zmq.ROUTER); s.setsockopt(zmq.LINGER, 0)
port = s.bind_to_random_port("tcp://127.0.0.1"); print(port, flush=True)
while True:
    frames = s.recv_multipart()
    if frames[1] == b"stop":
        break
    s.send_multipart(frames)
"""


def _echo_baseline(count: int, singles: int) -> tuple[float, list[float], float]:
    """Rate and latencies of a direct echo, and the echo server's CPU seconds per message."""
    server = children.spawn([sys.executable, "-c", _ECHO_SERVER], stdout=subprocess.PIPE, text=True)
    assert server.stdout is not None
    port = int(server.stdout.readline())
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{port}")
    try:
        latencies = []
        for _ in range(singles):
            started = time.perf_counter()
            sock.send(b"x")
            sock.recv()
            latencies.append(time.perf_counter() - started)
        started, cpu_before = time.perf_counter(), cpu_seconds(server.pid)
        window, sent, received = 64, 0, 0
        while received < count:
            while sent < count and sent - received < window:
                sock.send(b"x")
                sent += 1
            sock.recv()
            received += 1
        rate = count / (time.perf_counter() - started)
        cpu = (cpu_seconds(server.pid) - cpu_before) / count
        sock.send(b"stop")
    finally:
        sock.close(0)
        context.term()
        server.wait(10)
    return rate, latencies, cpu
