"""ResumableIteration in process, with futures resolved at once: a state taken after any batch (or before the first)
and restored on a fresh dataloader gives the rest of an uninterrupted epoch, in order, the batches that were in
flight asked for again; usage errors are one line; a store's recorder writes what it holds when the state is taken."""

from __future__ import annotations

import io
from concurrent.futures import Future

import pytest
import torch
from torch.utils.data import DataLoader, Dataset
from torchdata.stateful_dataloader import StatefulDataLoader

from draftfeed.producers.resumable import ResumableIteration
from draftfeed.store.identity import StoreIdentity
from draftfeed.store.index import IndexFile
from draftfeed.store.store import SupervisionStore

pytestmark = [pytest.mark.timeout(120), pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")]
ROWS = 20  # 10 batches of 2
DEPTH = 4


class Rows(Dataset):
    """Row i is a token row whose every id is i: a batch's identity is its first column."""

    def __len__(self) -> int:
        return ROWS

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": torch.full((4,), index), "attention_mask": torch.ones(4, dtype=torch.long)}


def loader(shuffle: bool = False, num_workers: int = 0, stateful: bool = True):
    cls = StatefulDataLoader if stateful else DataLoader
    generator = torch.Generator().manual_seed(7) if shuffle else None
    return cls(Rows(), batch_size=2, shuffle=shuffle, generator=generator, num_workers=num_workers)


class Submitted:
    """submit/wait in process: the supervision of a batch is its rows' ids times ten, every batch sent is counted."""

    def __init__(self) -> None:
        self.sent: list[list[int]] = []

    def submit(self, batch) -> Future:
        self.sent.append(ids(batch))
        future: Future = Future()
        future.set_result(batch["input_ids"][:, 0] * 10)
        return future

    def iteration(self, dataloader) -> ResumableIteration:
        return ResumableIteration(dataloader, self.submit, lambda future: future.result(timeout=10), DEPTH)


def ids(batch) -> list[int]:
    return batch["input_ids"][:, 0].tolist()


def pairs(iteration, count: int | None = None) -> list[tuple[list[int], list[int]]]:
    """(batch identity, supervision) of the next ``count`` batches (all that are left: None)."""
    taken = []
    for batch, supervision in iteration:
        taken.append((ids(batch), supervision.tolist()))
        if count is not None and len(taken) == count:
            break
    return taken


def saved(state: dict) -> dict:
    """The state through torch.save and torch.load (weights_only), as a training script checkpoints it."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def stop_and_resume(k: int, **loader_args) -> tuple[list, list, Submitted]:
    """The uninterrupted epoch, and the epoch stopped after batch k (taking the state) and resumed on a fresh
    dataloader; the Submitted of the resumed run."""
    uninterrupted = pairs(Submitted().iteration(loader(**loader_args)))
    first = Submitted().iteration(loader(**loader_args))
    before = pairs(first, k + 1)
    state = saved(first.state_dict())
    assert state["batches_yielded"] == k + 1
    first.close()
    resumed_sends = Submitted()
    resumed = resumed_sends.iteration(loader(**loader_args))
    resumed.load_state_dict(state)
    after = pairs(resumed)
    assert resumed.batches_yielded == len(uninterrupted)
    return uninterrupted, before + after, resumed_sends


@pytest.mark.parametrize("k", [0, 4, ROWS // 2 - 2], ids=["start", "middle", "one-before-the-end"])
@pytest.mark.parametrize("loader_args", [{}, {"shuffle": True}, {"num_workers": 2}], ids=["in-order", "shuffled", "two-workers"])
def test_a_resumed_epoch_equals_the_uninterrupted_one(k, loader_args):
    uninterrupted, resumed, resumed_sends = stop_and_resume(k, **loader_args)
    assert resumed == uninterrupted, f"stopped after batch {k}"
    # The resumed run asks for exactly the batches after k: those in flight at the stop again, none before.
    assert resumed_sends.sent == [batch for batch, _ in uninterrupted[k + 1 :]]
    if loader_args.get("shuffle"):
        assert [batch for batch, _ in uninterrupted] != [[2 * i, 2 * i + 1] for i in range(ROWS // 2)], "the epoch was not shuffled"


def test_the_dataloaders_own_state_is_ahead_by_the_batches_in_flight():
    """Why the iterator keeps its own state: the dataloader's, taken when batch k is yielded, skips k+1 .. k+DEPTH."""
    uninterrupted = pairs(Submitted().iteration(loader()))
    dataloader = loader()
    first = Submitted().iteration(dataloader)
    pairs(first, 3)
    ahead = dataloader.state_dict()
    mine = first.state_dict()["dataloader"]
    naive, fresh = loader(), loader()
    naive.load_state_dict(ahead)
    fresh.load_state_dict(mine)
    assert ids(next(iter(naive))) == uninterrupted[3 + DEPTH][0]
    assert ids(next(iter(fresh))) == uninterrupted[3][0]


def test_a_state_taken_before_any_batch_resumes_at_the_start():
    uninterrupted = pairs(Submitted().iteration(loader(shuffle=True)))
    first = Submitted().iteration(loader(shuffle=True))
    state = saved(first.state_dict())
    assert state["batches_yielded"] == 0
    resumed = Submitted().iteration(loader(shuffle=True))
    resumed.load_state_dict(state)
    assert pairs(resumed) == uninterrupted


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_state_in_the_second_epoch_or_after_the_last_batch_of_one(num_workers):
    """A state taken in a later epoch resumes in that epoch; one taken after the last batch leaves nothing of it."""
    dataloader = loader(shuffle=True, num_workers=num_workers)
    pairs(Submitted().iteration(dataloader))
    second = pairs(Submitted().iteration(dataloader))
    run = loader(shuffle=True, num_workers=num_workers)
    pairs(Submitted().iteration(run))
    iteration = Submitted().iteration(run)
    before = pairs(iteration, 3)
    resumed = Submitted().iteration(loader(shuffle=True, num_workers=num_workers))
    resumed.load_state_dict(saved(iteration.state_dict()))
    assert before + pairs(resumed) == second
    pairs(iteration)  # to the end of the epoch: the state is the one taken with its last batch
    state = saved(iteration.state_dict())
    assert state["batches_yielded"] == ROWS // 2
    ended = loader(shuffle=True, num_workers=num_workers)
    finished = Submitted().iteration(ended)
    finished.load_state_dict(state)
    assert pairs(finished) == [] and len(pairs(Submitted().iteration(ended))) == ROWS // 2  # then a whole new epoch


@pytest.mark.parametrize("num_workers", [0, 2])
def test_torch_distributed_checkpoint_saves_and_restores_it(tmp_path, num_workers):
    """The flow of torch.distributed.checkpoint: save calls state_dict(); load calls state_dict() on a fresh iterator
    for the layout, reads into it, then calls load_state_dict()."""
    import torch.distributed.checkpoint as dcp

    uninterrupted = pairs(Submitted().iteration(loader(shuffle=True, num_workers=num_workers)))
    first = Submitted().iteration(loader(shuffle=True, num_workers=num_workers))
    before = pairs(first, 5)
    with pytest.warns(UserWarning, match="single process"):
        dcp.save({"data": first}, checkpoint_id=tmp_path)
    first.close()
    resumed = Submitted().iteration(loader(shuffle=True, num_workers=num_workers))
    with pytest.warns(UserWarning, match="single process"):
        dcp.load({"data": resumed}, checkpoint_id=tmp_path)
    assert resumed.batches_yielded == 5
    assert before + pairs(resumed) == uninterrupted


def test_a_dataloader_without_state_is_told_to_use_stateful_dataloader():
    iteration = Submitted().iteration(loader(stateful=False))
    for method, argument in (("state_dict", ()), ("load_state_dict", ({},))):
        with pytest.raises(TypeError) as caught:
            getattr(iteration, method)(*argument)
        message = str(caught.value)
        assert "\n" not in message and "StatefulDataLoader" in message and "(DataLoader)" in message, message
    assert len(pairs(iteration)) == ROWS // 2  # iterating it still works


def test_load_state_dict_after_the_first_batch_is_refused():
    first = Submitted().iteration(loader())
    pairs(first, 2)
    state = first.state_dict()
    with pytest.raises(RuntimeError, match=r"already drawn; call it on a new iterate\(\) before its first batch"):
        first.load_state_dict(state)


@pytest.mark.parametrize("state", [{}, {"format": 99, "dataloader": {}}, {"format": 1}, "a path"], ids=["empty", "format", "no-loader", "str"])
def test_a_state_that_is_not_one_of_its_states_is_refused(state):
    with pytest.raises(ValueError, match=r"not a state of iterate\(\).*give what its state_dict\(\) returned"):
        Submitted().iteration(loader()).load_state_dict(state)


def test_taking_the_state_runs_before_state_first():
    """With a store, before_state writes what was recorded: it runs on every state_dict() call, before the state."""
    calls = []
    iteration = ResumableIteration(loader(), Submitted().submit, Future.result, DEPTH, before_state=lambda: calls.append("flushed"))
    pairs(iteration, 2)
    iteration.state_dict()
    iteration.state_dict()
    assert calls == ["flushed", "flushed"]


def identity() -> StoreIdentity:
    info = {"task": "eagle3", "hidden_size": 8, "vocab_size": 16, "num_hidden_layers": 4, "aux_layer_ids": [0, 1, 2]}
    return StoreIdentity.model_validate({"task": "eagle3", "target": info, "forms": ["probs"]})


def test_recorder_flush_writes_a_partial_shard_a_new_store_reads(tmp_path):
    store = SupervisionStore(tmp_path, "cache", "rank-a", shard_bytes=1 << 30, queue_batches=8)
    store.bind(identity())
    beside = SupervisionStore(tmp_path, "cache", "rank-b", shard_bytes=1 << 30, queue_batches=8)  # opened before anything is written
    beside.bind(identity())
    recorded = {}
    for seed in range(3):
        tensors = {"target_probs": torch.rand(2, 4, 16, generator=torch.Generator().manual_seed(seed))}
        key = store.key({"input_ids": torch.full((2, 4), seed)})
        store.admit(10)
        store.record(key, 0, tensors, tokens=8)
        recorded[key] = tensors
    assert not IndexFile(tmp_path).read_new()[0], "nothing reaches the index before a flush with a shard this large"
    store.flush(10)
    records, problems = IndexFile(tmp_path).read_new()
    assert not problems and [sorted(b.key for b in r.batches) for r in records] == [sorted(recorded)]
    store.flush(10)  # nothing new: no empty shard
    assert len(IndexFile(tmp_path).read_new()[0]) == 1
    # Recorded again after the flush (in flight at a stop, then asked for again): not written twice, no error.
    again = next(iter(recorded))
    store.record(again, 0, recorded[again], tokens=8)
    store.flush(10)
    # Another rank, which read the index before, records one of them too: the index then names it twice.
    beside.admit(10)
    beside.record(again, 0, recorded[again], tokens=8)
    beside.flush(10)
    assert sum(len(r.batches) for r in IndexFile(tmp_path).read_new()[0]) == 4
    # A new store opened on the folder (a resumed process, this one killed without closing) reads them back.
    reader = SupervisionStore(tmp_path, "replay", "rank-c", shard_bytes=1 << 30, queue_batches=8)
    reader.bind(identity())
    for key, tensors in recorded.items():
        assert key in reader
        assert torch.equal(reader.read(key, 0)["target_probs"], tensors["target_probs"])
    assert reader.batches == 3 and not reader.problems
    reader.close(10)
    store.close(10)
    beside.close(10)
    assert sum(len(r.batches) for r in IndexFile(tmp_path).read_new()[0]) == 4, "close wrote a batch a flush had written"


class Versioned:
    """A supervision that says the target version that computed it: batch k's is k // 3 (an update every 3 batches)."""

    def __init__(self, first_id: int) -> None:
        self.target_version = first_id // 6  # rows 0..5 are batches 0..2


def test_the_state_says_the_target_version_of_every_batch_yielded_and_a_resume_asks_for_the_last_or_newer():
    def submit(batch) -> Future:
        future: Future = Future()
        future.set_result(Versioned(int(batch["input_ids"][0, 0])))
        return future

    first = ResumableIteration(loader(), submit, lambda future: future.result(timeout=10), DEPTH)
    for _ in range(7):
        next(first)
    state = first.state_dict()
    assert state["target_versions"] == [[0, 3], [1, 3], [2, 1]] and first.target_versions == [(0, 3), (1, 3), (2, 1)]
    asked: list[int] = []
    resumed = ResumableIteration(loader(), submit, lambda future: future.result(timeout=10), DEPTH, on_resumed_version=asked.append)
    resumed.load_state_dict(state)
    assert asked == [2]  # the rank raises its minimum to the last version trained on
    rest = [supervision.target_version for _batch, supervision in resumed]
    assert rest == [2, 2, 3] and resumed.target_versions == [(0, 3), (1, 3), (2, 3), (3, 1)]
