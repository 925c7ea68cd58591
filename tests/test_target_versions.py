"""Versioned target weights, updated in place (issue 48), through a real broker, worker and rank: a worker serving
version 0 of the tiny target loads a "policy step" (a seeded change of some of its tensors, as a safetensors file)
when ``draftfeed target update`` says so, and serves version 1 from then on, without a restart; every batch says the
version that computed it and equals an in-process target holding exactly that version's weights, bit for bit; a rank
that asks for version 1 or newer never gets an older one. A bad update (a wrong shape, a wrong dtype, a name the target
lacks, NaN) is refused in one line naming the tensor, and the worker serves on at its version."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from conftest import WORKER_ENV, add_service, make_batch, wait_until
from reference import difference_at_real
from safetensors.torch import save_file

from draftfeed import RemoteDSparkTarget
from draftfeed.consumers.engines.hf import HFEngine
from draftfeed.consumers.tasks.dspark import DSparkTask
from draftfeed.consumers.weight_updates import apply_update
from draftfeed.target_updates import update_target

pytestmark = pytest.mark.timeout(240)

LAYER_IDS = [1, 3, 7]
SERVICE = "versioned"


def policy_step(engine: HFEngine, seed: int) -> dict[str, torch.Tensor]:
    """A subset of the target's tensors changed by a seeded delta, as an RL step changes its policy."""
    generator = torch.Generator().manual_seed(seed)
    weights = engine.named_weights()
    return {
        name: held + 0.05 * torch.randn(held.shape, generator=generator)
        for name, held in weights.items()
        if ".layers.2." in name or ".layers.5." in name
    }


@pytest.fixture(scope="module")
def versioned(cluster, tiny_target):
    add_service(cluster, tiny_target, SERVICE, "--task", "dspark", "--target-layer-ids", ",".join(map(str, LAYER_IDS)), "--target-version", "0")
    return cluster


def supervise_locally(task: DSparkTask, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return task.compute(batch["input_ids"], batch["attention_mask"], batch["loss_mask"])


def assert_equal(supervision, want: dict[str, torch.Tensor], batch: dict[str, torch.Tensor]) -> None:
    problems = [difference_at_real(name, getattr(supervision, name), want[name], batch["attention_mask"]) for name in want]
    assert [p for p in problems if p] == []


def test_an_update_in_place_serves_the_new_version_exactly_and_labels_every_batch(versioned, tiny_target, tmp_path):
    local = HFEngine(str(tiny_target), device="cpu", dtype="float32")
    task = DSparkTask(local, target_layer_ids=LAYER_IDS)
    step = policy_step(local, seed=1)
    save_file(step, str(tmp_path / "step1.safetensors"))
    batches = [make_batch(2, 20, 1000, seed=seed) for seed in range(6)]
    with RemoteDSparkTarget(versioned.frontend, SERVICE, prefetch_depth=2, min_target_version=0) as target:
        for batch, supervision in target.iterate(batches[:2]):
            assert supervision.target_version == 0
            assert_equal(supervision, supervise_locally(task, batch), batch)
        # the CLI, as a policy trainer's script would run it
        command = [sys.executable, "-m", "draftfeed", "target", "update", "--broker", versioned.frontend, "--service", SERVICE]
        done = subprocess.run(
            [*command, "--weights", str(tmp_path / "step1.safetensors"), "--version", "1"],
            env={**WORKER_ENV, "PATH": ""},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == f"{SERVICE}-0: updated, serves version 1", done.stdout
        apply_update(local.named_weights(), step)  # the in-process target at version 1
        assert target.worker_versions() == {f"{SERVICE}-0": 1}
        for batch, supervision in target.iterate(batches[2:], min_target_version=1):
            assert supervision.target_version == 1
            assert_equal(supervision, supervise_locally(task, batch), batch)
    status = versioned.status()["services"][SERVICE]["workers"][0]
    assert (status["target_version"], status["checkpoint"]) == (1, str(tmp_path / "step1.safetensors"))


BAD_UPDATES = [
    (lambda t: {**t, "model.layers.2.mlp.down_proj.weight": torch.zeros(3, 3)}, "tensor model.layers.2.mlp.down_proj.weight: shape [3, 3]"),
    (lambda t: {k: v.double() for k, v in t.items()}, "dtype torch.float64, the target's is torch.float32"),
    (lambda t: {**t, "model.layers.2.mlp.no_such.weight": torch.zeros(1)}, "tensor model.layers.2.mlp.no_such.weight: the target has no tensor"),
    (lambda t: {k: v.clone().fill_(float("nan")) for k, v in t.items()}, "holds NaN or Inf"),
]


def test_a_bad_update_is_refused_naming_the_tensor_and_the_worker_serves_on(versioned, tiny_target, tmp_path):
    """A wrong shape, a wrong dtype, a name the target lacks, NaN: each refused in one line naming the tensor."""
    local = HFEngine(str(tiny_target), device="cpu", dtype="float32")
    before = versioned.status()["services"][SERVICE]["workers"][0]["target_version"]
    for number, (spoil, named) in enumerate(BAD_UPDATES):
        save_file(spoil(policy_step(local, seed=9)), str(tmp_path / f"bad{number}.safetensors"))
        report = update_target(versioned.frontend, SERVICE, str(tmp_path / f"bad{number}.safetensors"), before + 1, timeout_s=60)
        (result,) = report.workers
        assert not result.ok and result.target_version == before and named in result.message, result
        assert "\n" not in result.message
    with RemoteDSparkTarget(versioned.frontend, SERVICE, prefetch_depth=1) as target:
        batch = make_batch(1, 12, 1000, seed=3)
        assert target.generate_batch(**batch).target_version == before


def test_a_policy_trainer_publishes_each_step_from_its_memory_and_every_batch_is_exact_at_its_version(versioned, tiny_target):
    """The test is the policy trainer: each step it changes two layers (seeded) and publishes them as the next version
    from its memory (``publish_weights``, in pieces of 4 KiB, read over NIXL where installed); the rank asks for that version or
    newer, and every batch it gets says it and equals an in-process target holding exactly those weights."""
    from draftfeed import publish_weights

    local = HFEngine(str(tiny_target), device="cpu", dtype="float32")
    task = DSparkTask(local, target_layer_ids=LAYER_IDS)
    original = {name: tensor.clone() for name, tensor in local.named_weights().items()}
    version = versioned.status()["services"][SERVICE]["workers"][0]["target_version"]
    with RemoteDSparkTarget(versioned.frontend, SERVICE, prefetch_depth=2) as target:
        for step in range(1, 4):
            version += 1
            generator = torch.Generator().manual_seed(100 + step)
            changed = {
                name: original[name] + 0.05 * torch.randn(original[name].shape, generator=generator)
                for name in original
                if ".layers.2." in name or ".layers.5." in name
            }
            report = publish_weights(versioned.frontend, SERVICE, changed, version, chunk_bytes=4096, timeout_s=120)
            assert [(r.ok, r.target_version) for r in report.workers] == [(True, version)], report
            apply_update(local.named_weights(), changed)
            batches = [make_batch(2, 16, 1000, seed=10 * step + i) for i in range(2)]
            for batch, supervision in target.iterate(batches, min_target_version=version):
                assert supervision.target_version == version
                assert_equal(supervision, supervise_locally(task, batch), batch)


def test_a_publish_over_a_gloo_pair_group_serves_the_new_version_exactly(versioned, tiny_target, monkeypatch):
    """``publish_weights(pair=True)`` with host tensors: the worker (on this machine) takes the pieces over a gloo pair
    group of its own, asking the socket for no piece, and every batch at the new version is exact."""
    from draftfeed import publish_weights
    from draftfeed.dataplane.weights import publisher as publishing
    from draftfeed.schemas.frames import unpack
    from draftfeed.schemas.messages import WEIGHTS_INBOUND

    local = HFEngine(str(tiny_target), device="cpu", dtype="float32")
    task = DSparkTask(local, target_layer_ids=LAYER_IDS)
    version = versioned.status()["services"][SERVICE]["workers"][0]["target_version"] + 1
    seen: list[str] = []
    answer = publishing.WeightsPublisher._answer

    def counted(publisher, peer, frames):
        seen.append(unpack(frames, WEIGHTS_INBOUND)[0].what)
        answer(publisher, peer, frames)

    monkeypatch.setattr(publishing.WeightsPublisher, "_answer", counted)
    step = policy_step(local, seed=9)
    report = publish_weights(versioned.frontend, SERVICE, step, version, chunk_bytes=4096, timeout_s=120, nixl=False, pair=True)
    assert [(r.ok, r.target_version) for r in report.workers] == [(True, version)], report
    assert seen.count("pair") == 1 and "piece" not in seen, seen
    apply_update(local.named_weights(), step)
    batches = [make_batch(2, 16, 1000, seed=70 + i) for i in range(2)]
    with RemoteDSparkTarget(versioned.frontend, SERVICE, prefetch_depth=2, min_target_version=version) as target:
        for batch, supervision in target.iterate(batches):
            assert supervision.target_version == version
            assert_equal(supervision, supervise_locally(task, batch), batch)


def test_a_published_update_is_checked_before_any_byte_and_one_broken_off_makes_the_worker_leave(versioned, cluster, tiny_target):
    """A wrong shape announced by the publisher: refused before any byte is written, the worker serves on at its
    version. A publisher that stops answering after some pieces were written: the worker holds a mixture of versions,
    so it says why and leaves (its own service here), and the broker serves nothing from it again. (Pieces as frames
    here: the test stops the socket's answers; NIXL reads are tests/test_weights_plane.py's.)"""
    from draftfeed import publish_weights
    from draftfeed.dataplane.weights import publisher as publishing

    local = HFEngine(str(tiny_target), device="cpu", dtype="float32")
    before = versioned.status()["services"][SERVICE]["workers"][0]["target_version"]
    wrong = {"model.layers.2.mlp.down_proj.weight": torch.zeros(3, 3)}
    (result,) = publish_weights(versioned.frontend, SERVICE, wrong, before + 1, timeout_s=60).workers
    assert not result.ok and result.target_version == before and "tensor model.layers.2.mlp.down_proj.weight: shape [3, 3]" in result.message

    add_service(cluster, tiny_target, "breaks", "--task", "dspark", "--target-layer-ids", ",".join(map(str, LAYER_IDS)), "--update-timeout", "2")
    answer = publishing.WeightsPublisher._answer
    answered: list[int] = []

    def stop_after_three_pieces(self, peer, frames):  # the trainer's process hangs partway
        if len(answered) < 4:
            answered.append(1)
            answer(self, peer, frames)

    publishing.WeightsPublisher._answer = stop_after_three_pieces
    try:
        step = {name: tensor + 1 for name, tensor in local.named_weights().items() if ".layers.2." in name}
        (result,) = publish_weights(cluster.frontend, "breaks", step, 1, chunk_bytes=4096, timeout_s=120, nixl=False).workers
    finally:
        publishing.WeightsPublisher._answer = answer
    assert not result.ok and result.target_version == 0, result
    assert "did not answer" in result.message and "already written: the worker holds a mixture of versions; it leaves" in result.message
    wait_until(
        lambda: "breaks" not in cluster.status()["services"] or not cluster.status()["services"]["breaks"]["workers"], 30, "the worker to leave"
    )


def test_a_worker_killed_mid_update_costs_the_run_nothing_and_an_old_replacement_waits_for_its_update(fast_cluster, tiny_target, tmp_path):
    """Two workers pull a published update; once both have written part of it, one is SIGKILLed. The report says it
    left; the other serves the new version, and a rank asking for it gets every batch once, in order, exact at that
    version. A replacement started from the old checkpoint (version 0) is given none of those requests until it is
    updated from a file; then it serves them too."""
    import threading

    from draftfeed import publish_weights
    from draftfeed.dataplane.weights import publisher as publishing
    from draftfeed.schemas.frames import unpack
    from draftfeed.schemas.messages import WEIGHTS_INBOUND

    flags = ("--task", "dspark", "--target-layer-ids", ",".join(map(str, LAYER_IDS)))
    doomed = fast_cluster.add_worker(tiny_target, "--service", "mid", *flags, "--name", "doomed")
    fast_cluster.add_worker(tiny_target, "--service", "mid", *flags, "--name", "survivor")
    local = HFEngine(str(tiny_target), device="cpu", dtype="float32")
    task = DSparkTask(local, target_layer_ids=LAYER_IDS)
    step = policy_step(local, seed=5)
    pieces: dict[bytes, int] = {}
    both_writing, killed = threading.Event(), threading.Event()
    answer = publishing.WeightsPublisher._answer

    def gated(self, peer, frames):  # once each worker has had a piece, hold every answer until one worker is dead
        if unpack(frames, WEIGHTS_INBOUND)[0].what == "piece":
            pieces[peer] = pieces.get(peer, 0) + 1
            if len(pieces) == 2 and min(pieces.values()) >= 2 and not killed.is_set():
                both_writing.set()
                killed.wait(30)
        answer(self, peer, frames)

    publishing.WeightsPublisher._answer = gated
    reports: list = []
    try:
        publishing_thread = threading.Thread(
            target=lambda: reports.append(publish_weights(fast_cluster.frontend, "mid", step, 1, chunk_bytes=4096, timeout_s=120, nixl=False))
        )
        publishing_thread.start()
        assert both_writing.wait(60), "the two workers never both pulled"
        doomed.kill()
        killed.set()
        publishing_thread.join(120)
    finally:
        publishing.WeightsPublisher._answer = answer
        killed.set()
    (report,) = reports
    assert [(r.worker, r.ok, r.target_version) for r in report.workers] == [("doomed", False, 0), ("survivor", True, 1)], report
    apply_update(local.named_weights(), step)
    fast_cluster.add_worker(tiny_target, "--service", "mid", *flags, "--name", "replacement")  # the old checkpoint: version 0
    batches = [make_batch(2, 16, 1000, seed=40 + i) for i in range(6)]
    with RemoteDSparkTarget(fast_cluster.frontend, "mid", prefetch_depth=2, min_target_version=1) as target:
        got = list(target.iterate(batches[:3]))
        served = {w["worker"]: w["batches"] for w in fast_cluster.status()["services"]["mid"]["workers"]}
        assert served["replacement"] == 0, served
        save_file(step, str(tmp_path / "step.safetensors"))
        results = {r.worker: r for r in update_target(fast_cluster.frontend, "mid", str(tmp_path / "step.safetensors"), 1, timeout_s=60).workers}
        assert results["replacement"].ok and not results["survivor"].ok, results  # the survivor serves version 1 already
        got += list(target.iterate(batches[3:]))
    assert [batch["input_ids"].tolist() for batch, _ in got] == [batch["input_ids"].tolist() for batch in batches]
    for batch, supervision in got:
        assert supervision.target_version == 1
        assert_equal(supervision, supervise_locally(task, batch), batch)


def test_a_store_holds_a_batch_at_each_version_and_answers_each_request_from_the_one_it_takes(versioned, tiny_target, tmp_path):
    """A cache filled at version a, then asked for version b (the worker updated): every batch misses, is computed at
    b and recorded beside its a. Replayed with no broker, each request is answered from the version it takes, exact
    and labelled: ``exact a`` from a, ``at-least b`` and no version from b; ``exact b+1`` names the versions held."""
    from draftfeed.store.errors import BatchNotInStore
    from draftfeed.store.inspect import info_lines

    local = HFEngine(str(tiny_target), device="cpu", dtype="float32")
    task = DSparkTask(local, target_layer_ids=LAYER_IDS)
    original = {name: tensor.clone() for name, tensor in local.named_weights().items()}
    save_file(original, str(tmp_path / "original.safetensors"))
    step = policy_step(local, seed=21)
    save_file(step, str(tmp_path / "step.safetensors"))
    a = versioned.status()["services"][SERVICE]["workers"][0]["target_version"] + 1  # earlier tests moved it on
    b = a + 1
    batches = [make_batch(2, 14 + i, 1000, seed=60 + i) for i in range(3)]
    at_a = [supervise_locally(task, batch) for batch in batches]
    apply_update(local.named_weights(), step)
    at_b = [supervise_locally(task, batch) for batch in batches]
    store = tmp_path / "store"

    def check(supervisions, want, version) -> None:
        for batch, supervision, expected in zip(batches, supervisions, want):
            assert supervision.target_version == version
            assert_equal(supervision, expected, batch)

    assert update_target(versioned.frontend, SERVICE, str(tmp_path / "original.safetensors"), a, timeout_s=60).workers[0].ok
    with RemoteDSparkTarget(versioned.frontend, SERVICE, store=store, min_target_version=a) as cached:
        check([sup for _, sup in cached.iterate(batches)], at_a, a)
    assert update_target(versioned.frontend, SERVICE, str(tmp_path / "step.safetensors"), b, timeout_s=60).workers[0].ok
    with RemoteDSparkTarget(versioned.frontend, SERVICE, store=store, min_target_version=b) as cached:
        check([sup for _, sup in cached.iterate(batches)], at_b, b)
        assert (cached.status()["store"]["hits"], cached.status()["store"]["misses"]) == (0, 3)  # a's records do not answer b
        check([sup for _, sup in cached.iterate(batches)], at_b, b)
        assert cached.status()["store"]["hits"] == 3  # b's own, held now
    for wanted, want, version in (
        ({"min_target_version": a, "version_policy": "exact"}, at_a, a),
        ({"min_target_version": b}, at_b, b),
        ({}, at_b, b),
    ):
        with RemoteDSparkTarget(None, SERVICE, store=store, store_mode="replay", **wanted) as replay:
            check([sup for _, sup in replay.iterate(batches)], want, version)
    with RemoteDSparkTarget(None, SERVICE, store=store, store_mode="replay", min_target_version=b + 1, version_policy="exact") as replay:
        with pytest.raises(BatchNotInStore, match=f"at versions {a}, {b} only, and this rank takes version {b + 1} exactly"):
            replay.generate_batch(**batches[0])
    with pytest.raises(ValueError, match="version_policy='latest' with store_mode='cache'"):
        RemoteDSparkTarget(versioned.frontend, SERVICE, store=store, version_policy="latest")
    assert f"target versions: {a} (3 batches), {b} (3 batches)" in info_lines(store)
