"""The parts of the speculators integration that need no speculators (draftfeed/integrations/speculators/samples.py
and schedule.py's Order): the layer mapping and its refusals, a row's request and sample, and the prefetch order's
recovery when the trainer asks out of the replayed order. The trainer itself: tests/test_speculators.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from draftfeed.integrations.speculators.samples import LayerMismatch, check_service, row_batch, service_layer_ids, to_sample
from draftfeed.integrations.speculators.schedule import Order, train_rows

VERIFIER = {"num_hidden_layers": 32, "hidden_size": 8, "vocab_size": 100}


def served(ids: list[int], **fields: int) -> SimpleNamespace:
    return SimpleNamespace(**{**VERIFIER, **fields}, target_layer_ids=ids)


def test_speculators_ids_are_served_by_the_dflash_layer_below_and_l_by_the_last():
    assert service_layer_ids([2, 16, 29], 32) == [1, 15, 28, 31]
    assert service_layer_ids([2, 16, 29, 32], 32) == [1, 15, 28, 31]  # L given explicitly: once
    assert service_layer_ids([], 48) == [47]  # MTP: L alone
    with pytest.raises(LayerMismatch, match=r"\[0\] have no DFlash layer: id 0 is the embeddings' output"):
        service_layer_ids([0, 5], 32)


def test_a_service_serving_other_layers_or_another_target_is_refused_naming_the_worker_flags():
    assert check_service([2, 16, 29], "s", served([1, 15, 28, 31]), VERIFIER) == [1, 15, 28, 31]
    with pytest.raises(LayerMismatch) as refused:
        check_service([2, 16, 30], "s", served([1, 15, 28, 31]), VERIFIER)
    assert str(refused.value) == (
        "service 's' serves DFlash layers [1, 15, 28, 31], and speculators' --target-layer-ids [2, 16, 30] need [1, 15, 29, 31]: "
        "start its workers with `--task dflash --target-layer-ids 1,15,29,31`"
    )
    with pytest.raises(LayerMismatch, match=r"serves another target than --verifier-name-or-path: hidden_size 16 \(the verifier's: 8\)"):
        check_service([2, 16, 29], "s", served([1, 15, 28, 31], hidden_size=16), VERIFIER)


def test_a_row_is_one_unpadded_request_and_its_supervision_one_sample():
    ids = torch.tensor([5, 6, 7], dtype=torch.int32)
    batch = row_batch(ids)
    assert batch["input_ids"].dtype == torch.int64 and batch["input_ids"].tolist() == [[5, 6, 7]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1]] and batch["loss_mask"].tolist() == [[1, 1, 1]]
    layers = [torch.randn(1, 3, 8) for _ in range(4)]
    sample = to_sample(torch.cat(layers, dim=-1), ids, 8)
    assert sample["hidden_states"].shape == (3, 4, 8) and sample["token_ids"].dtype == torch.int64
    for k, layer in enumerate(layers):
        assert torch.equal(sample["hidden_states"][:, k], layer[0]), k
    with pytest.raises(ValueError, match="is not one row of layers 8 wide"):
        to_sample(torch.randn(2, 3, 32), ids, 8)


def test_the_order_recovers_when_the_trainer_asks_elsewhere():
    order = Order([4, 1, 7, 3, 9, 2])
    assert order.after(4, 2) == [1, 7]
    assert order.after(1, 2) == [7, 3]
    assert order.after(9, 2) == [2] and order.lost == 0  # a skip ahead (a resumed epoch): found further on
    assert order.after(4, 3) == [1, 7, 3]  # from the start again (a new epoch of the same order)
    assert order.after(11, 2) == [] and order.lost == 1  # not in the order: asked alone, nothing prefetched
    assert order.after(7, 1) == [3]  # and found again
    assert train_rows(16, 0.75) == 12 and train_rows(10, 0.9) == 9
