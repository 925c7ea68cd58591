"""A real worker process driven by a broker socket of the test's own: what it does with each dispatch."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from conftest import WORKER_ENV, make_batch, raw_router, reference_eagle3
from reference import difference, draft_vocab

from draftfeed.contract.vocab import mapping_digest
from draftfeed.dataplane.frames.codec import decode_tensors, encode_tensors, pack_tensors
from draftfeed.schemas.frames import pack, unpack
from draftfeed.schemas.messages import (
    BACKEND_INBOUND,
    DATA_INBOUND,
    Computing,
    Dispatch,
    Done,
    Failure,
    Liveness,
    Register,
    Registered,
    Result,
    Submit,
    VocabMapping,
    WorkerHeartbeat,
)
from draftfeed.schemas.protocol import SIGNATURE

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def harness(tiny_target):
    """A ROUTER standing in for the broker's backend, a ROUTER standing in for a rank's data socket, one real worker."""
    with raw_router() as (backend, backend_endpoint), raw_router() as (rank, rank_endpoint):
        worker = None
        try:
            # Started by hand: its ready line comes only after the registration this harness answers.
            worker = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "draftfeed.launch",
                    "worker",
                    "--broker",
                    backend_endpoint,
                    "--target",
                    str(tiny_target),
                    "--service",
                    "svc",
                    "--name",
                    "w0",
                ],
                env={**os.environ, **WORKER_ENV},
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            assert backend.poll(60_000), "the worker did not register"
            peer, *frames = backend.recv_multipart()
            register, _ = unpack(frames, BACKEND_INBOUND)
            assert isinstance(register, Register) and register.service == "svc" and register.info.aux_layer_ids == [1, 3, 4]
            # A long liveness period: this harness sends no heartbeats.
            backend.send_multipart([peer, *pack(Registered(broker="test", instance="test", liveness=Liveness(heartbeat_interval_s=1, liveness=100)))])
            yield backend, peer, rank, rank_endpoint
        finally:
            if worker is not None:
                worker.kill()
                worker.wait(10)


def dispatch(backend, peer, data_endpoint, ticket, tensors, service="svc"):
    specs, buffers = encode_tensors(tensors)
    message = Dispatch(
        ticket=ticket, rank="c", data_endpoint=data_endpoint, service=service, request=Submit(request_id=ticket, kind="eagle3", tensors=specs)
    )
    backend.send_multipart([peer, *pack(message, buffers)], copy=False)


def next_done(backend) -> Done:
    """The worker's next done, past its heartbeats and its word of what it computes."""
    while True:
        assert backend.poll(30_000), "no done reached the broker"
        message, _ = unpack(backend.recv_multipart()[1:], BACKEND_INBOUND)
        if isinstance(message, Done):
            return message
        assert isinstance(message, (WorkerHeartbeat, Computing))


def receive(rank, backend):
    assert rank.poll(30_000), "no answer reached the rank"
    _peer, *frames = rank.recv_multipart()
    answer, tensor_frames = unpack(frames, DATA_INBOUND)
    done = next_done(backend)
    assert done.ticket == answer.request_id
    return answer, tensor_frames, done


def test_worker_refuses_a_dispatch_for_another_service_and_serves_on(harness, tiny_model):
    backend, peer, rank, data_endpoint = harness
    batch = make_batch(2, 10, 1000, seed=2)
    dispatch(backend, peer, data_endpoint, 1, batch, service="someone-else")
    answer, _, done = receive(rank, backend)
    assert isinstance(answer, Failure) and "serves 'svc', not 'someone-else'" in answer.message and done.outcome == "failed"

    # Junk from the "broker" is ignored; the next real dispatch is served exactly.
    backend.send_multipart([peer, SIGNATURE, b"{garbage"])
    backend.send_multipart([peer, b"nonsense"])
    dispatch(backend, peer, data_endpoint, 2, batch)
    answer, tensor_frames, done = receive(rank, backend)
    assert isinstance(answer, Result) and done.outcome == "served"
    tensors = decode_tensors(answer.tensors, tensor_frames)
    expected = reference_eagle3(tiny_model, batch, [1, 3, 4])
    for name in ("aux_hidden_states", "target_probs", "position_mask", "input_ids", "loss_mask"):
        assert torch.equal(tensors[name], expected[name]), name


def test_a_request_naming_a_mapping_the_worker_lacks_goes_back_never_computed_without_it(harness, tiny_model):
    backend, peer, rank, data_endpoint = harness
    batch = make_batch(1, 5, 1000, seed=3)
    ids, mask = draft_vocab(50)
    digest = mapping_digest(ids, mask)
    specs, buffers = encode_tensors(batch)
    message = Dispatch(
        ticket=7,
        rank="c",
        data_endpoint=data_endpoint,
        service="svc",
        request=Submit(request_id=7, kind="eagle3", mapping_digest=digest, tensors=specs),
    )
    backend.send_multipart([peer, *pack(message, buffers)], copy=False)
    done = next_done(backend)
    assert done.ticket == 7 and done.outcome == "missing_mapping" and done.missing_mapping == digest
    mapping = pack_tensors(VocabMapping, {"selected_token_ids": ids, "selected_token_mask": mask}, digest=digest)
    backend.send_multipart([peer, *mapping], copy=False)
    backend.send_multipart([peer, *pack(message, buffers)], copy=False)
    answer, tensor_frames, done = receive(rank, backend)  # the first answer the rank gets: any earlier one would show here
    assert isinstance(answer, Result) and done.outcome == "served"
    tensors = decode_tensors(answer.tensors, tensor_frames)
    expected = reference_eagle3(tiny_model, batch, [1, 3, 4], ids, mask)
    for name in ("aux_hidden_states", "target_probs", "position_mask", "input_ids", "loss_mask"):
        assert difference(name, tensors[name], expected[name]) is None, difference(name, tensors[name], expected[name])


def test_frames_that_do_not_match_the_header_are_refused(harness):
    backend, peer, rank, data_endpoint = harness
    specs, buffers = encode_tensors(make_batch(1, 5, 1000, seed=3))
    message = Dispatch(ticket=3, rank="c", data_endpoint=data_endpoint, service="svc", request=Submit(request_id=3, kind="eagle3", tensors=specs))
    backend.send_multipart([peer, *pack(message, buffers[:2]), b"short"], copy=False)
    answer, _, _ = receive(rank, backend)
    assert isinstance(answer, Failure) and "needs 40 bytes but its frame holds 5" in answer.message
