"""The supervision store: record, replay and cache give the live supervision bit for bit; a store of another
target is refused; a killed recorder, ranks recording side by side and a full disk leave a store that is right."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import WORKER_ENV, add_service, assert_supervision_equal, make_batch, reference_dspark, reference_eagle3
from rank_process import rank_batches
from reference import difference, draft_vocab, make_packed_batch
from support import preload
from support.lines import wait_for_line

from draftfeed import RemoteDSparkTarget, RemoteEagle3Target
from draftfeed.processes import commands
from draftfeed.store.errors import BatchNotInStore, StoreError, StoreWriteError
from draftfeed.store.index import IndexFile, ShardRecord
from draftfeed.store.shards import UNFINISHED_SUFFIX

pytestmark = pytest.mark.timeout(240)
AUX = [1, 3, 4]
DSPARK_LAYERS = [1, 3, 4, 6, 7]
FORMS = ["probs", "probs-bf16", "hidden"]


def store_command(*args: str) -> subprocess.CompletedProcess:
    """``draftfeed store ARGS`` to its end, forked from the suite's preloader (its imports are torch's)."""
    return preload.run_module("draftfeed", ["store", *args], {**os.environ, **WORKER_ENV}, timeout_s=60)


@pytest.fixture(scope="module")
def services(cluster, tiny_target):
    for form in FORMS:
        add_service(cluster, tiny_target, form, "--supervision", form)
    add_service(cluster, tiny_target, "dspark", "--task", "dspark", "--target-layer-ids", ",".join(map(str, DSPARK_LAYERS)))
    return cluster


def epoch(seed: int, count: int = 5) -> list[dict[str, torch.Tensor]]:
    return [make_batch(2, 12 + 3 * i, 1000, seed=seed + i) for i in range(count)]


def copied(supervision):
    return type(supervision)(**{name: tensor.clone() for name, tensor in supervision.as_dict().items()})


def assert_same(got, expected, where: str) -> None:
    problems = [p for name, tensor in expected.as_dict().items() if (p := difference(name, got.as_dict()[name], tensor)) is not None]
    assert set(got.as_dict()) == set(expected.as_dict()), where
    assert not problems, f"{where}: " + "; ".join(problems)


@pytest.mark.parametrize("form", FORMS)
def test_replay_and_cache_hits_equal_the_live_supervision(services, tiny_model, tmp_path, form):
    batches = epoch(100)
    mapping = draft_vocab(200) if form != "hidden" else None  # the compact form with the identity mapping is exact
    record_path, cache_path = tmp_path / "recorded", tmp_path / "cached"
    with RemoteEagle3Target(services.frontend, form, prefetch_depth=2, store=record_path, store_mode="record", store_shard_bytes=4096) as target:
        if mapping is not None:
            target.set_vocab_mapping(*mapping)
        live = []
        for _batch, supervision in target.iterate(batches):
            live.append(copied(supervision))
            supervision.aux_hidden_states.add_(1.0)  # a loop that changes its supervision in place: the store keeps its own copy
    if form == "probs":  # the live answers themselves are the contract's
        for batch, supervision in zip(batches, live):
            assert_supervision_equal(supervision, reference_eagle3(tiny_model, batch, AUX, *(mapping or ())))

    with RemoteEagle3Target(None, form, prefetch_depth=2, store=record_path, store_mode="replay") as replay:
        assert replay.model_info().aux_layer_ids == AUX
        if mapping is not None:
            replay.set_vocab_mapping(*mapping)
        replayed = list(replay.iterate(batches))
        assert [batch for batch, _ in replayed] == batches  # in the dataloader's order
        for index, ((_, supervision), expected) in enumerate(zip(replayed, live)):
            assert_same(supervision, expected, f"replayed batch {index}")
        one = replay.generate_batch(**batches[3])
        assert_same(one, live[3], "generate_batch in replay")
        assert_same(replay.generate_batch_async(**batches[1]).result(timeout=30), live[1], "generate_batch_async in replay")

    with RemoteEagle3Target(services.frontend, form, prefetch_depth=2, store=cache_path, store_mode="cache") as cached:
        if mapping is not None:
            cached.set_vocab_mapping(*mapping)
        first = [supervision for _, supervision in cached.iterate(batches)]
        second = [supervision for _, supervision in cached.iterate(batches)]
        store = cached.status()["store"]
        sample = cached.metrics.registry.get_sample_value
        labels = {"rank": cached.rank_id, "service": form}
        counted = [sample("draftfeed_rank_store_batches_total", {**labels, "source": source}) for source in ("workers", "store")]
    assert (store["misses"], store["hits"]) == (len(batches), len(batches)), store
    assert counted == [len(batches), len(batches)], counted
    for index, (a, b, expected) in enumerate(zip(first, second, live)):
        assert_same(a, expected, f"computed batch {index} of the cache's first epoch")
        assert_same(b, expected, f"cached batch {index} of its second epoch")


def test_dspark_replays_bit_for_bit_with_no_broker(services, tiny_model, tmp_path):
    batches = epoch(200, count=4)
    with RemoteDSparkTarget(services.frontend, "dspark", store=tmp_path, store_mode="record") as target:
        weight = target.get_input_embeddings().weight.clone()
        live = [supervision for _, supervision in target.iterate(batches)]
    for batch, supervision in zip(batches, live):
        assert_supervision_equal(supervision, reference_dspark(tiny_model, batch, DSPARK_LAYERS))
    with RemoteDSparkTarget(services.frontend, "dspark", store=tmp_path, store_mode="record") as again:
        for _ in again.iterate(batches):  # a second epoch in record mode is computed, and not written twice
            pass
    assert IndexFile(tmp_path).read_new()[0][0].batches and sum(len(r.batches) for r in IndexFile(tmp_path).read_new()[0]) == len(batches)
    info = store_command("info", str(tmp_path))
    assert "form: hidden states (the one form of DSpark)" in info.stdout, info.stdout
    with RemoteDSparkTarget(None, "dspark", store=tmp_path, store_mode="replay") as replay:
        assert torch.equal(replay.get_input_embeddings().weight, weight)  # recorded with the batches
        for index, ((_, supervision), expected) in enumerate(zip(replay.iterate(batches), live)):
            assert_same(supervision, expected, f"replayed DSpark batch {index}")
        with pytest.raises(Exception, match="holds no output embeddings"):
            replay.get_output_embeddings()
        with pytest.raises(ValueError, match="holds dspark supervision"):
            RemoteEagle3Target(None, "dspark", store=tmp_path, store_mode="replay").model_info()


def test_packed_batches_are_cached_by_their_documents_and_dspark_caches_too(services, tmp_path):
    packed = make_packed_batch([[12, 9, 16], [40]], pad=[3, 0], vocab_size=1000, seed=1)
    # The same tokens cut into other documents: another batch, with other supervision.
    recut = {**packed, "seq_lens": torch.tensor([[21, 19, 0], [40, 0, 0]]), "position_ids": None, "doc_remaining": None}
    recut["position_ids"] = torch.cat([torch.arange(21), torch.arange(19)]).unsqueeze(0).repeat(2, 1)
    recut["position_ids"][1] = torch.arange(40)
    with RemoteEagle3Target(services.frontend, "probs", store=tmp_path / "eagle3", store_mode="cache") as target:
        computed = [copied(target.generate_batch(**batch)) for batch in (packed, recut)]
        again = [target.generate_batch(**batch) for batch in (packed, recut)]
        store = target.status()["store"]
    assert (store["misses"], store["hits"]) == (2, 2), store
    assert not torch.equal(computed[0].target_probs, computed[1].target_probs)
    assert torch.equal(again[0].doc_remaining, packed["doc_remaining"]) and again[1].doc_remaining is None  # the rank's own, as given
    for index, (first, second) in enumerate(zip(computed, again)):
        assert_same(second, first, f"cached packed batch {index}")

    batches = epoch(600, count=3)
    with RemoteDSparkTarget(services.frontend, "dspark", store=tmp_path / "dspark", store_mode="cache") as target:
        first = [copied(supervision) for _, supervision in target.iterate(batches)]
        second = [supervision for _, supervision in target.iterate(batches)]
        store = target.status()["store"]
    assert (store["misses"], store["hits"]) == (3, 3), store
    for index, (a, b) in enumerate(zip(first, second)):
        assert_same(b, a, f"cached DSpark batch {index}")


def test_a_store_of_another_target_mapping_or_form_is_refused_naming_the_fields(services, tmp_path):
    batch = make_batch(2, 10, 1000, seed=300)
    with RemoteEagle3Target(services.frontend, "probs", store=tmp_path, store_mode="record") as target:
        target.generate_batch(**batch)
    with RemoteEagle3Target(services.frontend, "hidden", store=tmp_path, store_mode="cache") as other_form:
        with pytest.raises(StoreError, match=r"forms: this rank \['hidden'\], the store \['probs'\]"):
            other_form.generate_batch(**batch)
    with RemoteEagle3Target(services.frontend, "probs", store=tmp_path, store_mode="cache") as other_mapping:
        other_mapping.set_vocab_mapping(*draft_vocab(100))
        with pytest.raises(StoreError, match=r"mapping_digest: this rank '[0-9a-f]+', the store None"):
            other_mapping.generate_batch(**batch)
    with RemoteDSparkTarget(services.frontend, "dspark", store=tmp_path, store_mode="cache") as other_task:
        with pytest.raises(StoreError, match=r"task: this rank 'dspark', the store 'eagle3'"):
            other_task.generate_batch(**batch)
    with RemoteEagle3Target(None, "probs", store=tmp_path, store_mode="replay") as replay:
        replay.set_vocab_mapping(*draft_vocab(100))
        with pytest.raises(StoreError, match="mapping_digest"):
            replay.generate_batch(**batch)


def test_replay_of_a_batch_not_recorded_names_its_key_and_needs_no_broker(services, tmp_path):
    recorded = make_batch(2, 10, 1000, seed=400)
    with RemoteEagle3Target(services.frontend, "probs", store=tmp_path, store_mode="record") as target:
        target.generate_batch(**recorded)
    with RemoteEagle3Target(None, "probs", store=tmp_path, store_mode="replay") as replay:
        replay.generate_batch(**recorded)
        with pytest.raises(BatchNotInStore, match=r"batch [0-9a-f]{32} is not in the store at .*store_mode='cache'"):
            replay.generate_batch(**make_batch(2, 10, 1000, seed=401))
        assert replay.data_endpoint == "" and replay.status()["store"]["hits"] == 1
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("")
    with pytest.raises(StoreWriteError, match=f"cannot create the store folder {not_a_folder}"):  # before any broker is asked
        RemoteEagle3Target("tcp://127.0.0.1:9", "probs", store=not_a_folder, store_mode="record", connect_timeout=600)
    with pytest.raises(StoreError, match="there is no store at"):
        RemoteEagle3Target(None, "probs", store=tmp_path / "absent", store_mode="replay")
    with pytest.raises(ValueError, match="broker=None works only with store_mode='replay'"):
        RemoteEagle3Target(None, "probs", store=tmp_path, store_mode="cache")
    with pytest.raises(ValueError, match="store_mode='replay' needs store=PATH"):
        RemoteEagle3Target(None, "probs", store_mode="replay")


def start_recording_rank(cluster, tiny_target, store: Path, seed: int, batches: int, shard_bytes: int, extra=()) -> commands.Process:
    args = ["--broker", cluster.frontend, "--service", "probs", "--target", str(tiny_target), "--batches", str(batches), "--depth", "2"]
    args += ["--seed", str(seed), "--store", str(store), "--store-mode", "record", "--store-shard-bytes", str(shard_bytes), *extra]
    return commands.start(args, module="rank_process", env=WORKER_ENV)


def test_a_killed_recording_rank_leaves_a_store_with_every_finished_shard_and_nothing_else(services, tiny_target, tiny_model, tmp_path):
    rank = start_recording_rank(services, tiny_target, tmp_path, seed=6000, batches=400, shard_bytes=300_000)  # 2 batches a shard
    try:
        wait_for_line(rank, r"^batch 40$", timeout_s=120)
        rank.kill()
    finally:
        rank.stop(timeout_s=5)
    batches = rank_batches(6000, 400)
    with RemoteEagle3Target(None, "probs", store=tmp_path, store_mode="replay") as replay:

        def replayed(batch: dict) -> bool:
            try:
                replay.generate_batch(**batch)
            except BatchNotInStore:
                return False
            return True

        held = [i for i, batch in enumerate(batches) if replayed(batch)]
        stored = replay.status()["store"]["batches"]
        assert 30 <= len(held) < 400 and stored == len(held), (len(held), stored)
        assert held == list(range(len(held))) and len(held) % 2 == 0, held  # whole shards, in the order recorded
        for batch, supervision in replay.iterate(batches[: len(held)]):
            assert_supervision_equal(supervision, reference_eagle3(tiny_model, batch, AUX))
    verify = store_command("verify", str(tmp_path))
    assert verify.returncode == 0, verify.stdout + verify.stderr
    assert f"{len(held)} batches" in verify.stdout


def test_a_rank_that_never_closes_its_target_writes_its_last_shard_at_exit(services, tiny_target, tmp_path):
    rank = start_recording_rank(services, tiny_target, tmp_path, seed=6500, batches=5, shard_bytes=1 << 30, extra=["--leave-open"])
    try:
        result = json.loads(wait_for_line(rank, "^RESULT ", timeout_s=120)[len("RESULT ") :])
        assert rank.popen.wait(60) == 0
    finally:
        rank.stop(timeout_s=5)
    assert result["error"] is None and result["received"] == 5, result
    records, problems = IndexFile(tmp_path).read_new()
    assert problems == [] and [len(record.batches) for record in records] == [5]  # one shard, written as the process ended


def test_ranks_recording_side_by_side_share_one_store(services, tiny_target, tiny_model, tmp_path):
    ranks = [start_recording_rank(services, tiny_target, tmp_path, seed=seed, batches=12, shard_bytes=30_000) for seed in (7000, 8000)]
    try:
        results = [json.loads(wait_for_line(rank, "^RESULT ", timeout_s=180)[len("RESULT ") :]) for rank in ranks]
    finally:
        for rank in ranks:
            rank.stop(timeout_s=5)
    for result in results:
        assert result["error"] is None and result["differences"] == [] and result["received"] == 12, result
    writers = {path.name for path in (tmp_path / "shards").iterdir()}
    assert len(writers) == 2, writers  # one shard set per rank
    records, problems = IndexFile(tmp_path).read_new()
    assert problems == [] and {record.writer for record in records} == writers
    both = rank_batches(7000, 12) + rank_batches(8000, 12)
    with RemoteEagle3Target(None, "probs", store=tmp_path, store_mode="replay") as replay:
        for batch, supervision in replay.iterate(both):
            assert_supervision_equal(supervision, reference_eagle3(tiny_model, batch, AUX))


def test_store_info_and_verify_report_a_damaged_shard(services, tmp_path):
    with RemoteEagle3Target(services.frontend, "hidden", store=tmp_path, store_mode="record", store_shard_bytes=4096) as target:
        for _ in target.iterate(epoch(500, count=3)):
            pass
    info = store_command("info", str(tmp_path))
    assert info.returncode == 0, info.stderr
    tokens = sum(int(batch["attention_mask"].sum()) for batch in epoch(500, count=3))
    assert "batches: 3" in info.stdout and f"tokens: {tokens}" in info.stdout and "form: hidden" in info.stdout, info.stdout
    assert "aux_layer_ids=[1, 3, 4]" in info.stdout, info.stdout
    shard = sorted((tmp_path / "shards").rglob("*.safetensors"))[1]
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0xFF
    shard.write_bytes(bytes(data))
    verify = store_command("verify", str(tmp_path))
    assert verify.returncode == 1, verify.stdout
    assert f"{shard.relative_to(tmp_path)}: its sha256 is not the one in the index" in verify.stdout + verify.stderr
    missing = store_command("info", str(tmp_path / "nope"))
    assert missing.returncode == 2 and "there is no store at" in missing.stderr and "Traceback" not in missing.stderr


def test_an_index_line_cut_short_is_skipped_and_the_next_starts_afresh(tmp_path):
    index = IndexFile(tmp_path)
    record = ShardRecord(shard="shards/w/000000.safetensors", size=1, sha256="0" * 64, writer="w", batches=[])
    index.append(record)
    with open(index.path, "ab") as file:
        file.write(b'1234abcd {"shard": "shards/w/0000')  # a writer killed mid-line
    assert index.read_new() == ([record], [])  # the cut line is not complete: not read yet
    index.append(record.model_copy(update={"shard": "shards/w/000001.safetensors"}))
    records, problems = IndexFile(tmp_path).read_new()
    assert [r.shard for r in records] == ["shards/w/000000.safetensors", "shards/w/000001.safetensors"]
    assert len(problems) == 1 and "checksum does not match" in problems[0], problems


@pytest.fixture
def small_disk(tmp_path):
    """A real full disk: a 256 KiB tmpfs (needs root; skipped, saying so, where mounting is not allowed)."""
    folder = tmp_path / "disk"
    folder.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(folder)], capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {mounted.stderr.strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)


def test_a_full_disk_is_an_error_naming_the_path_and_the_batches_stay_right(services, tiny_model, small_disk):
    batches = [make_batch(2, 20, 1000, seed=900 + i) for i in range(12)]  # about 190 KB each: the disk holds one
    store = small_disk / "store"
    with pytest.raises(StoreWriteError, match=rf"{store}.*(No space left|full)"):
        with RemoteEagle3Target(services.frontend, "probs", store=store, store_mode="record", store_shard_bytes=100_000) as target:
            for batch, supervision in target.iterate(batches):
                assert_supervision_equal(supervision, reference_eagle3(tiny_model, batch, AUX))
    assert not list(store.rglob(f"*{UNFINISHED_SUFFIX}")), "an unfinished shard was left"
    assert os.listdir(store / "shards")
