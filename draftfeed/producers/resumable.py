"""What ``iterate()`` returns: ``(batch, supervision)`` in the dataloader's order with ``prefetch_depth`` batches in
flight, and a state to resume from after the last batch it yielded.

A rank keeps batches in flight: when the training loop holds batch k, batches k + 1 .. k + depth have already been
drawn from the dataloader. A resumable dataloader's own state is then ``depth`` batches ahead of the training, and a
run resumed from it would skip those batches. This iterator takes the dataloader's state right after it draws each
batch, and its ``state_dict()`` is the state taken with the last batch it yielded: restored, the dataloader goes on
with batch k + 1, and the batches that were in flight are drawn and asked for again.

``state_dict()`` and ``load_state_dict()`` are the ``Stateful`` protocol of ``torch.distributed.checkpoint`` and of
torchdata's ``StatefulDataLoader``, whose state this iterator keeps (any dataloader with both methods works).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future
from typing import Any, Generic, TypeVar

from draftfeed.producers.prefetch import prefetch
from draftfeed.schemas.errors import NonFiniteSupervision

R = TypeVar("R")
STATE_FORMAT = 1  # the layout of state_dict(); load_state_dict() refuses others
STATELESS = (
    "cannot save its state, so a run resumed from a checkpoint could not start after the last batch trained on: use "
    "torchdata's StatefulDataLoader (from torchdata.stateful_dataloader import StatefulDataLoader; it takes DataLoader's "
    "arguments), or any dataloader with state_dict() and load_state_dict()"
)


def saves_state(dataloader: object) -> bool:
    """Whether ``dataloader`` has the Stateful protocol (state_dict and load_state_dict)."""
    return callable(getattr(dataloader, "state_dict", None)) and callable(getattr(dataloader, "load_state_dict", None))


class _Skipped:
    """A batch left out: its supervision was not finite."""

    def __init__(self, error: NonFiniteSupervision) -> None:
        self.error = error


class ResumableIteration(Generic[R]):
    """An iterator of ``(batch, supervision)`` whose ``state_dict()`` resumes after the last batch it yielded.

    ``submit`` sends a batch and returns its future, ``wait`` takes its result; ``depth`` batches are in flight.
    ``before_state`` runs when a state is taken (the rank's store writes what it recorded, so a run resumed from the
    state reads those batches back instead of asking workers). With ``on_skipped``, a batch whose supervision was not
    finite (NonFiniteSupervision) is left out and handed to it, and the state moves past it as past a yielded one;
    without, the error is raised.
    """

    def __init__(
        self,
        dataloader: Iterable[Mapping[str, Any]],
        submit: Callable[[Mapping[str, Any]], Future],
        wait: Callable[[Future], R],
        depth: int,
        before_state: Callable[[], None] = lambda: None,
        on_skipped: Callable[[NonFiniteSupervision], None] | None = None,
        on_resumed_version: Callable[[int], None] | None = None,
    ) -> None:
        self._dataloader = dataloader
        self._submit = submit
        self._wait = wait
        self._depth = depth
        self._before_state = before_state
        self._on_skipped = on_skipped
        self._skipped = 0
        self._saves = saves_state(dataloader)
        self._results: Iterator[tuple[tuple[Mapping[str, Any], Any], R]] | None = None
        self._state: Any = None  # the dataloader's state as of the last batch yielded (or as of the start)
        self._yielded = 0  # batches of this pass over the dataloader yielded, those before a resume included
        # The target version of each batch yielded, as runs of [version, batches] (docs/versions.md); a supervision
        # without one (a store's) counts as None.
        self._versions: list[list[Any]] = []
        self._on_resumed_version = on_resumed_version

    def __iter__(self) -> ResumableIteration[R]:
        return self

    def __next__(self) -> tuple[Mapping[str, Any], R]:
        if self._results is None:
            self._results = prefetch(self._drawn(), lambda drawn: self._submit(drawn[0]), self._outcome, self._depth)
        while True:
            (batch, state), outcome = next(self._results)
            self._state = state
            if not isinstance(outcome, _Skipped):
                self._yielded += 1
                self._count_version(getattr(outcome, "target_version", None))
                return batch, outcome
            self._skipped += 1
            assert self._on_skipped is not None
            self._on_skipped(outcome.error)

    def _outcome(self, future: Future) -> R | _Skipped:
        try:
            return self._wait(future)
        except NonFiniteSupervision as exc:
            if self._on_skipped is None:
                raise
            return _Skipped(exc)

    def _drawn(self) -> Iterator[tuple[Mapping[str, Any], Any]]:
        """The dataloader's batches, each with the dataloader's state right after it was drawn."""
        if self._saves and self._state is None:
            self._state = self._snapshot()  # as of the start: a state taken before the first batch is yielded
        for batch in self._dataloader:
            yield batch, self._snapshot() if self._saves else None

    def _snapshot(self) -> Any:
        return copy.deepcopy(self._dataloader.state_dict())  # type: ignore[attr-defined]

    def _count_version(self, version: int | None) -> None:
        if self._versions and self._versions[-1][0] == version:
            self._versions[-1][1] += 1
        else:
            self._versions.append([version, 1])

    @property
    def target_versions(self) -> list[tuple[int | None, int]]:
        """The target version of the batches yielded, in order, as (version, how many in a row): those before a resume
        included."""
        return [(version, count) for version, count in self._versions]

    @property
    def batches_yielded(self) -> int:
        """Batches of this pass over the dataloader yielded so far, those before a resume included."""
        return self._yielded

    @property
    def batches_skipped(self) -> int:
        """Batches of this pass left out because their supervision was not finite, those before a resume included."""
        return self._skipped

    def state_dict(self) -> dict[str, Any]:
        """The state to resume from: the dataloader's state as of the last batch yielded, how many were, and the target
        version of each (``target_versions``)."""
        if not self._saves:
            raise TypeError(f"iterate().state_dict(): the dataloader ({type(self._dataloader).__name__}) {STATELESS}")
        self._before_state()
        state = self._state if self._state is not None else self._snapshot()
        return {
            "format": STATE_FORMAT,
            "dataloader": state,
            "batches_yielded": self._yielded,
            "batches_skipped": self._skipped,
            "target_versions": copy.deepcopy(self._versions),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume after the batch a ``state_dict()`` was taken at; call it before the first batch is drawn."""
        if not self._saves:
            raise TypeError(f"iterate().load_state_dict(): the dataloader ({type(self._dataloader).__name__}) {STATELESS}")
        if self._results is not None:
            raise RuntimeError("iterate().load_state_dict(): batches were already drawn; call it on a new iterate() before its first batch")
        if not isinstance(state, Mapping) or state.get("format") != STATE_FORMAT or "dataloader" not in state:
            raise ValueError(
                f"iterate().load_state_dict(): not a state of iterate() (format {STATE_FORMAT}, with 'dataloader' and "
                f"'batches_yielded'): give what its state_dict() returned"
            )
        self._dataloader.load_state_dict(state["dataloader"])  # type: ignore[attr-defined]
        self._state = copy.deepcopy(state["dataloader"])
        self._yielded = int(state.get("batches_yielded", 0))
        self._skipped = int(state.get("batches_skipped", 0))
        self._versions = [[version, int(count)] for version, count in state.get("target_versions", [])]
        versions = [version for version, _count in self._versions if version is not None]
        if versions and self._on_resumed_version is not None:
            self._on_resumed_version(max(versions))  # a resumed run never takes an older target than it trained on

    def close(self) -> None:
        """Cancel the batches in flight (also done when the iterator is garbage)."""
        if self._results is not None:
            self._results.close()  # type: ignore[attr-defined]
