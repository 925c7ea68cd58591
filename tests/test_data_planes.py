"""Data planes end to end on CPU: pair groups through gloo (the real torch.distributed path), frames, the choice
between them, and the faults a pair group must survive. Real broker, worker and rank processes throughout."""

from __future__ import annotations

import itertools
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import WORKER_ENV, Cluster, assert_supervision_equal, make_batch, reference_eagle3, run_concurrently, wait_until
from fake_pair_faults import EXIT_CODE
from support.planes import VOCAB, add_faulty_worker, check_batches, pairs_of

from draftfeed import RemoteEagle3Target
from draftfeed.dataplane.choice import choose_plane, host_id, local_offer
from draftfeed.dataplane.nixl.transport import unavailable
from draftfeed.schemas.messages import DataPlaneOffer

pytestmark = pytest.mark.timeout(240)
SERVICE = "planes"
RANK_SCRIPT = str(Path(__file__).parent / "pair_rank.py")


# ---------------------------------------------------------------- the choice
def offer(mode="auto", host="boot-a", device="cuda:0", gpu="GPU-0", nccl=True, nixl=False, network="", encrypted=False) -> DataPlaneOffer:
    return DataPlaneOffer(
        mode=mode, host_id=host, hostname=f"name-of-{host}", device=device, gpu_uuid=gpu, nccl=nccl, nixl=nixl, network=network, encrypted=encrypted
    )


CPU = {"device": "cpu", "gpu": None, "nccl": False}


@pytest.mark.parametrize(
    ("worker", "rank", "plane", "reason"),
    [
        (offer(), offer(device="cuda:1", gpu="GPU-1"), "nccl", "auto: both on one machine with CUDA"),
        (offer(), offer(host="boot-b", gpu="GPU-1"), "frames", "another machine"),
        (offer(), offer(device="cpu", gpu=None), "frames", "rank's supervision is on cpu"),
        (offer(device="cpu", gpu=None), offer(gpu="GPU-1"), "frames", "worker's supervision is on cpu"),
        (offer(), offer(gpu="GPU-1", nccl=False), "frames", "rank has no NCCL"),
        (offer(), offer(), "frames", "share one GPU"),
        (offer(mode="frames"), offer(gpu="GPU-1"), "frames", "worker asks for frames"),
        (offer(), offer(mode="frames", gpu="GPU-1"), "frames", "rank asks for frames"),
        (offer(mode="gloo", device="cpu", gpu=None), offer(host="boot-b", device="cpu", gpu=None), "gloo", "worker asked for gloo"),
        (offer(), offer(mode="gloo", gpu="GPU-1"), "gloo", "rank asked for gloo"),
        (offer(mode="nccl"), offer(mode="gloo", gpu="GPU-1"), "frames", "worker asks for nccl and the rank for gloo"),
        (offer(mode="nccl"), offer(host="boot-b", gpu="GPU-1"), "nccl", "worker asked for nccl"),
        (offer(mode="nccl", device="cpu", gpu=None), offer(gpu="GPU-1"), "frames", "asked for nccl, but the worker's supervision is on cpu"),
        (offer(), None, "frames", "no data plane but frames"),
        # NIXL: wherever both sides have it, unless NCCL serves the pair better or --secure keeps frames between machines.
        (offer(**CPU, nixl=True), offer(**CPU, nixl=True), "nixl", "auto: both have NIXL, on one machine (worker cpu, rank cpu)"),
        (offer(**CPU, nixl=True), offer(host="boot-b", **CPU, nixl=True), "nixl", "on name-of-boot-a and name-of-boot-b"),
        (offer(nixl=True), offer(device="cuda:1", gpu="GPU-1", nixl=True), "nccl", "auto: both on one machine with CUDA"),
        (offer(nixl=True), offer(nixl=True), "nixl", "auto: both have NIXL"),  # one GPU: NCCL refuses, NIXL does not
        (offer(**CPU, nixl=True), offer(**CPU), "frames", "the rank has no NIXL (pip install 'draftfeed[nixl]')"),
        (offer(**CPU, nixl=True), offer(host="boot-b", **CPU, nixl=True, encrypted=True), "frames", "auto under --secure between machines"),
        (offer(**CPU, nixl=True, encrypted=True), offer(**CPU, nixl=True, encrypted=True), "nixl", "auto: both have NIXL, on one machine"),
        (offer(mode="nixl", **CPU, nixl=True), offer(host="boot-b", **CPU, nixl=True, encrypted=True), "nixl", "the worker asked for nixl"),
        (offer(mode="nixl", **CPU, nixl=True), offer(**CPU), "frames", "the worker asked for nixl, but the rank has no NIXL"),
        (offer(mode="nixl", **CPU, nixl=True), offer(mode="gloo", **CPU), "frames", "the worker asks for nixl and the rank for gloo"),
        # Network namespaces of one machine (containers, or draftfeed/bench/hosts.py) share its boot id: one machine, said so.
        (
            offer(**CPU, nixl=True, network="net:[1]"),
            offer(**CPU, nixl=True, network="net:[2]"),
            "nixl",
            "on one machine, in separate network namespaces",
        ),
        (
            offer(network="net:[1]"),
            offer(device="cuda:1", gpu="GPU-1", network="net:[2]"),
            "nccl",
            "both on one machine, in separate network namespaces with CUDA",
        ),
    ],
)
def test_the_plane_and_its_reason(worker, rank, plane, reason):
    choice = choose_plane(worker, rank)
    assert choice.plane == plane
    assert reason in choice.reason
    forced = {worker.mode, rank.mode if rank else "auto"} - {"auto", "frames"}
    assert choice.refused == (bool(forced) and plane == "frames" and "asks for frames" not in reason)


def test_local_offer_on_this_machine_and_bad_modes():
    mine = local_offer("auto", None)
    assert mine.host_id == host_id() and mine.device == "cpu" and mine.gpu_uuid is None
    if Path("/proc/sys/kernel/random/boot_id").exists():
        assert mine.host_id == Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    assert mine.nixl == (unavailable() is None) and mine.network == os.readlink("/proc/self/ns/net")
    assert choose_plane(local_offer("auto", "cpu"), local_offer("auto", "cpu")).plane == ("nixl" if mine.nixl else "frames")
    with pytest.raises(ValueError, match="'carrier-pigeon' is not one of auto, frames, nccl, gloo, nixl"):
        local_offer("carrier-pigeon", None)
    with pytest.raises(ValueError, match="RemoteEagle3Target: data_plane='nvlink': input should be 'auto', 'frames', 'nccl', 'gloo' or 'nixl'"):
        RemoteEagle3Target("tcp://127.0.0.1:1", SERVICE, data_plane="nvlink", connect_timeout=1)


# ---------------------------------------------------------------- end to end
def test_gloo_pair_equals_frames_and_the_in_process_computation(tiny_target, tiny_model):
    cluster = Cluster()
    try:
        worker = cluster.add_worker(tiny_target, "--service", SERVICE, "--data-plane", "gloo")
        name = worker.ready["worker"]
        seeds = list(range(6))
        with (
            RemoteEagle3Target(cluster.frontend, SERVICE, data_plane="auto") as over_pair,
            RemoteEagle3Target(cluster.frontend, SERVICE, data_plane="frames") as over_frames,
        ):
            aux = over_pair.model_info().aux_layer_ids
            batches = [make_batch(3, 32, VOCAB, seed=seed) for seed in seeds]
            # Answers go as frames while the group is built (the worker opens it and checks on it as it answers);
            # once it is ready on both sides, every answer goes on it.
            warm_up = make_batch(1, 8, VOCAB, seed=99)

            def group_ready() -> bool:
                assert_supervision_equal(over_pair.generate_batch(**warm_up), reference_eagle3(tiny_model, warm_up, aux))
                worker_side = pairs_of(cluster, name).get(over_pair.rank_id, {}).get("state")
                return over_pair.data_planes() == {name: "gloo 0"} and worker_side == "ready"

            wait_until(group_ready, what="the pair group, ready on both sides")
            received_before = over_pair.connection_stats.received_over_pair
            pair_answers = [s for _, s in over_pair.iterate(batches)]
            frame_answers = [s for _, s in over_frames.iterate(batches)]
            for batch, by_pair, by_frames in zip(batches, pair_answers, frame_answers):
                assert_supervision_equal(by_pair, reference_eagle3(tiny_model, batch, aux))
                for field, tensor in by_frames.as_dict().items():
                    assert torch.equal(by_pair.as_dict()[field], tensor), field
            assert over_pair.connection_stats.received_over_pair - received_before == len(seeds)
            assert over_frames.connection_stats.received_over_pair == 0
            assert over_pair.data_planes() == {name: "gloo 0"} and over_frames.data_planes() == {}
            # The rendezvous store lived only until the group was built: nothing listens on its port now.
            store_port = over_pair.pair_group(name).store_port
            with pytest.raises(ConnectionRefusedError):
                socket.create_connection(("127.0.0.1", store_port), timeout=5).close()
            pairs = wait_until(lambda: (p := pairs_of(cluster, name)) and len(p) == 2 and p, what="both pairs in status")
            assert pairs[over_pair.rank_id]["plane"] == "gloo" and pairs[over_pair.rank_id]["state"] == "ready"
            assert pairs[over_pair.rank_id]["reason"] == "the worker asked for gloo"
            assert pairs[over_frames.rank_id]["plane"] == "frames" and pairs[over_frames.rank_id]["reason"] == "the rank asks for frames"
            text = subprocess.run(
                [sys.executable, "-m", "draftfeed", "status", "--broker", cluster.frontend], capture_output=True, text=True, timeout=60, check=True
            ).stdout
            assert f"to rank {over_pair.rank_id}: gloo (ready generation 0)" in text
    finally:
        cluster.stop()


def test_two_ranks_two_workers_mixed_planes(tiny_target, tiny_model):
    cluster = Cluster()
    ranks: dict[str, RemoteEagle3Target] = {}
    try:
        gloo_worker = cluster.add_worker(tiny_target, "--service", SERVICE, "--data-plane", "gloo", "--name", "w-gloo")
        cluster.add_worker(tiny_target, "--service", SERVICE, "--data-plane", "auto", "--name", "w-auto")
        ranks["auto"] = RemoteEagle3Target(cluster.frontend, SERVICE, data_plane="auto")
        ranks["frames"] = RemoteEagle3Target(cluster.frontend, SERVICE, data_plane="frames")
        run_concurrently(
            *(
                lambda remote=remote, first=100 * i: check_batches(remote, tiny_model, list(range(first, first + 10)))
                for i, remote in enumerate(ranks.values())
            )
        )
        # Which worker serves which batch is the broker's choice: go on until the gloo worker has used its group.
        seed = itertools.count(1000)  # as many as the waits below take
        wait_until(
            lambda: check_batches(ranks["auto"], tiny_model, [next(seed)]) and ranks["auto"].connection_stats.received_over_pair > 0,
            timeout_s=60,
            what="an answer on the gloo group",
            poll_s=0,
        )
        assert ranks["frames"].connection_stats.received_over_pair == 0

        def four_pairs():
            """Each worker's pairs with both ranks; more batches until each worker has served each rank."""
            gloo, auto = pairs_of(cluster, "w-gloo"), pairs_of(cluster, "w-auto")
            if len(gloo) == 2 and len(auto) == 2:
                return gloo, auto
            # Three batches a round, not two: between idle workers the broker alternates (ties go to the one that waited
            # longest), so one batch of each rank in turn would give each rank the same worker every time.
            for remote in (ranks["auto"], ranks["frames"], ranks["auto"]):
                check_batches(remote, tiny_model, [next(seed)])
            return None

        planes = wait_until(four_pairs, timeout_s=60, what="four pairs in status")
        by_gloo, by_auto = planes
        assert by_gloo[ranks["auto"].rank_id]["plane"] == "gloo"
        assert by_gloo[ranks["frames"].rank_id]["plane"] == "frames"
        if unavailable() is None:  # auto between CPU processes: NIXL where both have it
            assert by_auto[ranks["auto"].rank_id]["plane"] == "nixl"
        else:
            assert by_auto[ranks["auto"].rank_id]["plane"] == "frames"
            assert "supervision is on cpu" in by_auto[ranks["auto"].rank_id]["reason"]
        assert gloo_worker.popen.poll() is None
    finally:
        for remote in ranks.values():
            remote.close()
        cluster.stop()


# ---------------------------------------------------------------- faults
def test_a_forced_send_failure_falls_back_to_frames_and_the_group_is_rebuilt(fast_cluster, tiny_target, tiny_model):
    worker = add_faulty_worker(fast_cluster, tiny_target, "fail:2", "--service", SERVICE, "--data-plane", "gloo", "--name", "w-flaky")
    with RemoteEagle3Target(fast_cluster.frontend, SERVICE, data_plane="gloo") as remote:
        check_batches(remote, tiny_model, list(range(6)))
        pair = wait_until(lambda: pairs_of(fast_cluster, "w-flaky").get(remote.rank_id, {}).get("fallbacks"), what="the fallback in status")
        assert pair == 1
        # After the backoff the worker opens generation 1; every answer meanwhile is still right.
        seed = iter(range(100, 200))

        def rebuilt() -> bool:
            check_batches(remote, tiny_model, [next(seed)])
            worker_side = pairs_of(fast_cluster, "w-flaky").get(remote.rank_id, {})
            return remote.data_planes().get("w-flaky") == "gloo 1" and worker_side.get("state") == "ready" and worker_side.get("generation") == 1

        wait_until(rebuilt, timeout_s=60, what="a new group, ready on both sides", poll_s=0.2)
        before = remote.connection_stats.received_over_pair
        check_batches(remote, tiny_model, list(range(200, 204)))
        assert remote.connection_stats.received_over_pair == before + 4, "the rebuilt group carries the answers"
        assert remote.connection_stats.duplicates_dropped <= 1
    assert worker.popen.poll() is None


def test_a_worker_killed_mid_send_loses_nothing(fast_cluster, tiny_target, tiny_model):
    doomed = add_faulty_worker(fast_cluster, tiny_target, "exit:3", "--service", SERVICE, "--data-plane", "gloo", "--name", "w-doomed")
    with RemoteEagle3Target(fast_cluster.frontend, SERVICE, data_plane="gloo", prefetch_depth=2) as remote:
        remote.model_info()
        fast_cluster.add_worker(tiny_target, "--service", SERVICE, "--data-plane", "gloo", "--name", "w-healthy")
        check_batches(remote, tiny_model, list(range(12)))
        assert doomed.popen.wait(timeout=30) == EXIT_CODE, "the fault killed the worker in the middle of a send"
        assert remote.connection_stats.lost_over_pair >= 1, "the half-received answer was asked for again"
        wait_until(lambda: "w-doomed" not in remote.data_planes(), timeout_s=10, what="the dead worker's group released")
        check_batches(remote, tiny_model, list(range(12, 16)))


def test_an_idle_group_is_released_when_the_broker_reports_its_worker_gone(fast_cluster, tiny_target, tiny_model):
    """The rank's receiving thread waits on its queue, not on the group, so only worker_gone can release it."""
    worker = fast_cluster.add_worker(tiny_target, "--service", SERVICE, "--data-plane", "gloo", "--name", "w-idle")
    with RemoteEagle3Target(fast_cluster.frontend, SERVICE, data_plane="gloo") as remote:
        check_batches(remote, tiny_model, list(range(4)))
        assert remote.data_planes() == {"w-idle": "gloo 0"}
        worker.kill()
        wait_until(lambda: remote.data_planes() == {}, timeout_s=10, what="the idle group released")
        assert remote.connection_stats.lost_over_pair == 0, "nothing was in flight on it"


def test_a_killed_rank_releases_the_workers_group_and_others_are_served(fast_cluster, tiny_target, tiny_model):
    fast_cluster.add_worker(tiny_target, "--service", SERVICE, "--data-plane", "gloo", "--name", "w-survivor")
    rank = subprocess.Popen(
        [sys.executable, RANK_SCRIPT, fast_cluster.frontend, SERVICE, "gloo"], stdout=subprocess.PIPE, text=True, env={**os.environ, **WORKER_ENV}
    )
    try:
        assert rank.stdout is not None
        rank_name = rank.stdout.readline().split()[-1]
        for line in rank.stdout:
            if line.startswith("BATCH 3"):
                break
        wait_until(lambda: pairs_of(fast_cluster, "w-survivor").get(rank_name, {}).get("state") == "ready", what="the rank's group ready")
        rank.kill()
        rank.wait(timeout=10)
        # The broker finds the rank dead within its liveness window (1.6 s here) and the worker drops its group.
        wait_until(lambda: rank_name not in pairs_of(fast_cluster, "w-survivor"), timeout_s=15, what="the dead rank's group released")
        with RemoteEagle3Target(fast_cluster.frontend, SERVICE, data_plane="gloo") as remote:
            check_batches(remote, tiny_model, list(range(8)))
            # Answers go as frames while the new group opens (seconds, under load): on until one came over it.
            seed = itertools.count(100)
            wait_until(
                lambda: check_batches(remote, tiny_model, [next(seed)]) and remote.connection_stats.received_over_pair > 0,
                timeout_s=60,
                what="an answer on the new rank's gloo group",
                poll_s=0,
            )
    finally:
        rank.kill()
        rank.wait(timeout=10)
