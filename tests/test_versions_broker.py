"""Target versions in the broker's policy (issue 48; broker/versions.py), without sockets under a hand-turned clock:
a request goes only to a worker whose version it takes (at least, exactly, the newest); one no worker fits waits,
and a rank that asks where it is hears why; an update goes to the workers below its version, whose answers make them
serve it (and free the requests that waited for it), and its sender hears how each went, also of a worker that left."""

from __future__ import annotations

import pytest
from support.clock import Clock
from support.messages import INFO, SERVICE, backend, dispatches, frontend, hello, only, register, submit

from draftfeed.broker.settings import BrokerSettings
from draftfeed.broker.state import BrokerState
from draftfeed.schemas.messages import (
    Done,
    Register,
    UpdateReport,
    UpdateTarget,
    UpdateWeights,
    VersionWanted,
    WeightsUpdated,
    Where,
    Whereabouts,
    WorkerKeys,
)


@pytest.fixture
def state() -> BrokerState:
    return BrokerState("test", BrokerSettings(heartbeat_interval_s=1.0, liveness=3), Clock())


def workers_at(state: BrokerState, versions: dict[str, int]) -> None:
    for name, version in versions.items():
        register(state, name, capacity=4, target_version=version)


@pytest.mark.parametrize(
    "wanted, chosen",
    [
        (VersionWanted(minimum=2), {"w2", "w3"}),
        (VersionWanted(minimum=2, policy="exact"), {"w2"}),
        (VersionWanted(minimum=0, policy="latest"), {"w3"}),
        (VersionWanted(minimum=1), {"w1", "w2", "w3"}),
        (None, {"w1", "w2", "w3"}),
    ],
)
def test_a_request_goes_only_to_a_worker_whose_version_it_takes(state, wanted, chosen):
    hello(state, "r", window=16)
    workers_at(state, {"w1": 1, "w2": 2, "w3": 3})
    went = {peer.decode() for request_id in range(6) for peer, _ in dispatches(submit(state, "r", request_id, target_version=wanted))}
    assert went <= chosen and went, went
    if len(chosen) > 1:
        assert went == chosen  # spread over every worker that fits, as the scheduler spreads any request


def test_a_request_no_worker_fits_waits_says_why_and_goes_once_a_worker_is_updated(state):
    hello(state, "r", window=4)
    workers_at(state, {"w1": 1, "w2": 2})
    assert dispatches(submit(state, "r", 0, target_version=VersionWanted(minimum=3))) == []
    (where,) = only(frontend(state.on_where(b"r", Where(request_ids=[0]))), Whereabouts)
    assert where.places[0].place == "queued"
    assert where.places[0].note == "no live worker of service 'svc' serves version 3 or newer; the workers serve versions 1, 2"
    out = state.on_update_target(b"trainer", UpdateTarget(request_id=7, service="svc", weights="/w/step3", target_version=3))
    told = {peer: message for peer, message in [(item.peer, m) for item in out for m in backend([item])]}
    assert set(told) == {b"w1", b"w2"} and all(isinstance(m, UpdateWeights) and m.target_version == 3 for m in told.values())
    update = told[b"w1"].update
    out = state.on_weights_updated(b"w1", WeightsUpdated(update=update, ok=True, target_version=3, checkpoint="/w/step3"))
    assert [(peer, d.request.request_id) for peer, d in dispatches(out)] == [(b"w1", 0)]  # it waited for w1's new version
    assert only(frontend(out), UpdateReport) == []  # w2 has not answered yet
    out = state.on_weights_updated(
        b"w2", WeightsUpdated(update=update, ok=False, target_version=2, message="tensor x: shape [2], the target's is [3]")
    )
    (report,) = only(frontend(out), UpdateReport)
    assert report.request_id == 7
    assert [(r.worker, r.ok, r.target_version) for r in report.workers] == [("w1", True, 3), ("w2", False, 2)]
    assert "tensor x" in report.workers[1].message
    status = {w["worker"]: w["target_version"] for w in state.status()["services"]["svc"]["workers"]}
    assert status == {"w1": 3, "w2": 2}


def test_an_update_skips_workers_at_or_past_it_and_counts_a_worker_that_left(state):
    workers_at(state, {"w1": 1, "w2": 5})
    out = state.on_update_target(b"trainer", UpdateTarget(request_id=1, service="svc", weights="/w", target_version=4))
    assert [item.peer for item in out if item.side == "backend"] == [b"w1"]
    out = state.on_worker_bye(b"w1")
    (report,) = only(frontend(out), UpdateReport)
    assert [(r.worker, r.ok) for r in report.workers] == [("w1", False), ("w2", False)]
    assert "left before it answered" in report.workers[0].message and "serves version 5 already" in report.workers[1].message
    out = state.on_update_target(b"trainer", UpdateTarget(request_id=2, service="nobody", weights="/w", target_version=4))
    assert "service 'nobody' has no workers to update" in frontend(out)[0].message


def test_a_request_whose_worker_changed_version_since_goes_back_uncharged(state):
    hello(state, "r", window=4)
    workers_at(state, {"w1": 1})
    ((peer, dispatch),) = dispatches(submit(state, "r", 0, target_version=VersionWanted(minimum=1, policy="exact")))
    out = state.on_done(peer, Done(ticket=dispatch.ticket, outcome="version_changed", message="serves 2 now"))
    assert dispatches(out) and dispatches(out)[0][1].request.request_id == 0  # w1 still says version 1 here: it goes again
    assert state.ranks[b"r"].requests[0].failures == 0 and state.status()["requeues"] == {"version_changed": 1}


def test_an_update_one_at_a_time_lets_the_others_serve_the_latest_meanwhile(state):
    """``at_once=1``: one worker loads while the others serve; a worker told takes no work until it answers, and a
    rank that takes the latest version gets the old one from the others meanwhile and the new one from the first
    worker done. The next worker is told as the previous answers, and one that leaves before its turn is reported."""
    hello(state, "r", window=8)
    workers_at(state, {"w1": 0, "w2": 0, "w3": 0})
    out = state.on_update_target(b"trainer", UpdateTarget(request_id=3, service="svc", weights="/w", target_version=1, at_once=1))
    assert [item.peer for item in out if item.side == "backend"] == [b"w1"]
    latest = VersionWanted(minimum=0, policy="latest")
    assert [peer for peer, _ in dispatches(submit(state, "r", 0, target_version=latest))] in ([b"w2"], [b"w3"])  # not w1: it loads
    update = only(backend(out), UpdateWeights)[0].update
    out = state.on_weights_updated(b"w1", WeightsUpdated(update=update, ok=True, target_version=1, checkpoint="/w"))
    assert [name for name in ("w1", "w2", "w3") if only(backend(out, name), UpdateWeights)] == ["w2"]
    assert [peer for peer, _ in dispatches(submit(state, "r", 1, target_version=latest))] == [b"w1"]  # the newest now
    out = state.on_worker_bye(b"w3")  # before its turn
    assert not frontend(out)
    out = state.on_weights_updated(b"w2", WeightsUpdated(update=update, ok=True, target_version=1, checkpoint="/w"))
    (report,) = only(frontend(out), UpdateReport)
    assert [(r.worker, r.ok) for r in report.workers] == [("w1", True), ("w2", True), ("w3", False)]
    assert "left before its turn" in report.workers[2].message


def test_a_worker_told_to_update_gives_back_its_queue_to_the_others_uncharged(state):
    """What waits in a worker's queue when it is told to load an update comes back (``done`` outcome ``updating``) and
    goes to a worker that serves meanwhile, not charged: a rank taking the latest version never waits out a load."""
    hello(state, "r", window=4)
    workers_at(state, {"w1": 0})
    ((peer, dispatch),) = dispatches(submit(state, "r", 0, target_version=VersionWanted(minimum=0, policy="latest")))
    assert peer == b"w1"
    workers_at(state, {"w2": 0})
    out = state.on_update_target(b"trainer", UpdateTarget(request_id=4, service="svc", weights="/w", target_version=1, at_once=1))
    assert [item.peer for item in out if item.side == "backend"] == [b"w1"]
    out = state.on_done(b"w1", Done(ticket=dispatch.ticket, outcome="updating", message="worker w1 loads target version 1"))
    assert [(peer, d.request.request_id) for peer, d in dispatches(out)] == [(b"w2", 0)]
    assert state.ranks[b"r"].requests[0].failures == 0 and state.status()["requeues"] == {"updating": 1}


def test_an_encrypted_publish_names_each_told_workers_key_to_the_publisher_before_the_worker_is_told(state):
    """``source_key`` set: before telling workers to pull, the broker sends the requester the keys of every worker told
    so far (``worker_keys``: the publisher's allow-list), and each worker is told the publisher's key."""
    keys = {name: name[-1] * 40 for name in ("w1", "w2")}
    for name, key in keys.items():
        register_message = Register(worker=name, service=SERVICE, task=INFO.task, engine="hf", info=INFO, capacity=4, host="h", pid=1)
        state.on_register(name.encode(), register_message, key=key)
    trainer_key = "t" * 40
    request = UpdateTarget(request_id=5, service="svc", source="tcp://10.0.0.9:7000", source_key=trainer_key, target_version=1, at_once=1)
    out = state.on_update_target(b"trainer", request)
    assert [item.side for item in out] == ["frontend", "backend"]  # the publisher admits the worker before it pulls
    (told,) = only(backend(out), UpdateWeights)
    assert told.source_key == trainer_key
    (admitted,) = only(frontend(out), WorkerKeys)
    assert admitted.keys == [keys["w1"]]
    out = state.on_weights_updated(b"w1", WeightsUpdated(update=told.update, ok=True, target_version=1, checkpoint="published"))
    assert only(frontend(out), WorkerKeys)[0].keys == sorted(keys.values()) and only(backend(out, "w2"), UpdateWeights)
