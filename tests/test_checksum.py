"""Integrity end to end (a worker's ``--checksum``, draftfeed/dataplane/digests.py): each answer carries its tensors'
XXH3 digests, and a rank never uses an answer whose bytes changed on the way: it drops it and asks again.

Real broker and workers; the changed bytes come from a worker whose N-th answer has one byte flipped after its
digests were made (tests/fake_corruption.py, named as a fake: such a fault cannot be caused on demand), as one
message and as the first of its pieces.
"""

from __future__ import annotations

import pytest
import torch
from conftest import WORKER_ENV, assert_supervision_equal, make_batch, reference_eagle3

from draftfeed import RemoteEagle3Target
from draftfeed.dataplane.digests import StreamedDigests, digests, mismatch, tensor_digest
from draftfeed.processes import commands

pytestmark = pytest.mark.timeout(180)
AUX = [1, 3, 4]  # the tiny target's default EAGLE-3 layers


def corrupting_worker(cluster, target, service: str, *flags: str) -> commands.Process:
    worker = commands.start(
        ["worker", "--broker", cluster.backend, "--target", str(target), "--service", service, "--checksum", *flags],
        env={**WORKER_ENV, "FAKE_CORRUPT": "2"},
        module="fake_corruption",
    )
    cluster.workers.append(worker)
    return worker


@pytest.mark.parametrize("pieces", [False, True], ids=["one-message", "in-pieces"])
def test_an_answer_changed_on_its_way_is_asked_for_again_never_used(cluster, tiny_target, tiny_model, pieces):
    service = f"checksum-{'pieces' if pieces else 'whole'}"
    corrupting_worker(cluster, tiny_target, service, "--data-plane", "frames", *(["--transfer-chunk-bytes", "4096"] if pieces else []))
    batches = [make_batch(2, 24, 1000, seed=40 + index) for index in range(4)]
    with RemoteEagle3Target(cluster.frontend, service, prefetch_depth=2) as remote:
        for batch, supervision in remote.iterate(batches):
            assert_supervision_equal(supervision, reference_eagle3(tiny_model, batch, AUX))
        stats = remote.connection_stats
        assert stats.checksum_mismatches == 1 and stats.lost_over_pair == 1, stats
        assert (stats.received_in_pieces > 0) is pieces


def test_digests_are_the_bytes_as_sent_streamed_or_whole():
    tensors = {"h": torch.randn(3, 5, dtype=torch.float32).to(torch.bfloat16), "m": torch.tensor([[True, False]]), "e": torch.empty(0, 4)}
    sent = digests(tensors)
    assert all(len(digest) == 16 for digest in sent) and mismatch(tensors, sent) is None
    streamed = StreamedDigests(len(tensors))
    for number, tensor in enumerate(tensors.values()):
        raw = memoryview(tensor.contiguous().reshape(-1).view(torch.uint8).numpy())
        for start in range(0, raw.nbytes, 7):
            streamed.update(number, raw[start : start + 7])
    assert streamed.mismatch(list(tensors), sent) is None
    changed = dict(tensors, h=tensors["h"].clone())
    changed["h"][1, 2] += 1
    assert mismatch(changed, sent).startswith("h arrived with digest ")
    assert tensor_digest(tensors["h"].t()) != sent[0], "the digest is of the bytes in C order: a transposed view differs"
