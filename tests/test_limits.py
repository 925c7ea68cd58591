"""Size limits: per-service request limits at the broker, frame limits enforced by libzmq before allocation,
and each rank's limit on the answers it takes."""

from __future__ import annotations

import pytest
from conftest import Cluster, add_service, make_batch, raw_peer
from support.messages import errors

from draftfeed import RemoteEagle3Target, RemoteTargetError
from draftfeed.broker.settings import BrokerSettings
from draftfeed.broker.state import BrokerState
from draftfeed.schemas.frames import pack, unpack
from draftfeed.schemas.messages import FRONTEND_OUTBOUND, Hello, StatusQuery, StatusReply, Submit, TensorSpec

pytestmark = pytest.mark.timeout(240)


def test_a_request_over_its_services_limit_is_refused_with_the_flag_to_change():
    state = BrokerState("test", BrokerSettings(max_request_bytes=1 << 20, service_max_request_bytes={"small": 1000}))
    specs = [TensorSpec(name=name, dtype="int64", shape=[1, 200]) for name in ("input_ids", "attention_mask", "loss_mask")]
    frames = [bytes(1600)] * 3  # 4800 bytes of tensors: over 1000, under 1 MiB
    for service in ("small", "big"):
        state.on_hello(service.encode(), Hello(rank=service, service=service, data_endpoint="tcp://127.0.0.1:1", window=2, host="h", pid=1))
    refused = errors(state.on_submit(b"small", Submit(request_id=0, kind="eagle3", tensors=specs), frames))
    assert [e.code for e in refused] == ["refused"]
    assert "declares 4800 bytes of tensors, over the limit of service 'small' (1000 bytes)" in refused[0].message
    assert "--service-max-request-bytes small=BYTES" in refused[0].message
    assert errors(state.on_submit(b"big", Submit(request_id=0, kind="eagle3", tensors=specs), frames)) == []
    assert state.ranks[b"big"].outstanding == 1 and state.ranks[b"small"].outstanding == 0


def test_a_frame_over_the_brokers_limit_is_dropped_before_it_is_read():
    cluster = Cluster("--max-frame-bytes", str(1 << 20))
    try:
        query = pack(StatusQuery(request_id=1))
        with raw_peer(cluster.frontend) as greedy:
            greedy.send_multipart([*query, bytes(2 << 20)])
            assert not greedy.poll(1000), "libzmq disconnects the sender of an oversized frame; the broker never sees it"
        with raw_peer(cluster.frontend) as polite:
            polite.send_multipart(query)
            assert polite.poll(10_000)
            reply, _ = unpack(polite.recv_multipart(), FRONTEND_OUTBOUND)
            assert isinstance(reply, StatusReply) and reply.status["counters"]["rejected_messages"] == 0
    finally:
        cluster.stop()


@pytest.fixture(scope="module")
def services(cluster, tiny_target):
    return add_service(cluster, tiny_target, "lim")  # data plane auto: frames, or gloo when a rank asks for it


@pytest.mark.parametrize("data_plane", ["frames", "gloo"])
def test_an_answer_over_the_ranks_limit_fails_with_what_to_change(services, data_plane):
    batch = make_batch(2, 16, 1000, seed=0)
    with RemoteEagle3Target(services.frontend, "lim", max_result_bytes=10_000, data_plane=data_plane) as small:
        with pytest.raises(RemoteTargetError, match="over this rank's max_result_bytes of 10000: raise max_result_bytes"):
            small.generate_batch(**batch)
    with RemoteEagle3Target(services.frontend, "lim", data_plane=data_plane) as default:
        assert default.generate_batch(**batch).target_probs.shape == (2, 16, 1000)


def test_a_frame_over_the_workers_limit_from_a_rank_is_dropped_before_it_is_read():
    """A worker's link to a rank takes the rank's small control messages; a frame over --max-request-bytes makes
    libzmq drop the rank's connection before allocating it (here a raw ROUTER stands in for the rank)."""
    import zmq
    from conftest import raw_router, wait_until

    from draftfeed.dataplane.frames.worker import RankLinks, SendResult

    context = zmq.Context()
    links = RankLinks(context, max_frame_bytes=1 << 10)
    try:
        with raw_router() as (rank, endpoint):
            wait_until(lambda: links.try_send(endpoint, [b"hello"]) is SendResult.SENT, timeout_s=10, what="the link to connect")
            assert rank.poll(10_000)
            worker, _hello = rank.recv_multipart()
            rank.send_multipart([worker, bytes(512)])
            assert wait_until(links.incoming, timeout_s=10, what="a frame under the limit")[0][1][0].bytes == bytes(512)
            rank.send_multipart([worker, bytes(2 << 10)])
            rank.send_multipart([worker, b"after"])
            assert not links.incoming() and not links.socket(endpoint).poll(1000), "libzmq drops the sender of an oversized frame"
    finally:
        links.close()
        context.term()
