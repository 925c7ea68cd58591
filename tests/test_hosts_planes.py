"""Supervision between hosts (network namespaces, draftfeed/bench/hosts.py) on both planes that cross machines: frames and
nixl (NIXL over UCX's tcp transport, as between machines without RDMA).

Broker, workers and ranks each on a host of their own. A rank binds its data socket on the interface that
routes to the broker; every batch must arrive once, in order, equal to the in-process computation, also when
the rank's host and then a worker's host are cut off longer than the liveness window and come back.
"""

from __future__ import annotations

import json

import pytest
from conftest import WORKER_ENV
from support.lines import wait_for_line

from draftfeed.bench.hosts import Hosts
from draftfeed.dataplane.nixl.transport import unavailable
from draftfeed.processes import commands

pytestmark = pytest.mark.timeout(300)
SERVICE = "svc"
LIVENESS = ["--heartbeat-interval", "0.2", "--liveness", "5"]  # a peer silent for 1 s is dead
UCX_TCP = {"UCX_TLS": "tcp"}  # between "hosts" as between machines: no shared memory
PLANES = ["frames", pytest.param("nixl", marks=pytest.mark.skipif(unavailable() is not None, reason=f"NIXL: {unavailable()}"))]


def start_rank(hosts: Hosts, broker: commands.Process, target, plane: str, *args: str) -> commands.Process:
    return commands.start(
        ["--broker", broker.ready["frontend"], "--service", SERVICE, "--target", str(target), "--data-plane", plane, *args],
        module="rank_process",
        env={**WORKER_ENV, **UCX_TCP},
        prefix=hosts.command("rank"),
    )


def start_workers(hosts: Hosts, broker: commands.Process, target, names, *flags: str) -> list[commands.Process]:
    return [
        commands.start_worker(
            broker.ready["backend"],
            str(target),
            "--service",
            SERVICE,
            "--name",
            name,
            "--nixl-min-bytes",
            "0",  # the tiny target's answers are small: nixl for all of them
            *flags,
            env={**WORKER_ENV, **UCX_TCP},
            prefix=hosts.command(name),
        )
        for name in names
    ]


def result_of(rank: commands.Process) -> dict:
    return json.loads(wait_for_line(rank, "^RESULT ", timeout_s=180)[len("RESULT ") :])


def show(started: list[commands.Process]) -> None:
    for process in started:  # shown by pytest when the test fails
        print(f"---- {' '.join(process.popen.args[-12:])}\n" + "\n".join(line for line in process.log_tail if not line.startswith("batch ")))


def check_result(result: dict, hosts: Hosts, plane: str, batches: int) -> None:
    assert result["error"] is None, result["error"]
    assert result["differences"] == [], "\n".join(result["differences"])
    assert result["received"] == result["sent"] == batches and result["in_order"]
    assert result["data_endpoint"].startswith(f"tcp://{hosts.address('rank')}:"), "bound on the interface towards the broker"
    if plane == "nixl":
        assert result["over_nixl"] >= batches // 2, f"only {result['over_nixl']} of {batches} came over nixl"
    else:
        assert result["over_nixl"] == 0


@pytest.mark.parametrize("task", ["eagle3", "dspark"])
def test_both_planes_cross_hosts_exact(hosts_available, tiny_target, task):
    with Hosts(["broker", "worker", "rank"]) as hosts:
        started: list[commands.Process] = []
        try:
            broker = commands.start_broker(hosts.address("broker"), prefix=hosts.command("broker"))
            started.append(broker)
            started += start_workers(hosts, broker, tiny_target, ["worker"], "--task", task)
            planes = ["frames"] if unavailable() is not None else ["frames", "nixl"]
            ranks = {plane: start_rank(hosts, broker, tiny_target, plane, "--task", task, "--batches", "24", "--seed", "100") for plane in planes}
            started += ranks.values()
            for plane, rank in ranks.items():
                check_result(result_of(rank), hosts, plane, 24)
        finally:
            for process in started:
                process.stop(timeout_s=5)
            show(started)


# The suite partitions the frames plane; NIXL's partition runs in make test-long (test_partition.py cuts NIXL's rank too).
@pytest.mark.parametrize("plane", [PLANES[0], pytest.param(PLANES[1], marks=pytest.mark.long)])
def test_rank_then_worker_partitioned_on_both_planes(hosts_available, tiny_target, plane):
    with Hosts(["broker", "worker-1", "worker-2", "rank"]) as hosts:
        started: list[commands.Process] = []
        try:
            broker = commands.start_broker(hosts.address("broker"), extra=LIVENESS, prefix=hosts.command("broker"))
            started.append(broker)
            started += start_workers(hosts, broker, tiny_target, ["worker-1", "worker-2"])
            rank = start_rank(hosts, broker, tiny_target, plane, "--batches", "100", "--draft-vocab", "300")
            started.append(rank)
            for host, after, forgotten in (
                ("rank", 30, f"forgot rank {rank.ready['rank']} .*silent for"),
                ("worker-1", 65, "forgot worker worker-1 .*silent for"),
            ):
                wait_for_line(rank, rf"^batch {after}$", timeout_s=120)
                mark = broker.lines_seen
                hosts.cut(host)
                try:
                    wait_for_line(broker, forgotten, timeout_s=30, after=mark)
                finally:
                    hosts.restore(host)
            check_result(result_of(rank), hosts, plane, 100)
        finally:
            for process in started:
                process.stop(timeout_s=5)
            show(started)
