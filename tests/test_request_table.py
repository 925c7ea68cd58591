"""The rank's table of unanswered requests and its view of the broker, on their own (no sockets)."""

from __future__ import annotations

import threading

from support.clock import Clock

from draftfeed.broker_view import BrokerView
from draftfeed.producers.requests import RequestKind, RequestTable
from draftfeed.schemas.errors import RemoteTargetError
from draftfeed.schemas.messages import Liveness


def add(table: RequestTable, kind: RequestKind = RequestKind.BATCH, mapping: str | None = None, timeout_s: float | None = 1.0):
    added = table.add(lambda header, tensors: (header, tensors), kind, mapping=mapping, timeout_s=timeout_s)
    assert added is not None
    request_id, waiter = added
    waiter.frames = [b"frames", request_id, waiter.token]  # what the caller packs
    return request_id, waiter


def test_the_window_holds_batches_only_and_is_freed_by_their_answers():
    table = RequestTable(window=2)
    first, _ = add(table)
    add(table)
    add(table, RequestKind.QUERY)  # no slot
    assert table.in_flight == 2 and table.peak_in_flight == 2
    assert table.add(lambda *_: None, RequestKind.BATCH, timeout_s=0.05) is None  # full
    assert table.resolve(first, header="h")
    assert table.in_flight == 1
    assert table.add(lambda *_: None, RequestKind.BATCH, timeout_s=0.05) is not None


def test_the_first_answer_wins_once_and_a_wrong_token_is_foreign():
    table = RequestTable(window=2)
    request_id, waiter = add(table)
    assert table.check(request_id, waiter.token + 1) == "foreign"
    assert table.check(request_id, waiter.token) == "ok"
    assert table.resolve(request_id, header="first", tensors={"t": 1})
    assert waiter.future.result(0) == ("first", {"t": 1})
    assert table.check(request_id, waiter.token) == "answered"
    assert not table.resolve(request_id, header="second")


def test_a_request_asked_again_answers_to_every_id_once():
    table = RequestTable(window=1)
    old, waiter = add(table)
    new, same = table.alias(old)
    assert same is waiter and waiter.ids == [old, new]
    assert table.resolve(new, header="by the new id")
    assert not table.resolve(old, header="late, by the old id")
    assert waiter.future.result(0)[0] == "by the new id" and table.in_flight == 0
    assert table.alias(old) is None  # answered: nothing to ask again


def test_unanswered_requests_are_resent_in_order_behind_the_mappings_they_name():
    table = RequestTable(window=4)
    _, old_mapping = add(table, RequestKind.SET_MAPPING, mapping="m1")
    table.resolve(old_mapping.ids[0])
    _, named_old = add(table, mapping="m1")
    _, current = add(table, RequestKind.SET_MAPPING, mapping="m2")
    table.resolve(current.ids[0])
    _, named_new = add(table, mapping="m2")
    add(table, RequestKind.STATUS)  # never sent again
    unanswered = table.unanswered()
    assert unanswered == [named_old, named_new]
    assert table.mappings_to_resend(unanswered) == [old_mapping, current]
    table.resolve(named_old.ids[0])
    # m1 is no longer named by anything unanswered, but kept until another mapping is set.
    assert table.mappings_to_resend(table.unanswered()) == [current]
    add(table, RequestKind.SET_MAPPING, mapping="m3")
    assert table.mapping("m1") is None and table.mapping("m2") is current  # m2: named_new still needs it


def test_a_busy_request_is_due_again_after_a_doubling_backoff():
    clock = Clock(100.0)
    table = RequestTable(window=1, clock=clock)
    request_id, waiter = add(table)
    table.busy(request_id)
    assert table.due_again() == []
    clock.now += 0.11
    assert table.due_again() == [waiter]
    assert table.due_again() == []  # once per busy answer
    table.busy(request_id)
    clock.now += 0.11
    assert table.due_again() == []  # 0.2 s the second time
    clock.now += 0.1
    assert table.due_again() == [waiter]


def test_fail_all_settles_every_request_and_frees_the_window():
    table = RequestTable(window=2)
    waiters = [add(table)[1], add(table)[1], add(table, RequestKind.QUERY)[1]]
    table.fail_all(RemoteTargetError("closed"))
    assert all(isinstance(w.future.exception(0), RemoteTargetError) for w in waiters)
    assert table.in_flight == 0
    assert table.add(lambda *_: None, RequestKind.BATCH, timeout_s=0.05) is not None
    assert table.add(lambda *_: None, RequestKind.BATCH, timeout_s=0.05) is not None


def test_adding_from_many_threads_keeps_ids_unique_and_the_count_exact():
    table = RequestTable(window=64)
    ids: list[int] = []
    lock = threading.Lock()

    def many() -> None:
        for _ in range(16):
            request_id, _ = add(table)
            with lock:
                ids.append(request_id)

    threads = [threading.Thread(target=many) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert len(set(ids)) == 64 and table.in_flight == 64 == table.peak_in_flight


def test_a_broker_session_introduces_itself_again_once_per_window():
    clock = Clock(100.0)
    session = BrokerView(clock)
    session.introducing()
    assert not session.may_introduce()  # a hello is on its way
    assert session.welcomed("i1", Liveness(heartbeat_interval_s=0.5, liveness=4))  # a new instance
    assert session.liveness_s == 2.0 and session.may_introduce() and session.instances == ["i1"]
    assert not session.restarted("i1") and session.restarted("i2")
    clock.now += 1.9
    assert session.silence() is None
    clock.now += 0.2
    assert session.silence() == "silent for 2.1 s (liveness period 2.0 s)"
    session.introducing()
    clock.now += 1.0
    assert not session.may_introduce()  # unanswered for less than a window
    clock.now += 1.0
    assert session.may_introduce()  # unanswered for a window: another may go
    assert not session.welcomed("i1", Liveness(heartbeat_interval_s=0.5, liveness=4))  # the same instance again


def test_every_rank_setting_is_a_remote_target_parameter_with_the_settings_default():
    """RemoteTarget passes its parameters to RankSettings by name: a setting it lacks would silently keep its default."""
    import inspect

    from draftfeed.producers.settings import RankSettings
    from draftfeed.producers.tasks.base import RemoteTarget

    parameters = inspect.signature(RemoteTarget.__init__).parameters
    for name, field in RankSettings.model_fields.items():
        assert name in parameters, f"RankSettings.{name} is not a parameter of RemoteTarget"
        assert parameters[name].default == field.default, f"{name}: RemoteTarget says {parameters[name].default!r}, RankSettings {field.default!r}"
