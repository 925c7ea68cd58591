"""The broker's cost per event does not grow with the cluster (issue 35): its policy under an injected clock at 100
ranks and 10 workers, and at 10,000 ranks and 1,000 workers, counting the Python and C calls each event makes (not
seconds: counts are exact and the same on every machine). What departures tell other peers goes in one message per
peer; a status page fits one reply at any size, and the pages together hold every worker and rank once."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable

import pytest
from support.clock import Clock

from draftfeed.broker.settings import BrokerSettings
from draftfeed.broker.state import BrokerState
from draftfeed.schemas.frames import unpack
from draftfeed.schemas.messages import (
    BACKEND_OUTBOUND,
    Computing,
    Dispatch,
    Done,
    Eagle3TargetInfo,
    ForgetRanks,
    Heartbeat,
    Hello,
    PairStatus,
    Register,
    StatusQuery,
    Submit,
    TensorSpec,
    WorkerHeartbeat,
)
from draftfeed.schemas.protocol import MAX_HEADER_BYTES, MAX_NOTICES, PAIRS_PER_BEAT

INFO = Eagle3TargetInfo(num_hidden_layers=8, hidden_size=64, vocab_size=1000, aux_layer_ids=[1, 3, 4])
SPECS = [TensorSpec(name=name, dtype="int64", shape=[1, 8]) for name in ("input_ids", "attention_mask", "loss_mask")]
FRAMES = [bytes(64)] * 3


class Cluster:
    """A broker's state with ``ranks`` ranks (window 2, each with two requests sent) and ``workers`` workers (capacity
    2), all of one service, and the dispatches in flight."""

    def __init__(self, ranks: int, workers: int) -> None:
        self.clock = Clock()
        self.state = BrokerState("scale", BrokerSettings(max_queued_per_service=1 << 20), self.clock)
        self.next_id = dict.fromkeys(range(ranks), 0)
        self.in_flight: list[tuple[bytes, int, int]] = []  # (worker, ticket, rank)
        for index in range(workers):
            register = Register(worker=f"w{index}", service="s", task="eagle3", engine="hf", info=INFO, capacity=2, host="h", pid=1)
            self.take(self.state.on_register(f"w{index}".encode(), register))
        for index in range(ranks):
            hello = Hello(rank=f"r{index}", service="s", data_endpoint=f"tcp://10.0.0.1:1/r{index}", window=2, host="h", pid=1)
            self.state.on_hello(f"r{index}".encode(), hello)
        self.state.notices.flush()
        for index in range(ranks):
            self.submit(index)
            self.submit(index)

    def submit(self, rank: int) -> list:
        request_id = self.next_id[rank]
        self.next_id[rank] += 1
        out = self.state.on_submit(f"r{rank}".encode(), Submit(request_id=request_id, kind="eagle3", token=1, tensors=SPECS), FRAMES)
        self.take(out)
        return out

    def take(self, out: list) -> None:
        for item in out:
            if item.side == "backend":
                message = unpack(item.frames, BACKEND_OUTBOUND)[0]
                if isinstance(message, Dispatch):
                    self.in_flight.append((item.peer, message.ticket, int(message.rank[1:])))

    def cycle(self) -> None:
        """The oldest dispatch done, and its rank's next request."""
        worker, ticket, rank = self.in_flight.pop(0)
        self.take(self.state.on_done(worker, Done(ticket=ticket, outcome="served")))
        self.submit(rank)


def calls(event: Callable[[], object]) -> int:
    """How many Python and C functions ``event`` calls."""
    count = 0

    def profile(_frame, what: str, _arg) -> None:
        nonlocal count
        if what in ("call", "c_call"):
            count += 1

    sys.setprofile(profile)
    try:
        event()
    finally:
        sys.setprofile(None)
    return count


@pytest.fixture(scope="module")
def small() -> Cluster:
    return Cluster(100, 10)


@pytest.fixture(scope="module")
def large() -> Cluster:
    return Cluster(10_000, 1_000)


def per_event(cluster: Cluster) -> dict[str, float]:
    """The mean calls of each event over a hundred of them (two hundred done-and-submit cycles first, so that the
    ranks' windows, the queue and the free workers are in their steady state)."""
    for _ in range(200):
        cluster.cycle()
    state, n = cluster.state, 100
    worker_beat = WorkerHeartbeat(rank_links=3, pair_count=3, pairs=[PairStatus(rank="r1", plane="frames", state="frames", reason="x")])
    events: dict[str, Callable[[], object]] = {
        "done and its rank's next submit": cluster.cycle,
        "rank heartbeat": lambda: state.on_rank_heartbeat(b"r7"),
        "worker heartbeat": lambda: state.on_worker_heartbeat(b"w3", worker_beat),
        "computing": lambda: state.on_computing(b"w3", Computing(ticket=cluster.in_flight[0][1])),
        "status summary": lambda: state.on_status(b"r7", StatusQuery(request_id=1, summary=True)),
    }
    return {name: sum(calls(event) for _ in range(n)) / n for name, event in events.items()}


def test_an_events_cost_does_not_grow_with_the_number_of_ranks_and_workers(small, large):
    few, many = per_event(small), per_event(large)
    print({name: (round(few[name]), round(many[name])) for name in few})
    for name in few:
        assert many[name] <= 1.1 * few[name] + 20, f"{name}: {many[name]:.0f} calls at 10,000 ranks x 1,000 workers, {few[name]:.0f} at 100 x 10"


def test_a_rank_leaving_costs_what_it_holds_not_the_cluster(small, large):
    """Each rank of the large cluster was served by a few workers; its bye costs the same as in the small one."""
    costs = []
    for cluster, rank in ((small, 11), (large, 11)):
        served = len(cluster.state.ranks[f"r{rank}".encode()].workers_served)
        costs.append((calls(lambda c=cluster, r=rank: c.state.on_rank_bye(f"r{r}".encode())), served))
        cluster.state.notices.flush()
    (few, few_served), (many, many_served) = costs
    assert many <= (few / max(few_served, 1)) * max(many_served, 1) * 1.5 + 50, (costs,)


def test_departures_tell_each_peer_in_one_message():
    """A thousand ranks leave at once: each worker that held links to them hears it in one forget_ranks per
    MAX_NOTICES ranks, not one message per rank."""
    cluster = Cluster(1_000, 8)
    for _ in range(4_000):
        cluster.cycle()
    state = cluster.state
    at_workers = sum(len(worker.in_flight) for worker in state.workers.values())
    out = []
    for index in range(1_000):
        out += state.on_rank_bye(f"r{index}".encode())
    out = state.notices.ordered(out + state.notices.flush())
    forgets = [(item.peer, unpack(item.frames, BACKEND_OUTBOUND)[0]) for item in out if item.side == "backend"]
    forgets = [(peer, message) for peer, message in forgets if isinstance(message, ForgetRanks)]
    named: dict[bytes, list[str]] = {}
    for peer, message in forgets:
        named.setdefault(peer, []).extend(address.rank for address in message.ranks)
    assert len(named) == 8 and all(len(set(ranks)) == len(ranks) for ranks in named.values())  # each rank named once
    # At once to a worker computing a leaving rank's request (at most one message each), the rest gathered.
    bound = at_workers + sum(-(-len(ranks) // MAX_NOTICES) for ranks in named.values())
    assert len(forgets) <= bound, f"{len(forgets)} forget_ranks messages for {sum(map(len, named.values()))} names (bound {bound})"
    assert len(forgets) < sum(map(len, named.values())) / 10
    assert not state.ranks and not any(worker.ranks_served for worker in state.workers.values())


def test_status_pages_fit_one_reply_and_hold_every_worker_and_rank_once(large):
    state = large.state
    for index in range(0, 1_000, 7):  # workers with many pairs each
        worker = state.workers[f"w{index}".encode()]
        pairs = [PairStatus(rank=rank.decode(), plane="nixl", state="ready", reason="r" * 200) for rank in list(worker.ranks_served)[:PAIRS_PER_BEAT]]
        state.on_worker_heartbeat(worker.peer, WorkerHeartbeat(pair_count=len(pairs), pairs=pairs))
    workers, ranks, pages = [], [], 0
    present = {r.hello.rank for r in state.ranks.values()}
    query = StatusQuery(request_id=0, pairs=True)
    while True:
        (reply,) = state.on_status(b"r1", query)
        header = reply.frames[1]
        assert len(header) <= MAX_HEADER_BYTES, f"page {pages}: a {len(header)}-byte header"
        page = json.loads(header)["status"]
        pages += 1
        workers += [w["worker"] for service in page["services"].values() for w in service["workers"]]
        ranks += [r["rank"] for r in page["ranks"]]
        cursor = page["page"]
        if cursor["workers_next"] is None and cursor["ranks_next"] is None:
            break
        query = StatusQuery(request_id=pages, pairs=True, workers_from=cursor["workers_next"], ranks_from=cursor["ranks_next"])
        # Between pages every rank is heard (the broker keeps its records in the order they were heard), one leaves
        # and one joins: each rank present throughout is still listed once, whatever moved.
        for peer in list(state.ranks)[::-1]:
            state.on_rank_heartbeat(peer)
        state.on_rank_bye(f"r{pages * 3}".encode())
        joined = f"new{pages}"
        state.on_hello(joined.encode(), Hello(rank=joined, service="s", data_endpoint=f"tcp://10.0.0.1:1/{joined}", window=2, host="h", pid=1))
    assert pages > 1
    assert sorted(workers) == sorted(w.name for w in state.workers.values())
    throughout = present & {r.hello.rank for r in state.ranks.values()}
    assert len(set(ranks)) == len(ranks), f"listed twice: {sorted(r for r in set(ranks) if ranks.count(r) > 1)[:10]}"
    assert throughout <= set(ranks), f"never listed: {sorted(throughout - set(ranks))[:10]}"


def test_a_heartbeat_holds_no_list_that_grows_with_the_cluster():
    """A worker's heartbeat reports the pairs that changed (PAIRS_PER_BEAT at most) and a few in turn, whatever the
    number of its pairs; after a registration it reports them all again, over as many heartbeats."""
    from draftfeed.consumers.pair_report import REFRESH_PER_BEAT, PairReport

    report = PairReport()
    statuses = [PairStatus(rank=f"r{i}", plane="frames", state="frames", reason="x") for i in range(100)]
    told: set[str] = set()
    beats = 0
    while len(told) < 100:
        beat = report.changes(statuses)
        assert len(beat) <= PAIRS_PER_BEAT
        told |= {pair.rank for pair in beat}
        beats += 1
    assert beats == -(-100 // PAIRS_PER_BEAT)
    assert len(report.changes(statuses)) == REFRESH_PER_BEAT  # nothing changed: a few in turn
    statuses[5] = statuses[5].model_copy(update={"state": "down"})
    assert statuses[5] in report.changes(statuses)
    report.reset()
    assert len(report.changes(statuses)) == PAIRS_PER_BEAT  # the broker holds none again
    heartbeat = WorkerHeartbeat(pair_count=100, pairs=report.changes(statuses))
    assert heartbeat.pair_count == 100 and len(heartbeat.pairs) <= PAIRS_PER_BEAT
    assert Heartbeat().type == "heartbeat"
