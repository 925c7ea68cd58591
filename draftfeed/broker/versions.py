"""Target versions at the broker (docs/versions.md): which workers' versions a request takes, and the weight updates
in progress.

Every worker serves one version of its target (its registration's, then each update's it took). A request says which
versions it takes (``Submit.target_version``): at least a version, exactly one, or the newest among the service's
live workers when it is dispatched. The scheduler gives it only to a worker whose version fits; one that no live
worker fits waits in its queue, and the rank that asks where it is hears why (``waiting_note``).

An ``update_target`` goes to every worker of the service below the new version (one at or above it keeps what it
serves, and the report says so): to all at once, or ``at_once`` at a time, the next told as soon as one answers or
leaves, so that the others serve meanwhile. A worker told is given no work until it answers (``WorkerRecord.updating``):
what it holds is computed before the update, and nothing waits in its queue while it loads. The broker answers the
update's sender once each worker has said how it went, or has left. A worker that took the update serves the new
version from then on: requests that wait for it are dispatched at once.
"""

from __future__ import annotations

import itertools
import logging
from collections import deque
from dataclasses import dataclass, field

from draftfeed.broker.records import Outgoing, ServiceRecord, WorkerRecord, to_rank, to_worker
from draftfeed.schemas.messages import ErrorReply, UpdateReport, UpdateTarget, UpdateWeights, VersionWanted, WeightsUpdated, WorkerKeys, WorkerUpdate

log = logging.getLogger("draftfeed.broker")


def fits(wanted: VersionWanted | None, version: int, newest: int) -> bool:
    """Whether a worker at ``version`` may compute a request that wants ``wanted`` (``newest``: the newest version
    among the service's live workers)."""
    return wanted is None or wanted.accepts(version, newest)


def newest_version(service: ServiceRecord) -> int:
    """The newest version the service's workers that take work serve (0 with none)."""
    return max((w.target_version for w in service.workers.values() if not w.draining), default=0)


def waiting_note(wanted: VersionWanted | None, service: ServiceRecord) -> str | None:
    """Why a queued request waits, when no live worker's version fits it; None when one does."""
    if wanted is None:
        return None
    newest = newest_version(service)
    versions = sorted({w.target_version for w in service.workers.values() if not w.draining})
    if any(fits(wanted, version, newest) for version in versions):
        return None
    served = ", ".join(map(str, versions)) if versions else "none (no worker)"
    return f"no live worker of service {service.name!r} serves {wanted.describe()}; the workers serve versions {served}"


@dataclass
class Update:
    """One ``update_target`` in progress: who asked, the workers told and not answered, those not told yet."""

    requester: bytes
    request: UpdateTarget
    told: UpdateWeights  # what each worker is told
    service: ServiceRecord
    waiting: dict[bytes, str] = field(default_factory=dict)  # worker peer -> name
    queued: deque[WorkerRecord] = field(default_factory=deque)  # their turn comes as others answer (at_once)
    results: list[WorkerUpdate] = field(default_factory=list)
    admitted: set[str] = field(default_factory=set)  # the told workers' keys, an encrypted publisher's allow-list


class UpdateBook:
    def __init__(self) -> None:
        self._updates: dict[int, Update] = {}
        self._ids = itertools.count()

    def start(self, requester: bytes, message: UpdateTarget, service: ServiceRecord | None) -> list[Outgoing]:
        """Tell the service's workers below the new version to load it, ``at_once`` at a time; answer at once if none
        is below it."""
        if service is None or not service.workers:
            why = f"service {message.service!r} has no workers to update"
            return [to_rank(requester, ErrorReply(request_id=message.request_id, message=why, code="refused"))]
        number = next(self._ids)
        told = UpdateWeights(
            update=number, weights=message.weights, source=message.source, source_key=message.source_key, target_version=message.target_version
        )
        update = Update(requester, message, told, service)
        for worker in service.workers.values():
            if worker.target_version >= message.target_version:
                why = f"serves version {worker.target_version} already, not older than {message.target_version}: left as it is"
                update.results.append(WorkerUpdate(worker=worker.name, ok=False, target_version=worker.target_version, message=why))
            else:
                update.queued.append(worker)
        log.info(
            "broker: update of service %r to version %d from %s: %d workers to tell, %s at a time",
            message.service,
            message.target_version,
            message.origin,
            len(update.queued),
            message.at_once or "all",
        )
        out = self._tell_next(update)
        if not update.waiting:
            return out + self._report(update)
        self._updates[number] = update
        return out

    def answered(self, worker: WorkerRecord, message: WeightsUpdated) -> list[Outgoing]:
        """A worker said how its update went: its version is what it says it serves now, and it takes work again."""
        worker.target_version = message.target_version
        if message.ok:
            worker.checkpoint = message.checkpoint
        update = self._updates.get(message.update)
        if update is None or update.waiting.pop(worker.peer, None) is None:
            return []
        self._untold(update, worker)
        update.results.append(WorkerUpdate(worker=worker.name, ok=message.ok, target_version=message.target_version, message=message.message))
        return self._tell_next(update) + self._finish_if_done(message.update, update)

    def worker_left(self, worker: WorkerRecord) -> list[Outgoing]:
        """A worker left with updates unanswered or not yet told: each counts it as not updated."""
        out: list[Outgoing] = []
        for number, update in list(self._updates.items()):
            if update.waiting.pop(worker.peer, None) is not None:
                why = "left before it answered (its update, if it took one, left with it)"
            elif any(queued.peer == worker.peer for queued in update.queued):
                update.queued = deque(queued for queued in update.queued if queued.peer != worker.peer)
                why = "left before its turn to update"
            else:
                continue
            update.results.append(WorkerUpdate(worker=worker.name, ok=False, target_version=worker.target_version, message=why))
            out.extend(self._tell_next(update))
            out.extend(self._finish_if_done(number, update))
        return out

    @staticmethod
    def _tell_next(update: Update) -> list[Outgoing]:
        """Tell queued workers to load the update until ``at_once`` of them are loading; each takes no work meanwhile."""
        limit = update.request.at_once or len(update.queued) + len(update.waiting)
        out: list[Outgoing] = []
        told: list[Outgoing] = []
        while update.queued and len(update.waiting) < limit:
            worker = update.queued.popleft()
            update.waiting[worker.peer] = worker.name
            worker.updating = True
            update.service.credits_changed(worker)
            told.append(to_worker(worker.peer, update.told))
            if update.told.source_key is not None and worker.key is not None:
                update.admitted.add(worker.key)
        if told and update.told.source_key is not None:  # the publisher admits them before they pull
            out.append(to_rank(update.requester, WorkerKeys(keys=sorted(update.admitted))))
        return out + told

    @staticmethod
    def _untold(update: Update, worker: WorkerRecord) -> None:
        worker.updating = False
        update.service.credits_changed(worker)

    def _finish_if_done(self, number: int, update: Update) -> list[Outgoing]:
        if update.waiting or update.queued:
            return []
        del self._updates[number]
        return self._report(update)

    @staticmethod
    def _report(update: Update) -> list[Outgoing]:
        results = sorted(update.results, key=lambda result: result.worker)
        return [to_rank(update.requester, UpdateReport(request_id=update.request.request_id, workers=results))]
