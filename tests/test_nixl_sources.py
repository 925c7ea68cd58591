"""Where the worker writes a nixl answer from (dataplane/nixl/worker_writes.py): the choice as a pure function, and direct
writes from an answer's own tensors with real NIXL agents in this process: the bytes land at the layout's offsets,
memory shared by answers in flight is registered once and let go when the last write from it lands."""

from __future__ import annotations

import time

import pytest
import torch

from draftfeed.dataplane.nixl.layout import packed_layout
from draftfeed.dataplane.nixl.memory import Region
from draftfeed.dataplane.nixl.transport import NixlAgent, NixlError, unavailable
from draftfeed.dataplane.nixl.worker_writes import HOST_COPY_BYTES_PER_S, MEASURED_REGISTRATION_BYTES, NixlSender, choose_source
from draftfeed.dataplane.pair_group.transport import describe

needs_nixl = pytest.mark.skipif(unavailable() is not None, reason=f"NIXL: {unavailable()}")


def direct_bytes(sender) -> int:
    """Bytes of answers' own memory the sender holds registered now for writes in flight (or given up on)."""
    return sum(region.nbytes for region in sender._pinned)


def answer(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    probs = torch.rand(2, 7, 50, generator=generator)
    return {
        "aux_hidden_states": torch.randn(2, 7, 24, generator=generator).to(torch.bfloat16),
        "target_probs": probs.transpose(0, 1),  # not contiguous: sent from a contiguous copy
        "position_mask": torch.rand(2, 7, 1, generator=generator) > 0.5,
        "nothing": torch.zeros(0, dtype=torch.int64),  # empty: no region at all
    }


def test_host_memory_goes_direct_unless_registering_it_was_slower_than_a_copy():
    host = {"probs": torch.zeros(4, 4)}
    assert choose_source(host, None, 0)[0] == "direct"
    big = 2 * MEASURED_REGISTRATION_BYTES
    assert choose_source(host, big / HOST_COPY_BYTES_PER_S / 10, big)[0] == "direct"
    kind, why = choose_source(host, 0.1, big)  # 100 ms for 16.8 MB, where a copy takes 1.7 ms
    assert kind == "staged" and "16.8 MB of host memory took 100.00 ms, longer than copying it" in why, why
    assert choose_source(host, 0.1, MEASURED_REGISTRATION_BYTES - 1)[0] == "direct", "a small registration's time says nothing"


def test_device_memory_is_staged_and_the_reason_names_it():
    kind, why = choose_source({"probs": torch.zeros(4, 4, device="meta"), "mask": torch.zeros(4)}, None, 0)
    assert kind == "staged" and "meta memory" in why, why


@pytest.fixture
def agents():
    receiver = NixlAgent("test-sources-rank")
    sender = NixlSender("test-sources", torch.device("cpu"))
    yield receiver, sender
    sender.close()
    receiver.close()


def slot_of(receiver: NixlAgent, nbytes: int) -> tuple[torch.Tensor, Region]:
    memory = torch.full((nbytes,), 0xEE, dtype=torch.uint8)
    region = Region(memory.data_ptr(), nbytes)
    receiver.register(region)
    return memory, region


def landed(memory: torch.Tensor, tensors: dict[str, torch.Tensor]) -> None:
    """Each tensor's bytes are at its offset in the slot."""
    specs = describe(tensors)
    offsets, _total = packed_layout(specs)
    for (name, tensor), offset in zip(tensors.items(), offsets):
        expected = tensor.contiguous().reshape(-1).view(torch.uint8)
        got = memory[offset : offset + expected.numel()]
        assert torch.equal(got, expected), f"{name}: {(got != expected).sum().item()} of {expected.numel()} bytes differ at offset {offset}"


def write(sender: NixlSender, remote_agent: str, tensors: dict[str, torch.Tensor], slot: Region, note: bytes):
    offsets, total = packed_layout(describe(tensors))
    source = sender.prepare(tensors, offsets, total)
    assert source.kind == "direct"
    return sender.post(source, Region(slot.address, total), remote_agent, note, timeout_s=30, gone=lambda: False)


def notified(receiver: NixlAgent, count: int) -> list[bytes]:
    seen: list[bytes] = []
    deadline = time.monotonic() + 30
    while len(seen) < count:
        assert time.monotonic() < deadline, f"{len(seen)} of {count} notifications in 30 s"
        for messages in receiver.notifications().values():
            seen.extend(messages)
        time.sleep(1e-3)  # polling NIXL, as the rank's IO loop does
    return seen


@needs_nixl
def test_a_direct_write_lands_every_tensor_at_its_offset(agents):
    receiver, sender = agents
    tensors = answer(0)
    _offsets, total = packed_layout(describe(tensors))
    memory, slot = slot_of(receiver, total)
    remote = sender.connect(receiver.metadata())  # the metadata describes the slots registered before it
    pending = write(sender, remote, tensors, slot, b"one")
    pending.wait()
    assert notified(receiver, 1) == [b"one"]
    landed(memory, tensors)
    assert direct_bytes(sender) == 0, "its memory is let go once the write has landed"


@needs_nixl
def test_memory_two_writes_read_is_registered_once_and_kept_until_the_last_lands(agents):
    receiver, sender = agents
    shared = {"probs": torch.rand(64, 1000)}  # the same tensor in two answers, as a cached one would be
    _offsets, total = packed_layout(describe(shared))
    first_memory, first = slot_of(receiver, total)
    second_memory, second = slot_of(receiver, total)
    remote = sender.connect(receiver.metadata())
    first_write = write(sender, remote, shared, first, b"1")
    second_write = write(sender, remote, shared, second, b"2")
    assert direct_bytes(sender) == total, "registered once for both"
    first_write.wait()
    assert direct_bytes(sender) == total, "the second write still reads it"
    second_write.wait()
    assert direct_bytes(sender) == 0
    notified(receiver, 2)
    landed(first_memory, shared)
    landed(second_memory, shared)


@needs_nixl
def test_a_write_that_cannot_start_lets_its_memory_go(agents):
    receiver, sender = agents
    sender.connect(receiver.metadata())
    tensors = answer(1)
    offsets, total = packed_layout(describe(tensors))
    source = sender.prepare(tensors, offsets, total)
    with pytest.raises(NixlError, match="could not start"):
        sender.post(source, Region(1 << 40, total), "no-such-agent", b"x", timeout_s=30, gone=lambda: False)
    assert direct_bytes(sender) == 0


class FakeAgentRefusingItsSecondRegistration:
    """A stand-in for NIXL's agent (a registration cannot be made to fail on demand): it records what is registered
    and refuses the second registration."""

    def __init__(self) -> None:
        self.registered: list[Region] = []
        self.calls = 0

    def register(self, region: Region) -> None:
        self.calls += 1
        if self.calls == 2:
            raise NixlError("fake: registration refused")
        self.registered.append(region)

    def deregister(self, region: Region) -> None:
        self.registered.remove(region)


def test_a_registration_that_fails_midway_lets_go_of_the_ones_before_it():
    sender = NixlSender("test-sources", torch.device("cpu"))
    sender.agent = fake = FakeAgentRefusingItsSecondRegistration()  # type: ignore[assignment]
    tensors = answer(2)
    offsets, total = packed_layout(describe(tensors))
    with pytest.raises(NixlError, match="refused"):
        sender.prepare(tensors, offsets, total)
    assert fake.registered == [] and direct_bytes(sender) == 0, "no registration outlives the answer"
