"""``draftfeed store export --format speculators``: a store recorded by a RemoteDFlashTarget for speculators' rows
(samples.row_batch) becomes one hs_{i}.safetensors per row of a dataset written by ``datasets``' own save_to_disk, each
equal (torch.equal) to ``samples.to_sample`` of the supervision the rank received; a row the store lacks, a folder with
no store, a store of another task and a missing pyarrow are each one line with no traceback.

``datasets`` and pyarrow are not in the venv: the dataset is written by a subprocess with .nemo-packages on its path,
and the exports run with a path that holds pyarrow alone (the one package the export needs besides draftfeed's).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import add_service
from safetensors.torch import load_file

from draftfeed import RemoteDFlashTarget
from draftfeed.integrations.speculators.samples import row_batch, to_sample
from draftfeed.schemas.errors import UsageError
from draftfeed.schemas.messages import DFlashTargetInfo, Eagle3TargetInfo
from draftfeed.store.export_speculators import export_speculators
from draftfeed.store.identity import StoreIdentity, batch_key
from draftfeed.store.store import read_manifest, write_manifest

pytestmark = pytest.mark.timeout(120)
NEMO_PACKAGES = Path(__file__).resolve().parents[1] / ".nemo-packages"
LAYERS = [1, 3, 7]  # DFlash ids on the 8-layer tiny target: speculators' 2, 4 and 8 (the last layer)
HIDDEN = 64
ROWS = [torch.randint(0, 1000, (length,), generator=torch.Generator().manual_seed(length)) for length in (5, 9, 7, 12)]
UNRECORDED = torch.randint(0, 1000, (6,), generator=torch.Generator().manual_seed(99))

SAVE = """
import json, sys
import datasets, pyarrow as pa
for folder, shards, rows in json.loads(sys.argv[1]):
    table = pa.table({"input_ids": rows, "loss_mask": [[1] * len(r) for r in rows], "seq_len": [len(r) for r in rows]})
    dataset = datasets.Dataset(table, fingerprint="draftfeed-test")  # a given fingerprint: no hashing of the table
    dataset.set_format("torch")
    dataset.save_to_disk(folder, num_shards=shards)
"""


@pytest.fixture(scope="module")
def pyarrow_env(tmp_path_factory) -> dict[str, str]:
    """The environment of an export: pyarrow importable (from .nemo-packages, linked alone), nothing else added. (Not
    this process's sys.path: another module of the suite may have put .nemo-packages on it.)"""
    if not (NEMO_PACKAGES / "pyarrow").is_dir() or not (NEMO_PACKAGES / "datasets").is_dir():
        if subprocess.run([sys.executable, "-c", "import pyarrow"], capture_output=True, timeout=60).returncode == 0:
            return dict(os.environ)
        pytest.skip(f"pyarrow and datasets are not installed in {NEMO_PACKAGES} (`make venv` installs them)")
    folder = tmp_path_factory.mktemp("pyarrow-only")
    (folder / "pyarrow").symlink_to(NEMO_PACKAGES / "pyarrow")
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(folder), os.environ.get("PYTHONPATH")]))}


def save_to_disk(*datasets: tuple[Path, int, list[torch.Tensor]]) -> subprocess.Popen:
    """Start writing datasets (folder, data files, rows) with datasets' save_to_disk (from .nemo-packages), as
    speculators' preprocessing writes its --data-path; one process for all (importing datasets takes seconds)."""
    env = {**os.environ, "PYTHONPATH": str(NEMO_PACKAGES), "HF_DATASETS_DISABLE_PROGRESS_BARS": "1"}
    given = json.dumps([(str(folder), shards, [r.tolist() for r in rows]) for folder, shards, rows in datasets])
    return subprocess.Popen([sys.executable, "-W", "ignore", "-c", SAVE, given], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finished(process: subprocess.Popen) -> subprocess.CompletedProcess:
    stdout, stderr = process.communicate(timeout=60)
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


def export(env: dict[str, str], store: Path, data: Path, *flags: str) -> subprocess.Popen:
    """Start ``draftfeed store export`` (several run side by side: each spends its first seconds importing torch)."""
    args = [sys.executable, "-m", "draftfeed", "store", "export", str(store), "--format", "speculators", "--data-path", str(data), *flags]
    return subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def one_line(process: subprocess.Popen, code: int, *parts: str) -> None:
    done = finished(process)
    assert done.returncode == code, done.stdout + done.stderr
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
    for part in parts:
        assert part in done.stderr, done.stderr


def test_export_writes_each_rows_sample_as_the_rank_received_it(cluster, tiny_target, pyarrow_env, tmp_path, monkeypatch):
    store, full, more, elsewhere = tmp_path / "store", tmp_path / "rows", tmp_path / "more", tmp_path / "elsewhere"
    # two data files (rows are numbered across them); and the rows with one the store lacks as row 2
    saving = save_to_disk((full, 2, ROWS), (more, 1, [*ROWS[:2], UNRECORDED, *ROWS[2:]]))
    add_service(cluster, tiny_target, "dflash", "--task", "dflash", "--target-layer-ids", ",".join(map(str, LAYERS)))
    with RemoteDFlashTarget(cluster.frontend, "dflash", store=store, store_mode="record") as target:
        received = [target.generate_batch(**row_batch(ids)).hidden_states.clone() for ids in ROWS]
    saved = finished(saving)
    assert saved.returncode == 0, saved.stderr
    exported, lacking = export(pyarrow_env, store, full), export(pyarrow_env, store, more)
    skipping = export(pyarrow_env, store, more, "--skip-missing", "--out", str(elsewhere))

    done = finished(exported)
    assert done.returncode == 0, done.stderr
    assert "4 of 4 rows written" in done.stdout and "[2, 4, 8], 64 wide" in done.stdout, done.stdout
    out = full / "hidden_states"  # speculators' default --hidden-states-path
    assert sorted(p.name for p in out.iterdir()) == [f"hs_{i}.safetensors" for i in range(len(ROWS))]  # no temporary left
    for row, (ids, hidden) in enumerate(zip(ROWS, received)):
        written, expected = load_file(str(out / f"hs_{row}.safetensors")), to_sample(hidden, ids, HIDDEN)
        assert set(written) == {"hidden_states", "token_ids"}
        for name, tensor in expected.items():
            assert written[name].dtype == tensor.dtype and torch.equal(written[name], tensor), f"row {row}: {name}"
        assert written["hidden_states"].shape == (len(ids), len(LAYERS), HIDDEN) and written["token_ids"].dtype == torch.int64

    # a row the store lacks: one line naming it and its key, nothing written; --skip-missing writes the others
    identity = read_manifest(store)
    assert identity is not None
    key = batch_key(identity.digest(), row_batch(UNRECORDED))
    one_line(lacking, 2, f"lacks row 2 (key {key})", "--skip-missing")
    assert not (more / "hidden_states").exists()
    skipped = finished(skipping)
    assert skipped.returncode == 0 and "4 of 5 rows written" in skipped.stdout and f"no file for row 2 (key {key})" in skipped.stdout, skipped
    assert sorted(p.name for p in elsewhere.iterdir()) == [f"hs_{i}.safetensors" for i in (0, 1, 3, 4)]
    assert torch.equal(load_file(str(elsewhere / "hs_3.safetensors"))["hidden_states"], to_sample(received[2], ROWS[2], HIDDEN)["hidden_states"])

    monkeypatch.setitem(sys.modules, "pyarrow", None)  # as in the venv: what to install, in one line
    with pytest.raises(UsageError, match="needs pyarrow"):
        export_speculators(store, full, tmp_path / "none")


def test_export_refuses_a_folder_with_no_store_a_store_of_another_task_and_a_folder_with_no_dataset(pyarrow_env, tmp_path):
    data = tmp_path / "data"
    one_line(export(pyarrow_env, tmp_path / "nope", data), 2, "there is no store at")
    eagle3 = tmp_path / "eagle3"
    eagle3.mkdir()
    info = Eagle3TargetInfo(num_hidden_layers=8, hidden_size=64, vocab_size=1000, aux_layer_ids=[1, 3, 4])
    write_manifest(eagle3, StoreIdentity(task="eagle3", target=info, forms=["probs"]))
    with pytest.raises(UsageError, match="holds eagle3 supervision"):
        export_speculators(eagle3, data, data / "out")
    for name, layers, why in [
        ("short", [1, 3], "do not end with the last layer \\(7\\)"),
        ("dflash", [1, 7], "is not a dataset saved with save_to_disk"),
    ]:
        store = tmp_path / name
        store.mkdir()
        write_manifest(
            store,
            StoreIdentity(
                task="dflash",
                target=DFlashTargetInfo(num_hidden_layers=8, hidden_size=64, vocab_size=1000, target_layer_ids=layers),
                forms=["hidden"],
            ),
        )
        with pytest.raises(UsageError, match=why):
            export_speculators(store, data, data / "out")
