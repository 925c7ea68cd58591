"""The samples a DataLoader worker of speculators' trainer will ask for, in order, so that its rank can keep
``prefetch_depth`` of them in flight: speculators' own batch sampler replayed over the same lengths, seed and epochs,
and the round-robin by which a DataLoader hands batch i to worker i % N.

A guess that turns out wrong (a resumed epoch starts mid-way, a batch went to another worker) costs only prefetching:
``Order`` finds the asked sample further on, or asks for it alone until the order is found again.
"""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict


class Plan(BaseModel):
    """What the replay needs, taken in the trainer's process (where the data-parallel topology is known) and sent to
    every DataLoader worker with the transfer."""

    model_config = ConfigDict(frozen=True)

    data_path: str
    total_seq_len: int
    train_data_ratio: float
    seed: int
    epochs: int
    dp_size: int = 1
    dp_rank: int = 0


def train_rows(rows: int, train_data_ratio: float) -> int:
    """Where speculators' train split ends and its val split begins: the first ``int(rows * ratio)`` rows train."""
    return int(rows * train_data_ratio)


def split_order(lengths: Sequence[int], start: int, plan: Plan, seed: int, worker: int | None, workers: int) -> list[int]:
    """The dataset rows (file indices) one process asks for, epoch after epoch: every batch of speculators' sampler
    over the split's ``lengths`` (rows from ``start``), those of ``worker`` among ``workers`` (None: the process that
    iterates the loader itself)."""
    from speculators.train.distributed_batch_sampler import MultipackDistributedBatchSamplerV2

    sampler = MultipackDistributedBatchSamplerV2(
        batch_max_length=plan.total_seq_len, lengths=list(lengths), num_replicas=plan.dp_size, rank=plan.dp_rank, seed=seed
    )
    order: list[int] = []
    for epoch in range(max(plan.epochs, 1)):
        sampler.set_epoch(epoch)
        batches = list(sampler)
        mine = batches if worker is None else batches[worker::workers]
        order.extend(int(index) + start for batch in mine for index in batch)
    return order


class Order:
    """The rows one process is expected to ask for, and how far it has got."""

    def __init__(self, expected: list[int]) -> None:
        self.expected = expected
        self.cursor = 0  # the next expected position
        self.lost = 0  # asks that were not where expected

    def after(self, index: int, count: int) -> list[int]:
        """``index`` was asked for: the ``count`` rows expected next (none while the order is lost)."""
        found = self._find(index)
        if found is None:
            self.lost += 1
            return []
        self.cursor = found + 1
        return self.expected[self.cursor : self.cursor + count]

    def _find(self, index: int) -> int | None:
        """Where ``index`` is expected: from the cursor on, else from the start (a new epoch of the same order)."""
        cursor = min(self.cursor, len(self.expected))
        return next((p for p in (*range(cursor, len(self.expected)), *range(cursor)) if self.expected[p] == index), None)
