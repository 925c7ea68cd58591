"""End to end through real broker and worker processes: supervision equals the in-process computation bit for bit."""

from __future__ import annotations

import pytest
import torch
from conftest import add_service, assert_supervision_equal, make_batch, reference_eagle3, run_concurrently
from reference import draft_vocab

from draftfeed import RemoteEagle3Target

pytestmark = pytest.mark.timeout(180)

DEFAULT = "tiny-default"
OTHER_AUX = "tiny-aux"


@pytest.fixture(scope="module")
def services(cluster, tiny_target):
    add_service(cluster, tiny_target, DEFAULT, workers=2)
    return add_service(cluster, tiny_target, OTHER_AUX, "--aux-layer-ids", "0,5,7")


def test_model_info_and_embeddings(services, tiny_model):
    with RemoteEagle3Target(services.frontend, DEFAULT) as target:
        info = target.model_info()
        assert (info.num_hidden_layers, info.hidden_size, info.vocab_size, info.aux_layer_ids) == (8, 64, 1000, [1, 3, 4])
        assert info["hidden_size"] == 64
        weight = target.get_input_embeddings().weight
        assert torch.equal(weight, tiny_model.get_input_embeddings().weight)
        assert target.get_input_embeddings().weight is weight  # fetched once


@pytest.mark.parametrize("batch_size, seq_len, ragged", [(1, 33, False), (4, 40, True)], ids=["B1", "B4-ragged"])
def test_identity_vocab_matches_in_process(services, tiny_model, batch_size, seq_len, ragged):
    batch = make_batch(batch_size, seq_len, 1000, seed=batch_size, ragged=ragged)
    with RemoteEagle3Target(services.frontend, DEFAULT) as target:
        supervision = target.generate_batch(**batch)
    assert_supervision_equal(supervision, reference_eagle3(tiny_model, batch, [1, 3, 4]))
    assert supervision.target_probs.shape == (batch_size, seq_len, 1000)


def test_draft_vocab_matches_in_process(services, tiny_model):
    ids, mask = draft_vocab(97, seed=3)
    batches = [make_batch(3, 29, 1000, seed=s) for s in range(5)]
    with RemoteEagle3Target(services.frontend, DEFAULT, prefetch_depth=2) as target:
        target.set_vocab_mapping(ids, mask)
        results = list(target.iterate(batches))
    assert [batch for batch, _ in results] == batches  # the same objects, in order
    for batch, supervision in results:
        assert supervision.target_probs.shape == (3, 29, 97)
        assert_supervision_equal(supervision, reference_eagle3(tiny_model, batch, [1, 3, 4], ids, mask))


def test_other_aux_layers_on_a_second_service(services, tiny_model):
    batch = make_batch(2, 24, 1000, seed=11)
    ids, mask = draft_vocab(50, seed=3)
    with RemoteEagle3Target(services.frontend, OTHER_AUX) as target:
        assert target.model_info().aux_layer_ids == [0, 5, 7]
        target.set_vocab_mapping(ids, mask)
        future = target.generate_batch_async(**batch)
        supervision = future.result(timeout=60)
    assert_supervision_equal(supervision, reference_eagle3(tiny_model, batch, [0, 5, 7], ids, mask))


def test_two_ranks_two_workers_each_rank_gets_its_own_batches_once_in_order(services, tiny_model):
    """Each rank sends distinct batches; every result is checked against the reference of the batch it is paired with."""
    per_rank = 12
    outcome: dict[int, list] = {}

    def rank(index: int) -> None:
        batches = [dict(make_batch(2, 16, 1000, seed=1000 * index + i), seq=i) for i in range(per_rank)]
        with RemoteEagle3Target(services.frontend, DEFAULT, prefetch_depth=3) as target:
            outcome[index] = [(b["seq"], b, s) for b, s in target.iterate(batches)]

    run_concurrently(lambda: rank(0), lambda: rank(1), timeout_s=150)
    for index in range(2):
        assert [seq for seq, _, _ in outcome[index]] == list(range(per_rank))
        for _, batch, supervision in outcome[index]:
            plain = {k: batch[k] for k in ("input_ids", "attention_mask", "loss_mask")}
            assert_supervision_equal(supervision, reference_eagle3(tiny_model, plain, [1, 3, 4]))
    with RemoteEagle3Target(services.frontend, DEFAULT) as target:
        workers = target.status()["services"][DEFAULT]["workers"]
    assert all(w["served"] > 0 for w in workers), "both workers should have served batches"
