"""A rank process that saves its iterator's state after step k and is SIGKILLed, and a new process that resumes
from that state, together see the uninterrupted epoch: the same batches in the same order, each with the contract's
supervision (checked in each process against the in-process reference); also with a worker killed and the broker
restarted in between, and with a cache store, whose resumed run asks workers only for what was not recorded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import WORKER_ENV, add_service, wait_until
from resume_rank import digest, make_loader
from support.lines import wait_for_line

from draftfeed.processes import commands
from draftfeed.store.index import IndexFile

pytestmark = [pytest.mark.timeout(300), pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")]
SERVICE = "resume"
BATCHES = 12  # resume_rank's epoch
LINE_TIMEOUT_S = 120.0  # a rank's start, or its whole run: seconds here, but CI machines run other suites beside


@pytest.fixture(scope="module")
def services(cluster, tiny_target):
    return add_service(cluster, tiny_target, SERVICE)


def uninterrupted(num_workers: int, shuffle: bool) -> list[str]:
    """The epoch's batches in the dataloader's order, iterated here."""
    return [digest(batch) for batch in make_loader(num_workers, shuffle)]


def start_rank(cluster, tiny_target, *args: str) -> commands.Process:
    base = ["--broker", cluster.frontend, "--service", SERVICE, "--target", str(tiny_target)]
    return commands.start([*base, *args], module="resume_rank", env=WORKER_ENV, ready_timeout_s=LINE_TIMEOUT_S)


def batches_seen(rank: commands.Process) -> list[tuple[int, str]]:
    """(index in the epoch, digest) of each batch the rank printed; every one's supervision equal to the reference."""
    seen = []
    for line in rank.log_tail:
        if line.startswith("BATCH "):
            _, index, batch, verdict = line.split(" ", 3)
            assert verdict == "OK", f"batch {index} ({batch}): {verdict}"
            seen.append((int(index), batch))
    return seen


def stop(cluster, tiny_target, state_dir: Path, checkpoints: str, *args: str) -> list[tuple[int, str]]:
    """A rank that saves its state after each step of ``checkpoints`` and is SIGKILLed after the last, its batches
    in flight; the batches it yielded."""
    rank = start_rank(cluster, tiny_target, "--checkpoint-at", checkpoints, "--state-dir", str(state_dir), *args)
    try:
        wait_for_line(rank, r"^STOPPED$", timeout_s=LINE_TIMEOUT_S)
        rank.kill()
        return batches_seen(rank)
    finally:
        rank.kill()


def resume(cluster, tiny_target, state: Path, *args: str) -> tuple[list[tuple[int, str]], dict]:
    """A new rank resumed from ``state`` to the end of the epoch: its batches and its DONE line."""
    rank = start_rank(cluster, tiny_target, "--resume", str(state), *args)
    try:
        line = wait_for_line(rank, r"^DONE ", timeout_s=LINE_TIMEOUT_S)
        assert rank.popen.wait(30) == 0
    finally:
        rank.kill()
    done = json.loads(line[len("DONE ") :])
    assert done["error"] is None, done["error"]
    return batches_seen(rank), done


def assert_same_epoch(before: list[tuple[int, str]], after: list[tuple[int, str]], k: int, expected: list[str]) -> None:
    """The first run's batches 0..k then the resumed run's equal the uninterrupted epoch, numbered alike."""
    joined = [batch for index, batch in before if index <= k] + [batch for _, batch in after]
    wrong = [i for i, (got, want) in enumerate(zip(joined, expected)) if got != want]
    assert len(joined) == len(expected) and not wrong, (
        f"stopped after batch {k}: {len(joined)} batches of {len(expected)}, differing from the uninterrupted epoch at {wrong}"
    )
    numbered = [index for index, _ in before if index <= k] + [index for index, _ in after]
    assert numbered == list(range(len(expected))), f"batches_yielded numbered them {numbered}"


@pytest.mark.parametrize("k", [0, 5, BATCHES - 2], ids=["start", "middle", "one-before-the-end"])
def test_a_killed_rank_resumed_from_its_state_sees_the_uninterrupted_epoch(services, tiny_target, tmp_path, k):
    loader_args = ["--num-workers", "2", "--shuffle"]
    before = stop(services, tiny_target, tmp_path, str(k), *loader_args)
    after, _ = resume(services, tiny_target, tmp_path / f"state-{k}.pt", *loader_args)
    assert_same_epoch(before, after, k, uninterrupted(2, shuffle=True))


def test_a_resume_after_a_worker_was_killed_and_the_broker_restarted(services, tiny_target, tmp_path):
    k = 4
    before = stop(services, tiny_target, tmp_path, str(k))
    for worker in services.workers:
        worker.kill()
    services.broker.kill()
    services.restart_broker()
    fresh = f"{SERVICE}-{len(services.workers)}"  # a name of its own: the killed workers stay in the fixture's list
    services.add_worker(tiny_target, "--service", SERVICE, "--name", fresh)
    after, _ = resume(services, tiny_target, tmp_path / f"state-{k}.pt")
    assert_same_epoch(before, after, k, uninterrupted(0, shuffle=False))
    # The broker counts a batch when the worker's done reaches it, which may come after the rank had the batch.
    wait_until(
        lambda: (services.worker_status(fresh) or {}).get("batches") == BATCHES - k - 1, timeout_s=30, what=f"{fresh} to serve the resumed batches"
    )


def test_a_cache_store_resumed_asks_workers_only_for_what_was_not_recorded(services, tiny_target, tmp_path):
    """Checkpoints after steps 3 and 6, killed after 6, resumed from 3 (the later checkpoint lost): batches 4..6 were
    recorded before the stop and are asked for again; they, and those in flight recorded in time, come from the store."""
    k, later = 3, 6
    store = ["--store", str(tmp_path / "store"), "--store-mode", "cache"]
    before = stop(services, tiny_target, tmp_path, f"{k},{later}", *store)
    recorded, problems = IndexFile(tmp_path / "store").read_new()
    keys = [batch.key for record in recorded for batch in record.batches]
    assert not problems and len(set(keys)) == len(keys)
    written = len(keys)  # batches 0 .. later for sure (each state taken writes the store), and those in flight written in time
    assert later + 1 <= written <= later + 1 + 4, written
    after, done = resume(services, tiny_target, tmp_path / f"state-{k}.pt", *store)
    assert_same_epoch(before, after, k, uninterrupted(0, shuffle=False))
    hits, misses = done["store"]["hits"], done["store"]["misses"]
    assert (hits, misses) == (written - (k + 1), BATCHES - written), done
    assert done["submitted"] == misses, f"the broker took {done['submitted']} batches of the resumed rank to workers; {misses} were not recorded"
    recorded, problems = IndexFile(tmp_path / "store").read_new()
    assert not problems and len({batch.key for record in recorded for batch in record.batches}) == BATCHES
