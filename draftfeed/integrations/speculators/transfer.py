"""The hidden-states transfer speculators' datasets read samples from: each DataLoader worker process (or the trainer
itself, with ``--num-workers 0``) is a draftfeed rank of its own, opened on its first sample, that asks a DFlash
service for the rows it will be asked for next and keeps ``prefetch_depth`` of them in flight."""

from __future__ import annotations

import atexit
from concurrent.futures import Future
from typing import Any

import torch
from hs_connectors import HiddenStatesTransfer
from pydantic import BaseModel, ConfigDict

from draftfeed.integrations.speculators.samples import row_batch, to_sample
from draftfeed.integrations.speculators.schedule import Order, Plan, split_order, train_rows


class Wanted(BaseModel):
    """What every process's rank serves and checks: the URL, the service's DFlash layers and the target's width."""

    model_config = ConfigDict(frozen=True)

    url: str
    request_timeout: float
    layer_ids: list[int]
    hidden_size: int


class DraftfeedTransfer(HiddenStatesTransfer):
    """Sent to every DataLoader worker (pickled: only ``wanted`` and ``plan`` travel); opens its rank lazily there."""

    def __init__(self, wanted: Wanted, plan: Plan) -> None:
        self.wanted = wanted
        self.plan = plan
        self._reader: Reader | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {"wanted": self.wanted, "plan": self.plan, "_reader": None}

    def get_cached(self, file_idx: int) -> dict[str, torch.Tensor] | None:
        if self._reader is None:
            self._reader = Reader(self.wanted, self.plan)
        return self._reader.sample(int(file_idx))

    def get_generated(self, hs_transfer_params: dict[str, Any]) -> dict[str, torch.Tensor] | None:
        raise RuntimeError("the draftfeed backend serves every sample from get_cached; run speculators with --on-missing raise")

    def close(self) -> None:
        if self._reader is not None:
            self._reader.close()
            self._reader = None


class Reader:
    """One process's rank, its dataset rows and what it has in flight."""

    def __init__(self, wanted: Wanted, plan: Plan) -> None:
        from datasets import load_from_disk

        from draftfeed.integrations.speculators.samples import LayerMismatch
        from draftfeed.integrations.url import DraftfeedUrl
        from draftfeed.producers.tasks.dflash import RemoteDFlashTarget

        self.wanted = wanted
        self.plan = plan
        data = load_from_disk(plan.data_path)
        self.rows = data.with_format("torch", columns=["input_ids"])
        self._lengths = list(data.with_format(None)["seq_len"])
        self.boundary = train_rows(len(self._lengths), plan.train_data_ratio)
        self._orders: dict[str, Order] = {}
        url = DraftfeedUrl.parse(wanted.url, timeout=wanted.request_timeout)
        self.depth = max(url.settings.prefetch_depth, 1)  # rows in flight, the one asked for included
        self.target = RemoteDFlashTarget(url.broker, url.service, **url.target_arguments())
        served = list(self.target.target_layer_ids)
        if served != wanted.layer_ids:  # the workers changed since the trainer checked
            self.target.close()
            raise LayerMismatch(f"service {url.service!r} now serves DFlash layers {served}, not {wanted.layer_ids}")
        self.in_flight: dict[int, Future] = {}
        atexit.register(self.close)  # a DataLoader worker ends without closing its dataset's transfer

    def _order(self, index: int) -> Order:
        """The expected order of the split ``index`` is in, for this process (replayed on first use)."""
        from torch.utils.data import get_worker_info

        split = "train" if index < self.boundary else "val"
        if split not in self._orders:
            info = get_worker_info()
            worker, workers = (None, 1) if info is None else (info.id, info.num_workers)
            start, stop = (0, self.boundary) if split == "train" else (self.boundary, len(self._lengths))
            seed = self.plan.seed if split == "train" else 0  # speculators validates in one fixed order
            self._orders[split] = Order(split_order(self._lengths[start:stop], start, self.plan, seed, worker, workers))
        return self._orders[split]

    def _submit(self, index: int) -> None:
        if index not in self.in_flight:
            self.in_flight[index] = self.target.generate_batch_async(**row_batch(self.rows[index]["input_ids"]))

    def sample(self, index: int) -> dict[str, torch.Tensor]:
        self._submit(index)
        upcoming = self._order(index).after(index, self.depth)
        for finished in [row for row, future in self.in_flight.items() if row != index and row not in upcoming and future.done()]:
            del self.in_flight[finished]  # asked for ahead, and the order went elsewhere: its credit is back
        for row in upcoming:
            if len(self.in_flight) >= self.depth:
                break
            self._submit(row)
        supervision = self.target.wait(self.in_flight.pop(index))
        return to_sample(supervision.hidden_states, self.rows[index]["input_ids"], self.wanted.hidden_size)

    def close(self) -> None:
        self.target.close()
