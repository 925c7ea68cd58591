"""speculators (the vLLM project's draft trainer, 0.9.0) trained on draftfeed (issue 39): its own trainer, run as its
users run it but through ``python -m draftfeed.integrations.speculators train ... --hidden-states-backend draftfeed``
(for the comparison of every algorithm, the same entry called in one process for each in turn), fed by a real broker
and a ``--task dflash`` worker, against the same trainer on its offline files (speculators' ``train`` called in one
process for every algorithm in turn; ``python -m speculators.train`` once, on exported files),
which are computed here in-process by transformers (hooks on the decoder layers: ids below L are a layer's input, L the last layer's
output before the final norm). Every step's metrics, the loss among them, are equal, exactly.

speculators caps transformers at 5.19: `make test` runs this file in .venv-vllm, where it is installed; elsewhere it
is skipped. On a CPU-only machine speculators' trainer needs two patches and four flags, which are about the CPU, not
about draftfeed: tests/speculators_cpu/sitecustomize.py patches ``get_local_rank`` (to "cpu") and
``torch.accelerator.synchronize`` (to nothing) in the trainer process (draftfeed/bench/speculators_run.py), and every run passes ``--hidden-states-dtype
float32 --loss-implementation eager --draft-attn-impl sdpa`` and ``--mask-token-id`` (the tiny verifier has no
tokenizer). The drafts are shrunk for speed (one layer, small blocks) the same way in both runs.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import TESTS_DIR, WORKER_ENV, Cluster, add_service, wait_until

from draftfeed.bench.speculators_run import read_metrics

HAS_SPECULATORS = importlib.util.find_spec("speculators") is not None and importlib.util.find_spec("datasets") is not None
pytestmark = [
    pytest.mark.skipif(not HAS_SPECULATORS, reason="speculators is not installed here (make test runs it in .venv-vllm)"),
    pytest.mark.timeout(600),  # a run of speculators' trainer and a vllm start share 2 cores
]

LAYERS = 8  # the tiny target's (conftest.tiny_target)
SPECULATORS_IDS = [2, 4, 5]  # speculators' --target-layer-ids (its default for 8 layers); L = 8 is appended
DFLASH_IDS = [1, 3, 4, 7]  # what serves them: each k - 1, then L - 1
MASK_TOKEN = 999  # never in the rows
ROWS = 16
CPU_SITE = str(Path(TESTS_DIR) / "speculators_cpu")
SHRINK = {  # the same in both runs of an algorithm: a one-layer draft and small blocks, for a CPU
    "eagle3": [],
    "peagle": ["--num-depths", "2"],
    "dflash": ["--num-layers", "1", "--block-size", "4", "--max-anchors", "8"],
    "dflash2": ["--num-layers", "1", "--block-size", "4", "--max-anchors", "8"],
    "dspark": ["--num-layers", "1", "--block-size", "4", "--max-anchors", "8"],
    "xpress": ["--num-layers", "1", "--block-size", "4", "--max-anchors", "8"],
    "mtp": [],
}


@torch.no_grad()
def offline_hidden_states(model, input_ids: torch.Tensor, ids: list[int]) -> torch.Tensor:
    """speculators' sample [S, len(ids), H] for one row, in process: id k < L the input of decoder layer k, id L the
    output of the last decoder layer (before the final norm)."""
    layers = model.model.layers
    captured: dict[int, torch.Tensor] = {}
    hooks = []
    for k in ids:
        if k < len(layers):
            hooks.append(
                layers[k].register_forward_pre_hook(
                    lambda _m, args, kwargs, k=k: captured.__setitem__(k, (args[0] if args else kwargs["hidden_states"]).clone()), with_kwargs=True
                )
            )
        else:
            hooks.append(
                layers[-1].register_forward_hook(
                    lambda _m, _a, out, k=k: captured.__setitem__(k, (out[0] if isinstance(out, tuple) else out).clone())
                )
            )
    try:
        model.model(input_ids=input_ids.view(1, -1), use_cache=False)
    finally:
        for hook in hooks:
            hook.remove()
    return torch.stack([captured[k][0] for k in ids], dim=1).contiguous()


def write_data(root: Path, model, ids: list[int]) -> SimpleNamespace:
    """One data set twice: ``offline`` with its hidden_states/hs_{i}.safetensors (speculators' ``ids``), ``served``
    without any."""
    from datasets import Dataset
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(3)
    rows = [torch.randint(0, 900, (int(torch.randint(24, 41, (1,), generator=generator)),), generator=generator) for _ in range(ROWS)]
    masks = [(torch.arange(len(row)) >= len(row) // 4).to(torch.int64) for row in rows]
    columns = {"input_ids": [row.tolist() for row in rows], "loss_mask": [mask.tolist() for mask in masks], "seq_len": [len(row) for row in rows]}
    for name in ("offline", "served"):
        Dataset.from_dict(columns).with_format("torch").save_to_disk(str(root / name))
    samples = []
    (root / "offline" / "hidden_states").mkdir()
    for index, row in enumerate(rows):
        sample = {"hidden_states": offline_hidden_states(model, row, ids), "token_ids": row.clone()}
        save_file(sample, str(root / "offline" / "hidden_states" / f"hs_{index}.safetensors"))
        samples.append(sample)
    return SimpleNamespace(offline=root / "offline", served=root / "served", rows=rows, samples=samples)


@pytest.fixture(scope="module")
def data(tmp_path_factory, tiny_model) -> SimpleNamespace:
    return write_data(tmp_path_factory.mktemp("speculators-data"), tiny_model, [*SPECULATORS_IDS, LAYERS])


@pytest.fixture(scope="module")
def mtp_verifier(tmp_path_factory) -> Path:
    """A tiny Qwen3 whose checkpoint also holds a native multi-token-prediction head (the ``mtp.*`` weights of the
    Qwen3-Next and Qwen3.5 checkpoints speculators' MTP starts from): one decoder layer shaped like the verifier's,
    its input projection [H, 2H] and three norms, drawn at random."""
    from safetensors.torch import load_file, save_file

    from draftfeed.tiny import build_tiny_target

    path = build_tiny_target(tmp_path_factory.mktemp("mtp") / "qwen3-mtp", arch="qwen3", num_hidden_layers=LAYERS)
    weights = load_file(str(path / "model.safetensors"))
    hidden = json.loads((path / "config.json").read_text())["hidden_size"]
    generator = torch.Generator().manual_seed(1)
    head = {f"mtp.layers.0.{key.removeprefix('model.layers.0.')}": value for key, value in weights.items() if key.startswith("model.layers.0.")}
    head = {key: torch.randn(value.shape, generator=generator) * 0.02 if value.dim() > 1 else torch.ones_like(value) for key, value in head.items()}
    head["mtp.fc.weight"] = torch.randn(hidden, 2 * hidden, generator=generator) * 0.02
    for norm in ("norm", "pre_fc_norm_hidden", "pre_fc_norm_embedding"):
        head[f"mtp.{norm}.weight"] = torch.ones(hidden)
    save_file({key: value.contiguous() for key, value in {**weights, **head}.items()}, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1, "mtp_num_hidden_layers": 1}))
    return path


@pytest.fixture(scope="module")
def mtp_data(tmp_path_factory, mtp_verifier) -> SimpleNamespace:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(mtp_verifier, dtype=torch.float32).eval()
    return write_data(tmp_path_factory.mktemp("speculators-mtp-data"), model, [LAYERS])


@pytest.fixture(scope="module")
def offline_runs(tiny_target, data, mtp_verifier, mtp_data, tmp_path_factory) -> dict:
    """speculators' own trainer on its offline files, every algorithm (MTP on its own verifier), each once for the
    module: one after the other in one process (``python -m draftfeed.bench.speculators_run --runs``: speculators'
    ``train`` in process, as ``python -m speculators.train`` runs it), which spares six starts of torch, transformers
    and speculators."""
    root = tmp_path_factory.mktemp("offline-runs")
    runs = {name: (mtp_verifier, mtp_data, root / name) if name == "mtp" else (tiny_target, data, root / name) for name in SHRINK}
    return offline_in_one_process(runs, root)


def offline_in_one_process(runs: dict[str, tuple[Path, SimpleNamespace, Path]], root: Path) -> dict:
    return in_one_process({name: (out, flags(verifier, data.offline, name, out)) for name, (verifier, data, out) in runs.items()}, root)


def in_one_process(runs: dict[str, tuple[Path, list[str]]], root: Path) -> dict:
    """Each run (its folder and speculators' ``train`` flags), one after the other in one process; each one's train
    and validation records, by name."""
    listed = {name: (out / "metrics.jsonl", args) for name, (out, args) in runs.items()}
    for metrics, _args in listed.values():
        metrics.parent.mkdir(parents=True, exist_ok=True)
    (root / "runs.json").write_text(json.dumps([{"metrics": str(metrics), "args": args} for metrics, args in listed.values()]))
    env = {**os.environ, **WORKER_ENV, "PYTHONPATH": WORKER_ENV["PYTHONPATH"]}
    done = subprocess.run(
        [sys.executable, "-m", "draftfeed.bench.speculators_run", "--runs", str(root / "runs.json")],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, f"exit {done.returncode}:\n{done.stderr[-4000:]}"
    return {name: records(metrics, done.stderr) for name, (metrics, _args) in listed.items()}


@pytest.fixture(scope="module")
def draftfeed_runs(service, tiny_target, data, tmp_path_factory) -> dict:
    """speculators' trainer on draftfeed, every algorithm but MTP, each once for the module: one after the other in
    one process, as the offline runs are, through the same entry as ``python -m draftfeed.integrations.speculators
    train`` (the tests below run that command itself, a process a run)."""
    root = tmp_path_factory.mktemp("draftfeed-runs")
    runs = {name: (root / name, on_draftfeed(tiny_target, data, name, root / name, url(service))[2:]) for name in SHRINK if name != "mtp"}
    return in_one_process(runs, root)


@pytest.fixture(scope="module")
def service(tiny_target):
    cluster = Cluster()
    try:
        add_service(cluster, tiny_target, "speculators", "--task", "dflash", "--target-layer-ids", ",".join(map(str, DFLASH_IDS)))
        yield cluster
    finally:
        cluster.stop()


def url(cluster: Cluster, service: str = "speculators", options: str = "") -> str:
    return f"draftfeed://{cluster.frontend.removeprefix('tcp://')}/{service}{options}"


def flags(verifier: Path, data_path: Path, algorithm: str, out: Path, *extra: str) -> list[str]:
    # MTP reads id L alone, draws from the verifier's own vocabulary and picks its attention itself
    chosen = (
        []
        if algorithm == "mtp"
        else [
            "--target-layer-ids",
            *map(str, SPECULATORS_IDS),
            "--mask-token-id",
            str(MASK_TOKEN),
            "--draft-attn-impl",
            "sdpa",
        ]
    )
    return [
        "--verifier-name-or-path", str(verifier), "--data-path", str(data_path), "--speculator-type", algorithm, *chosen,
        "--hidden-states-dtype", "float32", "--loss-implementation", "eager",
        "--total-seq-len", "64", "--train-data-ratio", "0.75", "--epochs", "1", "--max-steps", "5", "--seed", "42",
        "--num-workers", "0", "--save-path", str(out / "checkpoint"), "--log-dir", str(out / "logs"),
        *SHRINK[algorithm], *extra,
    ]  # fmt: skip


def start_training(module_args: list[str], out: Path) -> tuple[subprocess.Popen, Path]:
    out.mkdir(parents=True, exist_ok=True)
    metrics = out / "metrics.jsonl"
    env = {
        **os.environ,
        **WORKER_ENV,
        "PYTHONPATH": os.pathsep.join([CPU_SITE, WORKER_ENV["PYTHONPATH"]]),
        "DRAFTFEED_TEST_SPECULATORS_CPU": "1",
        "DRAFTFEED_TEST_SPECULATORS_METRICS": str(metrics),
    }
    popen = subprocess.Popen([sys.executable, "-m", *module_args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return popen, metrics


def finished(popen: subprocess.Popen, metrics: Path) -> tuple[list[dict], list[dict]]:
    """The run's train and val records (profile timings left out), once it has ended well."""
    try:
        out, err = popen.communicate(timeout=300)
    finally:
        if popen.poll() is None:
            popen.kill()
    assert popen.returncode == 0, f"exit {popen.returncode}:\n{err[-4000:]}"
    return records(metrics, err)


def records(metrics: Path, err: str) -> tuple[list[dict], list[dict]]:
    """A run's train records (profile timings left out) and validation records; five steps of them."""
    steps, val = read_metrics(metrics)
    train = [{key: value for key, value in r.items() if key != "profile"} for r in steps]
    assert len(train) == 5, f"{len(train)} train steps logged:\n{err[-2000:]}"
    return train, val


def train(module_args: list[str], out: Path) -> tuple[list[dict], list[dict]]:
    return finished(*start_training(module_args, out))


def on_draftfeed(tiny_target, data, algorithm: str, out: Path, address: str, *extra: str) -> list[str]:
    return [
        "draftfeed.integrations.speculators",
        "train",
        *flags(tiny_target, data.served, algorithm, out, *extra),
        "--hidden-states-backend",
        "draftfeed",
        "--draftfeed-url",
        address,
        "--on-missing",
        "raise",
    ]


def assert_same_run(expected: tuple[list[dict], list[dict]], got: tuple[list[dict], list[dict]]) -> None:
    (want_train, want_val), (got_train, got_val) = expected, got
    want_losses = torch.tensor([step["train"]["loss"] for step in want_train], dtype=torch.float64)
    got_losses = torch.tensor([step["train"]["loss"] for step in got_train], dtype=torch.float64)
    assert torch.equal(got_losses, want_losses), f"losses {got_losses.tolist()} on draftfeed, {want_losses.tolist()} offline"
    for step, (want, got) in enumerate(zip(want_train, got_train)):
        assert got == want, f"step {step}: {got} on draftfeed, {want} offline"
    assert got_val == want_val, f"validation {got_val} on draftfeed, {want_val} offline"


# ---------------------------------------------------------------- the samples, in process
def test_the_backend_serves_each_row_equal_to_its_offline_file(service, tiny_target, data):
    """The transfer a DataLoader worker holds, asked for every row in the order the trainer's sampler gives (the
    train split's first epoch, then the val split's), keeps rows in flight and returns each equal to its file."""
    from draftfeed.integrations.speculators.backend import DraftfeedBackend

    args = argparse.Namespace(
        draftfeed_url=url(service, options="?prefetch_depth=4"),
        draftfeed_request_timeout=60.0,
        verifier_name_or_path=str(tiny_target),
        speculator_type="eagle3",
        target_layer_ids=SPECULATORS_IDS,
        total_seq_len=64,
        train_data_ratio=0.75,
        seed=42,
        epochs=1,
    )
    transfer = DraftfeedBackend.from_train_args(args, str(data.served))
    try:
        first = transfer.get_cached(0)  # opens the rank and replays the sampler
        order = transfer._reader._orders["train"].expected
        assert sorted(order) == list(range(12)), order  # the train split: int(16 * 0.75) rows, each once an epoch
        for index in order:
            sample = transfer.get_cached(index)
            assert len(transfer._reader.in_flight) >= min(3, len(order) - order.index(index) - 1), "rows asked for ahead"
            for key in ("hidden_states", "token_ids"):
                want = data.samples[index][key]
                assert sample[key].dtype == want.dtype and torch.equal(sample[key], want), f"row {index} {key}"
        assert transfer._reader._orders["train"].lost == 0, "every row asked for was one the replayed sampler expected"
        for index in range(12, ROWS):  # the val split
            assert torch.equal(transfer.get_cached(index)["hidden_states"], data.samples[index]["hidden_states"]), index
        assert torch.equal(first["hidden_states"], data.samples[0]["hidden_states"])
    finally:
        transfer.close()


# ---------------------------------------------------------------- speculators' own trainer, 5 steps
@pytest.mark.parametrize("algorithm", [name for name in SHRINK if name != "mtp"])
def test_each_algorithm_trains_on_draftfeed_exactly_as_on_its_offline_files(offline_runs, draftfeed_runs, algorithm):
    expected = offline_runs[algorithm]
    got = draftfeed_runs[algorithm]
    assert_same_run(expected, got)
    print(f"\n{algorithm}: 5 steps, losses {[step['train']['loss'] for step in got[0]]} on draftfeed and offline")


def test_mtp_trains_on_the_last_layer_alone(service, mtp_verifier, mtp_data, offline_runs, tmp_path):
    """MTP (Qwen3-family verifiers with a native MTP head) reads id L alone: a service of DFlash layer L - 1."""
    add_service(service, mtp_verifier, "speculators-mtp", "--task", "dflash", "--target-layer-ids", str(LAYERS - 1))
    expected = offline_runs["mtp"]
    got = train(on_draftfeed(mtp_verifier, mtp_data, "mtp", tmp_path / "draftfeed", url(service, "speculators-mtp")), tmp_path / "draftfeed")
    assert_same_run(expected, got)


@pytest.mark.long  # one dataloader process a rank runs in the suite (the algorithms' runs): make test-long
def test_two_dataloader_workers_each_a_rank(service, tiny_target, data, offline_runs, tmp_path):
    workers = ("--num-workers", "2", "--prefetch-factor", "2")
    expected = offline_runs["eagle3"]
    got = train(on_draftfeed(tiny_target, data, "eagle3", tmp_path / "draftfeed", url(service), *workers), tmp_path / "draftfeed")
    assert_same_run(expected, got)
    ranks = [rank for rank in service.status()["ranks"] if rank.get("service") == "speculators"] if "ranks" in service.status() else []
    print(f"\ntwo DataLoader workers: equal to offline; ranks the broker knows now: {len(ranks)}")


# ---------------------------------------------------------------- what goes wrong
def test_a_service_with_other_layers_is_refused_in_one_line(service, tiny_target, data, tmp_path):
    args = on_draftfeed(tiny_target, data, "eagle3", tmp_path, url(service))
    args[args.index("--target-layer-ids") + 1 : args.index("--target-layer-ids") + 4] = ["1", "3", "6"]
    popen, _metrics = start_training(args, tmp_path)
    _out, err = popen.communicate(timeout=120)
    last = err.strip().splitlines()[-1]
    assert popen.returncode == 1 and "Traceback" not in err, err[-3000:]
    assert "serves DFlash layers [1, 3, 4, 7]" in last and "--target-layer-ids 0,2,5,7" in last, last


@pytest.mark.long  # the main suite kills workers mid-run on every plane; here it is speculators' trainer that runs on
def test_a_worker_stopped_mid_run_costs_the_run_nothing(tiny_target, data, offline_runs, tmp_path):
    """Two slow workers (the hf engine at 0.3 s a forward); one is SIGKILLed once training has begun: another serves
    what it held, and the run equals the offline one."""
    expected = offline_runs["eagle3"]
    cluster = Cluster("--heartbeat-interval", "0.2", "--liveness", "8")
    try:
        slow = ("--engine", "fake_engines:FakeSlowEngine", "--task", "dflash", "--target-layer-ids", ",".join(map(str, DFLASH_IDS)))
        add_service(cluster, tiny_target, "slow", *slow, workers=2)
        popen, metrics = start_training(
            on_draftfeed(tiny_target, data, "eagle3", tmp_path / "draftfeed", url(cluster, "slow")), tmp_path / "draftfeed"
        )
        try:
            wait_until(
                lambda: metrics.exists() and metrics.read_text().strip() != "" or popen.poll() is not None, timeout_s=180, what="the first step"
            )
            assert popen.poll() is None, "the run ended before a worker could be stopped"
            cluster.workers[0].popen.send_signal(signal.SIGKILL)
            got = finished(popen, metrics)
        finally:
            if popen.poll() is None:
                popen.kill()
        assert_same_run(expected, got)
        assert cluster.workers[0].popen.poll() is not None
    finally:
        cluster.stop()


# ---------------------------------------------------------------- offline again, from what draftfeed served
@pytest.mark.long  # the main suite exports recorded runs (test_store_export.py); this trains speculators on the export
def test_a_recorded_run_exports_as_offline_files_the_trainer_reads(service, tiny_target, data, offline_runs, tmp_path):
    """A run on draftfeed records what it is served (``store=`` in the URL); ``draftfeed store export --format
    speculators`` writes it as speculators' offline files, each equal to the transformers-computed one, and the
    trainer on those files runs as on the originals."""
    import shutil

    expected = offline_runs["eagle3"]
    store = tmp_path / "store"
    recorded = url(service, options=f"?store={store}&store_mode=record")
    assert_same_run(expected, train(on_draftfeed(tiny_target, data, "eagle3", tmp_path / "draftfeed", recorded), tmp_path / "draftfeed"))
    exported = tmp_path / "exported"
    shutil.copytree(data.served, exported)
    command = [
        sys.executable,
        "-m",
        "draftfeed",
        "store",
        "export",
        str(store),
        "--format",
        "speculators",
        "--data-path",
        str(exported),
        "--skip-missing",
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, env={**os.environ, **WORKER_ENV})
    assert done.returncode == 0, done.stdout + done.stderr
    from safetensors.torch import load_file

    files = sorted((exported / "hidden_states").glob("hs_*.safetensors"))
    assert len(files) >= 10, f"{len(files)} rows exported:\n{done.stdout}"
    for path in files:
        index = int(path.stem.removeprefix("hs_"))
        sample = load_file(str(path))
        for key in ("hidden_states", "token_ids"):
            assert torch.equal(sample[key], data.samples[index][key]), f"{path.name} {key}"
    again = train(["speculators.train", *flags(tiny_target, exported, "eagle3", tmp_path / "again")], tmp_path / "again")
    assert_same_run(expected, again)
