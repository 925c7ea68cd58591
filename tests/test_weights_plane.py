"""The weights plane of ``publish_weights`` on its own, in this process: a publisher's socket (and NIXL agent) and a
worker's pull into a target's tensors, real ZeroMQ and real NIXL (UCX) agents. What lands equals what was published
bit for bit, whichever plane moved it; with NIXL offered, the socket carries the manifest and the agent's metadata
and no piece; a NIXL read that fails before any byte is written is pulled as frames instead; a wrong shape is refused
before any byte."""

from __future__ import annotations

import pytest
import torch

from draftfeed.dataplane.nixl.transport import unavailable
from draftfeed.dataplane.weights import publisher as publishing
from draftfeed.dataplane.weights.worker import UpdateRefused, pull_update
from draftfeed.schemas.frames import unpack
from draftfeed.schemas.messages import WEIGHTS_INBOUND

pytestmark = pytest.mark.timeout(60)
needs_nixl = pytest.mark.skipif(unavailable() is not None, reason=f"NIXL: {unavailable()}")
CHUNK = 4096
PIECES = 5  # a: 10240 bytes in 3 pieces, one each of b and d, none of c (empty)


def target_and_update() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A target's tensors (several dtypes, one of many pieces, one smaller than a piece, one empty) and an update of
    the same shapes with other values."""
    generator = torch.Generator().manual_seed(0)
    shapes = {
        "a.weight": ((64, 40), torch.float32),
        "b.weight": ((7,), torch.bfloat16),
        "c.bias": ((0,), torch.float32),
        "d.ids": ((33,), torch.int64),
    }
    target, update = {}, {}
    for name, (shape, dtype) in shapes.items():
        target[name] = torch.zeros(shape, dtype=dtype)
        update[name] = (torch.randn(shape, generator=generator) * 100).to(dtype)
    return target, update


class Pulls:
    """The pulls a publisher's socket answers, by kind (``what``), counted while the context is open."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.seen: dict[str, int] = {}
        answer = publishing.WeightsPublisher._answer

        def counted(publisher, peer, frames):
            what = unpack(frames, WEIGHTS_INBOUND)[0].what
            self.seen[what] = self.seen.get(what, 0) + 1
            answer(publisher, peer, frames)

        monkeypatch.setattr(publishing.WeightsPublisher, "_answer", counted)


def pull(update: dict[str, torch.Tensor], target: dict[str, torch.Tensor], nixl: bool, spoil=None) -> int:
    publisher = publishing.WeightsPublisher(update, "tcp://127.0.0.1:*", CHUNK, nixl=nixl)
    if spoil is not None:
        spoil(publisher)
    publisher.start()
    try:
        return pull_update(publisher.endpoint, 7, target, check_finite=True, timeout_s=20)
    finally:
        publisher.stop()
        publisher.join(10)


def assert_landed(target: dict[str, torch.Tensor], update: dict[str, torch.Tensor]) -> None:
    unequal = [name for name in update if not torch.equal(target[name], update[name])]
    assert unequal == [], f"tensors that differ from the published ones: {unequal}"


@pytest.mark.parametrize("nixl", [False, pytest.param(True, marks=needs_nixl)])
def test_every_piece_lands_bit_for_bit_as_frames_or_read_over_nixl_with_none_on_the_socket(nixl, monkeypatch):
    target, update = target_and_update()
    pulls = Pulls(monkeypatch)
    written = pull(update, target, nixl=nixl)
    assert written == sum(t.numel() * t.element_size() for t in update.values())
    assert_landed(target, update)
    assert (pulls.seen.get("piece", 0), pulls.seen.get("nixl", 0)) == ((0, 1) if nixl else (PIECES, 0)), pulls.seen


@needs_nixl
def test_a_nixl_read_that_fails_before_any_write_is_pulled_as_frames(monkeypatch, caplog):
    target, update = target_and_update()
    pulls = Pulls(monkeypatch)

    def unregistered(publisher):  # the manifest points the reads at memory the publisher's agent never registered
        publisher._nixl.regions = [region.model_copy(update={"address": region.address + (1 << 40)}) for region in publisher._nixl.regions]

    pull(update, target, nixl=True, spoil=unregistered)
    assert_landed(target, update)
    assert pulls.seen["nixl"] == 1 and pulls.seen["piece"] == PIECES, pulls.seen
    assert "NIXL failed before any byte was written" in caplog.text


@pytest.mark.parametrize("nixl", [False, pytest.param(True, marks=needs_nixl)])
def test_a_wrong_shape_is_refused_before_any_byte(nixl):
    target, update = target_and_update()
    update["a.weight"] = update["a.weight"][:, :39].contiguous()
    with pytest.raises(UpdateRefused, match=r"tensor a.weight: shape \[64, 39\], the target's is \[64, 40\]"):
        pull(update, target, nixl=nixl)
    assert all(not tensor.any() for tensor in target.values())


def test_an_encrypted_publisher_admits_only_the_workers_the_broker_names(tmp_path):
    """With keys, the publisher's socket is a CURVE server: a worker whose key it was given (the broker's
    ``worker_keys``) pulls bit for bit; a worker with another key, and a plaintext one, get nothing, and the update is
    refused before any byte."""
    from draftfeed.security.keys import generate_pair

    admitted, stranger, trainer = (generate_pair(tmp_path, name) for name in ("admitted", "stranger", "trainer"))
    target, update = target_and_update()
    publisher = publishing.WeightsPublisher(update, "tcp://127.0.0.1:*", CHUNK, keys=trainer)
    publisher.admit([admitted.public.decode()])
    publisher.start()
    try:
        for keys in [(stranger, trainer.public.decode()), None]:
            with pytest.raises(UpdateRefused, match="did not answer within 2 s"):
                pull_update(publisher.endpoint, 7, target, check_finite=True, timeout_s=2, keys=keys)
            assert all(not tensor.any() for tensor in target.values())
        pull_update(publisher.endpoint, 7, target, check_finite=True, timeout_s=20, keys=(admitted, trainer.public.decode()))
        assert_landed(target, update)
    finally:
        publisher.stop()
        publisher.join(10)


def test_a_gloo_pair_group_carries_every_piece_and_the_socket_none(monkeypatch):
    """``pair="gloo"`` (a worker process on the publisher's machine): the worker asks for a pair group of its own and
    receives every piece over it, bit for bit; the socket carries the manifest and the pair's address only."""
    target, update = target_and_update()
    pulls = Pulls(monkeypatch)
    publisher = publishing.WeightsPublisher(update, "tcp://127.0.0.1:*", CHUNK, pair="gloo", pair_timeout_s=20)
    publisher.start()
    try:
        assert pull_update(publisher.endpoint, 7, target, check_finite=True, timeout_s=20) == sum(
            t.numel() * t.element_size() for t in update.values()
        )
    finally:
        publisher.stop()
    assert_landed(target, update)
    assert pulls.seen.get("piece", 0) == 0 and pulls.seen["pair"] == 1, pulls.seen


def pull_with_a_gloo_pair(monkeypatch) -> tuple[dict[str, int], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The pulls a publisher offering a gloo pair answered, and the target and update (to compare)."""
    target, update = target_and_update()
    pulls = Pulls(monkeypatch)
    publisher = publishing.WeightsPublisher(update, "tcp://127.0.0.1:*", CHUNK, pair="gloo", pair_timeout_s=5)
    publisher.start()
    try:
        pull_update(publisher.endpoint, 7, target, check_finite=True, timeout_s=3)
    finally:
        publisher.stop()
    return pulls.seen, target, update


def test_a_pair_group_on_another_machine_is_not_asked_for(monkeypatch):
    """A publisher on another machine (its host id is not this one's) offers a pair: the worker pulls frames."""
    monkeypatch.setattr(publishing, "host_id", lambda: "another-machine")
    seen, target, update = pull_with_a_gloo_pair(monkeypatch)
    assert_landed(target, update)
    assert "pair" not in seen and seen["piece"] == PIECES, seen


def test_a_pair_group_that_cannot_be_built_leaves_the_update_to_frames(monkeypatch, caplog):
    """A pair the worker cannot join (the publisher's group waits under another namespace than it told): pulled as
    frames once the join has timed out, nothing written before, nothing lost."""
    from draftfeed.dataplane.weights import pair_pieces

    told = pair_pieces.PairSends.__init__

    def elsewhere(self, *args, **kwargs):
        told(self, *args, **kwargs)
        self.offer = self.offer.model_copy(update={"namespace": "0" * 32})

    monkeypatch.setattr(pair_pieces.PairSends, "__init__", elsewhere)
    seen, target, update = pull_with_a_gloo_pair(monkeypatch)
    assert_landed(target, update)
    assert seen["pair"] == 1 and seen["piece"] == PIECES, seen
    assert "no gloo pair group" in caplog.text


def test_which_pair_group_a_publisher_offers():
    """Host tensors: gloo only when asked (NIXL or frames move host memory as fast on one machine); never when refused.
    (NCCL, for GPU tensors, needs a GPU: benchmarks/gpu.py's machine.)"""
    from draftfeed.dataplane.weights.pair_pieces import pair_backend

    host = [torch.zeros(4)]
    assert [pair_backend(host, asked) for asked in (None, True, False)] == [None, "gloo", None]
