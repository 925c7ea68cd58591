"""Supervision is finite or refused (docs/contract.md, "Finite supervision").

A real broker and a worker process whose engine (a fake, named as one: the hf engine with one bad element added on
marked batches) gives NaN in one batch and Inf in another: the rank's NonFiniteSupervision names the request, the
tensor, the row, the position and the layer; the worker counts both and serves on; with on_nonfinite="skip" an epoch
yields every other batch in order, a run resumed from a state taken after a skipped batch sees the rest once, and the
store records no non-finite batch. The check itself (contract/finite.py) is tested in process, with the slices it
reduces made small.
"""

from __future__ import annotations

import urllib.request

import pytest
import torch
from conftest import assert_supervision_equal, make_batch, reference_eagle3
from fake_engines import INF_AT, INF_MARKER, NAN_AT, NAN_MARKER
from support.metrics import metric
from torch.utils.data import Dataset
from torchdata.stateful_dataloader import StatefulDataLoader

import draftfeed.contract.finite as finite
from draftfeed import NonFiniteSupervision, RemoteEagle3Target, RemoteTargetError
from draftfeed.net import free_port

pytestmark = pytest.mark.timeout(180)
SERVICE = "nonfinite"
AUX = [1, 3, 4]  # the tiny target's default EAGLE-3 layers (8 layers)
HIDDEN = 64
BATCHES = 6
MARKED = {1: NAN_MARKER, 3: INF_MARKER}  # batch index -> the marker it starts with


def batch_of(index: int) -> dict[str, torch.Tensor]:
    batch = make_batch(2, 12, 1000, seed=300 + index)
    batch["input_ids"][0, 0] = MARKED.get(index, 11)
    return batch


class MarkedBatches(Dataset):
    """Batch i of the epoch (batch_size=None: the dataset's items are whole batches)."""

    def __len__(self) -> int:
        return BATCHES

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return batch_of(index)


def loader() -> StatefulDataLoader:
    return StatefulDataLoader(MarkedBatches(), batch_size=None)


@pytest.fixture(scope="module")
def http_port() -> int:
    return free_port()


@pytest.fixture(scope="module")
def served(cluster, tiny_target, http_port):
    cluster.add_worker(
        tiny_target, "--engine", "fake_engines:FakeNonFiniteEngine", "--service", SERVICE, "--name", "nonfinite-0", "--http-port", str(http_port)
    )
    return cluster


def test_a_nonfinite_batch_is_refused_in_one_line_and_the_worker_serves_on(served, tiny_model, http_port):
    with RemoteEagle3Target(served.frontend, SERVICE, prefetch_depth=0) as remote:
        with pytest.raises(NonFiniteSupervision) as nan:
            remote.generate_batch(**batch_of(1))
        good = batch_of(0)
        assert_supervision_equal(remote.generate_batch(**good), reference_eagle3(tiny_model, good, AUX))
        with pytest.raises(NonFiniteSupervision) as inf:
            remote.generate_batch(**batch_of(3))
    for error, value, (row, position, column), layer in ((nan, "nan", NAN_AT, AUX[1]), (inf, "inf", INF_AT, AUX[-1])):
        message = str(error.value)
        assert "\n" not in message and isinstance(error.value, RemoteTargetError), message
        assert f"aux_hidden_states holds {value} at row {row}, position {position} (layer {layer})" in message, message
        assert "request " in message and "it was not sent" in message, message
        width_before = AUX.index(layer) * HIDDEN
        assert (error.value.tensor, error.value.index, error.value.value, error.value.layer) == (
            "aux_hidden_states",
            (row, position, width_before + column),
            value,
            layer,
        )
    page = urllib.request.urlopen(f"http://127.0.0.1:{http_port}/metrics", timeout=10).read().decode()
    assert metric(page, "draftfeed_worker_nonfinite_total") == 2, page


def test_skipped_batches_leave_the_epoch_in_order_and_a_resumed_run_sees_the_rest_once(served, tiny_model, tmp_path):
    store = tmp_path / "store"
    kept = [index for index in range(BATCHES) if index not in MARKED]
    expected = {index: reference_eagle3(tiny_model, batch_of(index), AUX) for index in kept}
    with RemoteEagle3Target(served.frontend, SERVICE, prefetch_depth=2, on_nonfinite="skip", store=str(store), store_mode="record") as remote:
        epoch = remote.iterate(loader())
        seen = []
        for batch, supervision in epoch:
            index = [i for i in range(BATCHES) if torch.equal(batch["input_ids"], batch_of(i)["input_ids"])][0]
            assert_supervision_equal(supervision, expected[index])
            seen.append(index)
            if index == 2:  # after the skipped batch 1
                state = epoch.state_dict()
        assert seen == kept, seen
        assert epoch.batches_skipped == len(MARKED) and state["batches_skipped"] == 1
        epoch.state_dict()  # the store writes what it recorded
        recorded = remote.status()["store"]["batches"]
    assert recorded == len(kept), "the store records only finite batches"
    with RemoteEagle3Target(served.frontend, SERVICE, prefetch_depth=2, on_nonfinite="skip") as remote:
        resumed = remote.iterate(loader())
        resumed.load_state_dict(state)
        rest = [int(batch["input_ids"][0, 1]) for batch, _supervision in resumed]
    assert rest == [int(batch_of(index)["input_ids"][0, 1]) for index in (4, 5)], rest
    assert resumed.batches_skipped == len(MARKED)


def test_the_check_finds_the_first_bad_element_slice_by_slice(monkeypatch):
    monkeypatch.setattr(finite, "CHECK_ELEMENTS", 7)  # many slices, a bad element far into one
    hidden = torch.zeros(2, 5, 3 * 4, dtype=torch.bfloat16)
    assert finite.first_nonfinite({"h": hidden, "ids": torch.ones(2, 5, dtype=torch.long)}) is None
    hidden[1, 3, 9] = float("-inf")
    hidden[1, 4, 0] = float("nan")
    found = finite.first_nonfinite({"ok": torch.ones(3), "h": hidden}, layers={"h": [2, 5, 7]}, hidden_size=4)
    assert found == finite.NonFinite(tensor="h", index=(1, 3, 9), value="-inf", layer=7), found
    assert found.describe() == "h holds -inf at row 1, position 3 (layer 7)"
    strided = hidden.transpose(0, 1)  # not contiguous: checked row by row, in place
    assert finite.first_nonfinite({"t": strided}).index == (3, 1, 9)
