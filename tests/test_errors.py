"""Requests a worker or the broker cannot serve: a clear error at the rank, and service goes on for everyone."""

from __future__ import annotations

import threading

import pytest
import torch
from conftest import WORKER_ENV, add_service, assert_supervision_equal, make_batch, raw_peer, reference_eagle3, wait_until

from draftfeed import RemoteEagle3Target, RemoteTargetError
from draftfeed.processes import commands
from draftfeed.schemas.frames import pack, unpack
from draftfeed.schemas.messages import FRONTEND_OUTBOUND, ErrorReply, StatusQuery, StatusReply
from draftfeed.schemas.protocol import SIGNATURE

pytestmark = pytest.mark.timeout(180)
SERVICE = "tiny-errors"


@pytest.fixture(scope="module")
def services(cluster, tiny_target):
    return add_service(cluster, tiny_target, SERVICE)


def _bad_batches():
    good = make_batch(2, 12, 1000, seed=5)
    yield "int32 ids", dict(good, input_ids=good["input_ids"].int()), r"input_ids must be int64, got torch.int32"
    yield "float mask", dict(good, loss_mask=good["loss_mask"].float()), r"loss_mask must be int64"
    yield "shapes", dict(good, attention_mask=good["attention_mask"][:, :5]), r"attention_mask has shape \[2, 5\] but input_ids has \[2, 12\]"
    yield "out of vocab", dict(good, input_ids=torch.full((2, 12), 1000)), r"token id 1000, outside the target's vocabulary \[0, 1000\)"
    yield "negative id", dict(good, input_ids=torch.full((2, 12), -3)), r"token id -3"
    yield "3-d", {k: v[None] for k, v in good.items()}, r"input_ids must be \[batch, sequence\]"
    yield "mask values", dict(good, attention_mask=good["attention_mask"] * 2), r"attention_mask must hold only 0 and 1"


@pytest.mark.parametrize("name, batch, match", list(_bad_batches()), ids=[case[0] for case in _bad_batches()])
def test_bad_batch_fails_with_clear_error_and_worker_keeps_serving(services, tiny_model, name, batch, match):
    with RemoteEagle3Target(services.frontend, SERVICE) as target:
        with pytest.raises(RemoteTargetError, match=match) as caught:
            target.generate_batch(**batch)
        assert f"worker {SERVICE}-0" in str(caught.value)
        good = make_batch(2, 12, 1000, seed=6)
        assert_supervision_equal(target.generate_batch(**good), reference_eagle3(tiny_model, good, [1, 3, 4]))


def test_a_service_no_worker_serves_is_named_at_once_with_what_the_broker_serves(services):
    served = rf"it serves {SERVICE} \(1 workers\)"
    with pytest.raises(RemoteTargetError, match=rf"no worker serves service 'no-such-service' at the broker at \S+: {served} \(wait_for_workers=0\)"):
        RemoteEagle3Target(services.frontend, "no-such-service", wait_for_workers=0)
    with pytest.raises(
        RemoteTargetError, match=rf"no worker of service 'no-such-service' registered at .* within 0.5 s \(wait_for_workers\): {served}"
    ):
        RemoteEagle3Target(services.frontend, "no-such-service", wait_for_workers=0.5)
    # The rank that asked for it is gone, and the service with it: no phantom service stays in status.
    wait_until(lambda: "no-such-service" not in services.status()["services"], what="the phantom service to go")


def test_a_worker_that_joins_during_the_wait_is_used(services, tiny_target, tiny_model):
    joined = threading.Thread(target=lambda: services.add_worker(tiny_target, "--service", "late-service"), daemon=True)
    joined.start()
    with RemoteEagle3Target(services.frontend, "late-service", wait_for_workers=120) as target:
        batch = make_batch(1, 8, 1000, seed=4)
        assert_supervision_equal(target.generate_batch(**batch), reference_eagle3(tiny_model, batch, [1, 3, 4]))
    joined.join(60)


@pytest.mark.parametrize(
    "ids, mask, match",
    [
        (torch.tensor([1, 2, 2]), None, "more than once"),
        (torch.tensor([1, 2, 1000]), None, "outside"),
        (torch.tensor([1, 2, 3]), torch.ones(1000, dtype=torch.bool), "True exactly at the ids"),
        (torch.tensor([1, 2, 3]), torch.zeros(999, dtype=torch.bool), r"bool \[1000\]"),
    ],
)
def test_invalid_vocab_mapping_is_refused_at_the_rank(services, ids, mask, match):
    if mask is None:
        mask = torch.zeros(1000, dtype=torch.bool)
        mask[ids.clamp(max=999)] = True
    with RemoteEagle3Target(services.frontend, SERVICE) as target, pytest.raises(ValueError, match=match):
        target.set_vocab_mapping(ids, mask)


def test_broker_answers_junk_with_an_error_and_serves_on(services, tiny_model):
    with raw_peer(services.frontend) as sock:
        for junk in ([b"GET / HTTP/1.1"], [SIGNATURE, b"{oops"], [b"draftfeed/9", b"{}"]):
            sock.send_multipart(junk)
            assert sock.poll(10_000), f"no answer to {junk!r}"
            reply, _ = unpack(sock.recv_multipart(), FRONTEND_OUTBOUND)
            assert isinstance(reply, ErrorReply) and reply.message.startswith("rejected by the broker")
        # A worker's message at the ranks' port is told which port to use.
        sock.send_multipart([SIGNATURE, b'{"type": "done", "ticket": 1, "outcome": "served"}'])
        assert sock.poll(10_000)
        reply, _ = unpack(sock.recv_multipart(), FRONTEND_OUTBOUND)
        assert reply.code == "wrong_port" and reply.message.startswith("this is the broker's rank port") and "--backend" in reply.message
        # Submitting before saying hello is refused with advice.
        sock.send_multipart([SIGNATURE, b'{"type": "submit", "request_id": 4, "kind": "eagle3"}'])
        assert sock.poll(10_000)
        reply, _ = unpack(sock.recv_multipart(), FRONTEND_OUTBOUND)
        assert isinstance(reply, ErrorReply) and reply.request_id == 4 and "hello" in reply.message
        sock.send_multipart(pack(StatusQuery(request_id=9)))
        assert sock.poll(10_000)
        assert isinstance(unpack(sock.recv_multipart(), FRONTEND_OUTBOUND)[0], StatusReply)
    batch = make_batch(1, 8, 1000, seed=1)
    with RemoteEagle3Target(services.frontend, SERVICE) as target:
        assert_supervision_equal(target.generate_batch(**batch), reference_eagle3(tiny_model, batch, [1, 3, 4]))


def test_shallow_target_needs_explicit_aux_layers(services, tmp_path):
    from draftfeed.tiny import build_tiny_target

    shallow = build_tiny_target(tmp_path / "shallow", num_hidden_layers=6)
    with pytest.raises(RuntimeError, match=r"default aux layer ids \[1, 2, 2\].*repeat a layer for a 6-layer target; pass --aux-layer-ids"):
        commands.start_worker(services.backend, str(shallow), "--service", "shallow", env=WORKER_ENV)
    with pytest.raises(RuntimeError, match=r"layer 6 does not exist in a 6-layer target"):
        commands.start_worker(services.backend, str(shallow), "--service", "shallow", "--aux-layer-ids", "0,2,6", env=WORKER_ENV)
