"""The nixl data plane end to end on CPU: real NIXL (UCX) agents in real broker, worker and rank processes.

Supervision written by the worker into the rank's registered receive slots must equal frames and the
in-process computation bit for bit; slots the user's tensors view are never written again; faults fall back
to frames and the pair is rebuilt."""

from __future__ import annotations

import pytest
import torch
from conftest import Cluster, assert_supervision_equal, make_batch, reference_eagle3, wait_until

from draftfeed import RemoteEagle3Target
from draftfeed.dataplane.nixl_transport import unavailable

pytestmark = [
    pytest.mark.timeout(240),
    pytest.mark.skipif(unavailable() is not None, reason=f"NIXL: {unavailable()}"),
]
SERVICE = "nixl"
VOCAB = 1000


def pairs_of(cluster: Cluster, worker: str) -> dict[str, dict]:
    status = cluster.worker_status(worker)
    return {pair["rank"]: pair for pair in (status or {}).get("pairs", [])}


def nixl_ready(remote, cluster: Cluster, worker: str, model, aux) -> None:
    """Answers go as frames while the pair opens: ask until it is ready on both sides."""
    warm_up = make_batch(1, 8, VOCAB, seed=99)

    def ready() -> bool:
        assert_supervision_equal(remote.generate_batch(**warm_up), reference_eagle3(model, warm_up, aux))
        return remote.data_planes().get(worker, "").startswith("nixl") and pairs_of(cluster, worker).get(remote.rank_id, {}).get("state") == "ready"

    try:
        wait_until(ready, what="the nixl pair, ready on both sides")
    except AssertionError:
        print("\n".join(next(w for w in cluster.workers if w.ready.get("worker") == worker).log_tail))
        raise


def test_nixl_equals_frames_and_the_in_process_computation(tiny_target, tiny_model):
    cluster = Cluster()
    try:
        worker = cluster.add_worker(tiny_target, "--service", SERVICE, "--data-plane", "nixl")
        name = worker.ready["worker"]
        with (
            RemoteEagle3Target(cluster.frontend, SERVICE, data_plane="auto") as over_nixl,
            RemoteEagle3Target(cluster.frontend, SERVICE, data_plane="frames") as over_frames,
        ):
            aux = over_nixl.model_info().aux_layer_ids
            nixl_ready(over_nixl, cluster, name, tiny_model, aux)
            batches = [make_batch(3, 32, VOCAB, seed=seed) for seed in range(8)]
            before = over_nixl.connection_stats.received_over_nixl
            by_nixl = [s for _, s in over_nixl.iterate(batches)]
            by_frames = [s for _, s in over_frames.iterate(batches)]
            for batch, a, b in zip(batches, by_nixl, by_frames):
                assert_supervision_equal(a, reference_eagle3(tiny_model, batch, aux))
                for field, tensor in b.as_dict().items():
                    assert torch.equal(a.as_dict()[field], tensor), field
            assert over_nixl.connection_stats.received_over_nixl - before == len(batches)
            assert over_frames.connection_stats.received_over_nixl == 0
            pair = pairs_of(cluster, name)[over_nixl.rank_id]
            assert pair["plane"] == "nixl" and pair["state"] == "ready" and pair["reason"].startswith("the worker asked for nixl: both have NIXL, on one machine")
    finally:
        cluster.stop()
