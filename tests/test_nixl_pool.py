"""The rank's NIXL receive pool as a policy (dataplane/nixl/rank_slots.py): its bound, reuse, quarantine and the release of
a slot with the last tensor over it. No NIXL here: registration is recorded by plain functions."""

from __future__ import annotations

import gc

import pytest
import torch
from support.clock import Clock

from draftfeed.dataplane.nixl.memory import HOST_ALIGNMENT, host_memory
from draftfeed.dataplane.nixl.rank_slots import PoolFull, ReceivePool
from draftfeed.schemas.messages import TensorSpec

KIB = 1 << 10


def pool(limit: int, clock: Clock | None = None) -> tuple[ReceivePool, list[int]]:
    registered: list[int] = []
    made = ReceivePool(
        torch.device("cpu"),
        limit,
        register=lambda region: registered.append(region.nbytes),
        deregister=lambda region: registered.remove(region.nbytes),
        quarantine_s=60.0,
        clock=clock or Clock(),
    )
    return made, registered


def fill(pool: ReceivePool, holder, nbytes: int, specs: list[TensorSpec]):
    slot = pool.grant(holder, nbytes)
    assert pool.filled(slot.index, holder) is slot
    return slot, pool.take(slot, specs)


SPECS = [TensorSpec(name="probs", dtype="float32", shape=[4, 100]), TensorSpec(name="mask", dtype="bool", shape=[4, 1])]


def test_a_slot_is_free_again_only_when_the_last_tensor_over_it_is_freed():
    receive, _ = pool(1 << 20)
    slot, tensors = fill(receive, ("w", 0, 1), 2000, SPECS)
    probs = tensors["probs"]
    del tensors
    gc.collect()
    assert slot.state == "taken", "a tensor still views it"
    second = receive.grant(("w", 0, 2), 2000)
    assert second.index != slot.index, "a viewed slot is never granted"
    del probs
    gc.collect()
    assert slot.state == "free"


def test_the_bound_holds_and_the_refusal_names_the_setting():
    receive, registered = pool(256 * KIB)
    held = [fill(receive, ("w", 0, i), 64 * KIB, [TensorSpec(name="x", dtype="uint8", shape=[64 * KIB])])[1] for i in range(4)]
    assert sum(registered) == 256 * KIB
    with pytest.raises(PoolFull, match=r"4 slots \(262144 bytes\) are still viewed .* nixl_pool_bytes=262144"):
        receive.grant(("w", 0, 9), 64 * KIB)
    with pytest.raises(PoolFull, match="larger than the whole receive pool"):
        receive.grant(("w", 0, 10), 512 * KIB)
    del held
    gc.collect()
    # Free slots of another size are released to make room for a bigger answer, within the bound.
    receive.grant(("w", 0, 11), 200 * KIB)
    assert sum(registered) <= 256 * KIB


def test_a_free_slot_is_reused_only_for_an_answer_it_fits_closely():
    receive, registered = pool(8 << 20)
    slot = receive.grant(("w", 0, 1), 1 << 20)
    receive.quarantine("w")  # granted, never written: not reusable yet
    assert receive.stats()["quarantined"] == 1
    other = receive.grant(("w", 0, 2), 1 << 20)
    assert other.index != slot.index
    assert receive.filled(other.index, ("w", 0, 2)) is other
    receive.quarantine("w")  # a filled slot was written: free at once
    assert receive.grant(("w", 0, 3), 900 * KIB).index == other.index, "within 5/4 of its size"
    assert receive.filled(other.index, ("w", 0, 3)) is other
    receive.quarantine("w")  # free again
    assert receive.grant(("w", 0, 4), 100 * KIB).index != other.index, "a 1 MiB slot is too big for a 100 KiB answer"
    assert len(registered) == 3


def test_quarantine_ends_after_its_time():
    clock = Clock()
    receive, _ = pool(1 << 20, clock)
    slot = receive.grant(("w", 3, 1), 64 * KIB)
    assert receive.quarantine("w", generation=3) == 1
    clock.now = 59.0
    assert receive.grant(("x", 0, 1), 64 * KIB).index != slot.index
    clock.now = 61.0
    assert receive.grant(("x", 0, 2), 64 * KIB).index == slot.index


def test_a_notification_for_another_holder_fills_nothing():
    receive, _ = pool(1 << 20)
    slot = receive.grant(("w", 0, 1), 64 * KIB)
    assert receive.filled(slot.index, ("w", 0, 2)) is None
    assert receive.filled(slot.index, ("v", 0, 1)) is None
    assert receive.granted_to(slot.index, "w", 1) is None
    assert receive.granted_to(slot.index, "w", 0) is slot


def test_host_slots_start_on_a_page_and_their_pages_are_already_there():
    """The rank's slots and the worker's arenas (host_memory) start on a page, as torch's tensors start on a 64-byte
    line: a copy between addresses that differ modulo 64 ran at 0.5-0.7 of the aligned rate. Their pages are written
    once when made, so a receive takes no page faults."""
    import resource

    receive, _ = pool(64 << 20)
    slots = [receive.grant(("w", 0, n), nbytes) for n, nbytes in enumerate([2000, 3 << 20, 5 << 20])]
    misaligned = {slot.index: slot.region.address % HOST_ALIGNMENT for slot in slots if slot.region.address % HOST_ALIGNMENT}
    assert not misaligned, f"slots not on a {HOST_ALIGNMENT}-byte boundary (slot: offset): {misaligned}"
    memory = host_memory(16 << 20)
    assert memory.ctypes.data % HOST_ALIGNMENT == 0 and memory.nbytes == 16 << 20 and not memory.any()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    memory[::4096] = 1  # one byte in every page
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    assert faults < 64, f"writing into made host memory took {faults} page faults for its {(16 << 20) // 4096} pages"
