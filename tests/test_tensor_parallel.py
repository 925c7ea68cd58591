"""Workers at --tensor-parallel 2 (hf engine, gloo on CPU): one registration and two processes, supervision equal
bit for bit to the in-process computation under the same plan and degree, and no process left behind.

The reference runs transformers' own tensor-parallel plan over two processes of its own (tests/tp_reference.py).
Every worker here is two processes: the module's workers start side by side, once.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import urllib.request
from pathlib import Path

import pytest
import torch
from conftest import WORKER_ENV, Cluster, add_service, assert_supervision_equal, run_concurrently, suite_folder, wait_until
from reference import reference_eagle3
from support import preload
from support.lines import wait_for_line
from support.metrics import metric
from support.tensor_parallel import SERVED, TARGETS, expected, shared_tensor_parallel_reference
from tp_reference import AUX, DSPARK_IDS, batches

from draftfeed import RemoteDSparkTarget, RemoteEagle3Target
from draftfeed.consumers.engines import load_engine
from draftfeed.consumers.engines.parallel.engine import TensorParallelEngine
from draftfeed.consumers.settings import TargetSettings, TaskSettings
from draftfeed.net import free_port
from draftfeed.processes import commands
from draftfeed.tiny import build_tiny_target

pytestmark = pytest.mark.timeout(300)

TP = ["--tensor-parallel", "2"]
FOLLOWER_LINE = r"started 1 tensor-parallel processes: rank 1 pid (\d+)"


@pytest.fixture(scope="module")
def reference(tp_targets, tmp_path_factory) -> dict[str, torch.Tensor]:
    return shared_tensor_parallel_reference(tp_targets, suite_folder(tmp_path_factory))


@pytest.fixture(scope="module")
def http_port() -> int:
    return free_port()


@pytest.fixture(scope="module")
def services(cluster, tp_targets, http_port) -> Cluster:
    observed = {"llama": ["--http-port", str(http_port)], "deepseek-v3": []}
    starts = [
        lambda name=name, task=task: add_service(cluster, tp_targets[name], f"tp-{name}-{task}", "--task", task, *TP, *observed[name])
        for name, task in SERVED.items()
    ]
    run_concurrently(*starts, timeout_s=240)
    return cluster


def test_eagle3_on_llama_equals_the_same_plan_in_process(services, reference):
    named = batches()
    names = ["plain-0", "plain-1", "plain-2", "full", "packed-0", "packed-1"]
    with RemoteEagle3Target(services.frontend, "tp-llama-eagle3", prefetch_depth=2) as remote:
        assert remote.model_info().aux_layer_ids == AUX
        for name, (_batch, supervision) in zip(names, remote.iterate(named[name] for name in names)):
            assert_supervision_equal(supervision, expected(reference, "llama", "eagle3", name))


def test_dspark_on_deepseek_v3_equals_the_same_plan_in_process(services, reference):
    named = batches()
    with RemoteDSparkTarget(services.frontend, "tp-deepseek-v3-dspark", prefetch_depth=2) as remote:
        assert remote.model_info().target_layer_ids == DSPARK_IDS
        for name in ("plain-0", "plain-1", "full", "packed-0", "packed-1"):
            assert_supervision_equal(remote.generate_batch(**named[name]), expected(reference, "deepseek-v3", "dspark", name))


@pytest.mark.parametrize("target", list(SERVED))
def test_the_weights_are_gathered_whole(services, reference, target):
    remote_class = RemoteEagle3Target if SERVED[target] == "eagle3" else RemoteDSparkTarget
    with remote_class(services.frontend, f"tp-{target}-{SERVED[target]}") as remote:
        for which, weight in (("input", remote.get_input_embeddings().weight), ("output", remote.get_output_embeddings().weight)):
            assert torch.equal(weight, reference[f"{TARGETS[target]}/weights/{which}"]), f"the {which} embeddings differ"


def test_across_degrees_only_the_last_bits_differ(services, reference, tiny_model):
    """Degree 2 against degree 1 (the plain in-process forward): the reductions split differently, so the bits may
    differ, but only in the last places (docs/contract.md quotes the sizes)."""
    named = batches()
    worst = 0.0
    for name in ("plain-0", "plain-1", "full", "packed-0"):
        one = reference_eagle3(tiny_model, named[name], AUX)
        two = expected(reference, "llama", "eagle3", name)
        for field in ("aux_hidden_states", "target_probs"):
            worst = max(worst, (one[field].double() - two[field].double()).abs().max().item())
    print(f"largest |difference| between degree 1 and degree 2, EAGLE-3 on the tiny Llama: {worst:.3g}")
    assert worst < 1e-5


def test_an_update_in_place_reaches_every_rank_of_a_tensor_parallel_worker(services, reference, tp_targets, http_port, tmp_path):
    """Each process of the worker reads the update and keeps its own shard (issue 48): a step that changes layer 2
    makes the supervision differ from the plan's reference, and the original weights published back as the next
    version make it equal again, bit for bit, every batch labelled with its version."""
    from safetensors.torch import load_file, save_file

    from draftfeed.target_updates import update_target

    original = {name: t for name, t in load_file(str(tp_targets["llama"] / "model.safetensors")).items() if ".layers.2." in name}
    save_file({name: t + 0.05 for name, t in original.items()}, str(tmp_path / "step.safetensors"))
    save_file(original, str(tmp_path / "back.safetensors"))
    service, batch = "tp-llama-eagle3", batches()["plain-0"]
    for version, weights in ((1, "step"), (2, "back")):
        (result,) = update_target(services.frontend, service, str(tmp_path / f"{weights}.safetensors"), version, timeout_s=120).workers
        assert result.ok and result.target_version == version, result
        with RemoteEagle3Target(services.frontend, service, min_target_version=version) as remote:
            supervision = remote.generate_batch(**batch)
        assert supervision.target_version == version
        same = torch.equal(supervision.aux_hidden_states, expected(reference, "llama", "eagle3", "plain-0")["aux_hidden_states"])
        assert same == (weights == "back"), f"version {version} ({weights}): equal to the original plan's supervision: {same}"
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{http_port}/metrics", timeout=10).read().decode()
        assert metric(metrics, "draftfeed_worker_target_version") == version, metrics  # the worker's own gauge
        assert services.worker_status(f"{service}-0")["target_version"] == version


def test_a_published_update_reaches_every_rank_of_a_tensor_parallel_worker(services, reference, tp_targets):
    """The same through ``publish_weights`` (issue 48): every process of the worker pulls the update from the test's
    memory itself, in 4 KiB pieces, and keeps its own shard of each tensor once its last piece is in. A step that
    changes layer 2 and lm_head makes the supervision differ from the plan's reference, and lm_head gathered from both
    shards equals the published one; the original weights published back as the next version make both equal to the
    reference again, bit for bit, every batch labelled with its version."""
    from safetensors.torch import load_file

    from draftfeed import publish_weights

    saved = load_file(str(tp_targets["llama"] / "model.safetensors"))
    original = {name: t for name, t in saved.items() if ".layers.2." in name or name == "lm_head.weight"}
    service, batch = "tp-llama-eagle3", batches()["plain-0"]
    version = services.worker_status(f"{service}-0")["target_version"]
    for weights, tensors in (("step", {name: t + 0.05 for name, t in original.items()}), ("back", original)):
        version += 1
        (result,) = publish_weights(services.frontend, service, tensors, version, chunk_bytes=4096, timeout_s=120).workers
        assert result.ok and result.target_version == version, result
        with RemoteEagle3Target(services.frontend, service, min_target_version=version) as remote:
            supervision = remote.generate_batch(**batch)
            assert torch.equal(remote.get_output_embeddings().weight, tensors["lm_head.weight"]), f"version {version}: lm_head's shards"
        assert supervision.target_version == version
        same = torch.equal(supervision.aux_hidden_states, expected(reference, "llama", "eagle3", "plain-0")["aux_hidden_states"])
        assert same == (weights == "back"), f"version {version} ({weights}): equal to the original plan's supervision: {same}"
        status = services.worker_status(f"{service}-0")
        assert status["target_version"] == version and status["checkpoint"].startswith("published by tcp://"), status


def test_status_health_and_metrics_say_tensor_parallel_2(services, http_port):
    from draftfeed.observe.status_client import format_status

    worker = services.worker_status("tp-llama-eagle3-0")
    assert worker is not None and worker["tensor_parallel"] == 2 and worker["devices"] == ["cpu", "cpu"], worker
    assert "tensor-parallel 2 on cpu,cpu" in format_status(services.status())
    health = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{http_port}/health", timeout=10).read())
    assert health == {"status": "ready", "tensor_parallel": 2, "devices": ["cpu", "cpu"]}
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{http_port}/metrics", timeout=10).read().decode()
    assert metric(metrics, "draftfeed_worker_tensor_parallel", devices="cpu,cpu") == 2, metrics


def test_sigkill_of_a_worker_takes_its_follower_with_it(services):
    """The module's last use of its workers: the DSpark one is killed, its follower must not outlive it."""
    worker = next(w for w in services.workers if w.ready["worker"] == "tp-deepseek-v3-dspark-0")
    follower = follower_pid(worker)
    worker.kill()
    wait_until(lambda: gone(follower), timeout_s=15, what=f"the follower (pid {follower}) to die with its worker")


# ---------------------------------------------------------------- faults: no batch lost, no process left behind
def follower_pid(worker: commands.Process) -> int:
    return int(re.search(FOLLOWER_LINE, wait_for_line(worker, FOLLOWER_LINE, timeout_s=60)).group(1))


def gone(pid: int) -> bool:
    """Not running: exited, or a zombie waiting to be reaped (it holds no device, port or memory)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return True
    return state in ("Z", "X")


def test_a_follower_killed_mid_run_stops_its_worker_and_the_run_completes_elsewhere(fast_cluster, tiny_target, reference):
    """Every batch once, in order, equal to the reference (both workers run at degree 2); the worker whose follower
    died exits with the reason, its requests served by the other. Then SIGTERM stops the other and its follower."""
    starts = [lambda name=name: fast_cluster.add_worker(tiny_target, "--service", "tp-run", *TP, "--name", name) for name in ("doomed", "survivor")]
    run_concurrently(*starts, timeout_s=240)
    doomed, survivor = sorted(fast_cluster.workers, key=lambda worker: worker.ready["worker"])
    victim = follower_pid(doomed)
    named = batches()
    names = [f"run-{i}" for i in range(12)]
    results = []
    with RemoteEagle3Target(fast_cluster.frontend, "tp-run", prefetch_depth=3) as remote:
        for index, (batch, supervision) in enumerate(remote.iterate(named[name] for name in names)):
            results.append((batch, supervision))
            if index == 2:
                os.kill(victim, signal.SIGKILL)
    assert [b is named[n] for (b, _s), n in zip(results, names)] == [True] * len(names), "a batch missing, repeated or out of order"
    for name, (_batch, supervision) in zip(names, results):
        assert_supervision_equal(supervision, expected(reference, "llama", "eagle3", name))
    assert doomed.popen.wait(30) != 0
    wait_for_line(doomed, r"tensor-parallel process rank 1 \(pid \d+\) was killed by SIGKILL", timeout_s=5)
    status = fast_cluster.status()
    assert status["counters"]["requests_failed"] == 0 and "retry" not in status["requeues"], status  # the request in the engine is not charged
    follower = follower_pid(survivor)
    assert survivor.stop(timeout_s=30) == 0
    wait_until(lambda: gone(follower), timeout_s=15, what=f"the follower (pid {follower}) to exit after SIGTERM")


def test_sigterm_while_the_target_loads_leaves_no_process(cluster, tiny_target):
    """Stopped at start: the follower is running and rank 0 is loading its shard; neither outlives the signal."""
    worker = commands.start_worker(cluster.backend, str(tiny_target), "--service", "tp-start", *TP, env=WORKER_ENV, ready_pattern=FOLLOWER_LINE)
    try:
        follower = follower_pid(worker)
        worker.signal(signal.SIGTERM)
        worker.popen.wait(30)
        wait_until(lambda: gone(follower), timeout_s=15, what=f"the follower (pid {follower}) to exit with its worker stopped at start")
    finally:
        worker.stop()


# ---------------------------------------------------------------- mistakes: one line, at once
def run_worker(*args: str, timeout_s: float = 120) -> subprocess.CompletedProcess:
    """``draftfeed launch worker ARGS`` to its end (forked from the suite's preloader)."""
    command = ["launch", "worker", "--broker", "tcp://127.0.0.1:1", "--http-port", "0", *args]
    return preload.run_module("draftfeed", command, {**os.environ, **WORKER_ENV}, timeout_s)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--tensor-parallel", "0"], "--tensor-parallel 0: give the number of devices"),
        (["--devices", "cpu,cpu"], "add --tensor-parallel 2"),
        (["--tensor-parallel", "2", "--devices", "cuda:0"], "names 1 devices (cuda:0) for --tensor-parallel 2"),
        (["--tensor-parallel", "2", "--device-map", "auto"], "exclude each other"),
        (["--tensor-parallel", "2", "--engine", "fake_engines:FakeSlowEngine"], "an engine of your own runs at --tensor-parallel 1"),
    ],
)
def test_mistakes_are_one_line(tiny_target, flags, message):
    result = run_worker("--target", str(tiny_target), *flags)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.stderr


def test_a_model_without_a_tensor_parallel_plan_is_refused_naming_what_to_use(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    path = tmp_path / "tiny-gpt2"
    GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=64)).save_pretrained(path)
    with pytest.raises(ValueError) as refused:  # before any process starts (the CLI prints this line)
        load_engine(TargetSettings(engine="hf", path=str(path), device="cpu", dtype="float32", tensor_parallel=2))
    assert str(refused.value) == (
        "--tensor-parallel 2: gpt2 has no tensor-parallel plan in transformers; serve it with --device-map auto (its layers spread "
        "over --devices in one process) or with --engine vllm or sglang"
    )


def test_device_map_auto_serves_the_in_process_computation(cluster, tiny_target, tiny_model):
    """--device-map auto on CPU puts every layer on the host: equal to the plain forward."""
    add_service(cluster, tiny_target, "tp-map", "--device-map", "auto")
    batch = batches()["plain-0"]
    with RemoteEagle3Target(cluster.frontend, "tp-map") as remote:
        assert_supervision_equal(remote.generate_batch(**batch), reference_eagle3(tiny_model, batch, AUX))


def test_moe_families_at_degree_2(tmp_path):
    """Every family of MOE_ARCHS, HYPER_CONNECTION_ARCHS and the text ones of FRONTIER_ARCHS under transformers'
    tensor-parallel plan at degree 2, and
    with its expert-parallel plan beside it (--expert-parallel), within the last bits of degree 1 on a padded batch
    (docs/engines.md has the table this prints)."""
    from draftfeed.tiny import FRONTIER_ARCHS, FRONTIER_IMAGE_TEXT_ARCHS, HYPER_CONNECTION_ARCHS, MOE_ARCHS

    # DeepSeek-V3 is served by a worker above; DeepSeek-V4's layers give [B, S, streams, H]; the frontier text families
    # (issue 47; the image-text ones load as image-text models, which tp_families does not)
    frontier = [family for family in FRONTIER_ARCHS if family not in FRONTIER_IMAGE_TEXT_ARCHS]
    families = [family for family in (*MOE_ARCHS, *HYPER_CONNECTION_ARCHS, *frontier) if family not in TARGETS]
    for family in families:
        build_tiny_target(tmp_path / family, arch=family)
    port = free_port()
    env = {**os.environ, **WORKER_ENV}  # tests/ on PYTHONPATH: python -m tp_families, forked from the suite's preloader
    ranks = [preload.popen_module("tp_families", [str(rank), str(port), str(tmp_path), *families], env) for rank in (0, 1)]
    try:
        first, second = [preload.communicate(rank, timeout_s=240) for rank in ranks]
    finally:
        for rank in ranks:
            rank.kill()
    assert first.returncode == 0 and second.returncode == 0, first.stderr[-3000:] + second.stderr[-3000:]
    outcomes = {(line["family"], line["plan"]): line for line in map(json.loads, first.stdout.splitlines())}
    print("\n".join(json.dumps(line) for line in outcomes.values()))
    assert set(outcomes) == {(family, plan) for family in families for plan in ("tensor", "tensor+expert")}, outcomes
    for outcome in outcomes.values():
        assert "fails" not in outcome and outcome["layers"] < 1e-5 and outcome["logits"] < 1e-5, outcome


@pytest.mark.long  # two gloo processes and a padded batch through the plan (30 s): make test-long
def test_a_target_whose_plan_fails_a_padded_batch_is_refused_at_start(tmp_path):
    """A DeepSeek-V3 with fewer key/value heads than query heads (which multi-head latent attention never has) fails
    any padded batch, under the plan as at one process: the engine's start check refuses it in one line naming what to
    use (the CLI prints it and exits 2), and leaves no process group behind."""
    import transformers

    config = transformers.DeepseekV3Config(
        vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1,
        q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, tie_word_embeddings=False,
    )  # fmt: skip
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(tmp_path / "few-kv-heads")
    with pytest.raises(ValueError) as refused:
        TensorParallelEngine("hf", str(tmp_path / "few-kv-heads"), ["cpu", "cpu"], "float32", on_lost=lambda _why: None)
    said = str(refused.value)
    assert "fails a padded batch at --tensor-parallel 2 (RuntimeError: The size of tensor a" in said, said
    assert "serve it with --device-map auto" in said, said
    assert not torch.distributed.is_initialized()  # nothing is left of the group


def test_dflash_eagle_and_vispec_captures_at_degree_2(tiny_target, tiny_model):
    """The captures of the three newer tasks through the tensor-parallel engine (one follower, no worker): layer
    outputs up to L - 1 with the model's logits (DFlash, JetSpec; a packed batch too), the final norm's output with
    lm_head gathered inside the task's inference-mode compute (EAGLE-1/2), and the embeddings (ViSpec, a text-only
    batch), each within the last bits of degree 1 (the reductions split differently), as above."""
    from draftfeed.consumers.tasks import load_task

    layers = tiny_model.config.num_hidden_layers
    lost: list[str] = []
    two = TensorParallelEngine("hf", str(tiny_target), ["cpu", "cpu"], "float32", on_lost=lost.append)
    one = load_engine(TargetSettings(engine="hf", path=str(tiny_target), device="cpu", dtype="float32"))
    named = batches()
    cases = [
        ("dflash", {"layer_ids": [0, layers // 2, layers - 1], "capture_logits": True}, "plain-0"),
        ("dflash", {"layer_ids": [0, layers // 2, layers - 1], "capture_logits": True}, "packed-0"),
        ("eagle", {}, "plain-1"),
        ("vispec", {"image_token_id": 999}, "plain-2"),
    ]
    worst: dict[str, float] = {}
    try:
        for task, options, name in cases:
            batch = named[name]
            documents = None
            if "seq_lens" in batch:
                from draftfeed.contract.packing import check_packing

                documents = check_packing(batch["attention_mask"], batch["position_ids"], batch["seq_lens"])
            args = (batch["input_ids"], batch["attention_mask"], batch["loss_mask"], None, documents)
            got, expected = (
                load_task(TaskSettings.of(task, **options), two).compute(*args),
                load_task(TaskSettings.of(task, **options), one).compute(*args),
            )
            assert set(got) == set(expected), task
            for field, tensor in expected.items():
                assert got[field].dtype == tensor.dtype and got[field].shape == tensor.shape, (task, field)
                worst[f"{task} {name} {field}"] = (got[field].double() - tensor.double()).abs().max().item()
    finally:
        two.close()
    print("\nlargest |difference| between degree 2 and degree 1: " + ", ".join(f"{key} {value:.2g}" for key, value in worst.items()))
    assert max(worst.values()) < 1e-5, worst
    assert lost == [] and not torch.distributed.is_initialized()


@pytest.mark.long
def test_an_engine_closed_after_its_follower_was_lost_leaves_its_process_alive(tiny_target, monkeypatch):
    """The grace timer that ends a worker whose follower was lost (a stuck collective must not keep it) ends nothing
    once the engine is closed: a program (or pytest) that holds a TensorParallelEngine lives on. Unclosed, it ends."""
    import draftfeed.consumers.engines.parallel.loss as loss_module

    ended: list[int] = []
    monkeypatch.setattr(loss_module, "LOST_GRACE_S", 3.0)  # the close below comes well within it
    monkeypatch.setattr(loss_module.os, "_exit", ended.append)
    for close in (True, False):
        lost: list[str] = []
        engine = TensorParallelEngine("hf", str(tiny_target), ["cpu", "cpu"], "float32", on_lost=lost.append)
        try:
            os.kill(engine.pids[1], signal.SIGKILL)
            wait_until(lambda lost=lost: lost, timeout_s=30, what="the engine to see its follower killed")
            timer = engine._loss._timer
            assert timer is not None
            if close:
                engine.close()
            timer.join(timeout=10)
            assert ended == ([] if close else [70]), f"close={close}: the grace timer ended the process with {ended}"
        finally:
            engine.close()
            if torch.distributed.is_initialized():  # a lost engine leaves its group (a collective with the dead could hang)
                torch.distributed.destroy_process_group()


@pytest.mark.long  # the same plan entries over two nodes are long too (test_nodes.py); the suite keeps the MoE families
def test_glm5_next_runs_under_draftfeeds_plan_entries(tmp_path):
    """GLM-5.3 fails a padded batch under transformers' own plan (its linear-attention layers' output projection is
    sharded rowwise, its input never split); with draftfeed's plan entries (plan_fixes.py: attention whole on every
    rank) the tensor-parallel engine starts and its DSpark supervision is within the last bits of degree 1."""
    from draftfeed.consumers.tasks import load_task

    target = str(build_tiny_target(tmp_path / "glm5-next", arch="glm5-next", num_hidden_layers=4))
    lost: list[str] = []
    two = TensorParallelEngine("hf", target, ["cpu", "cpu"], "float32", on_lost=lost.append)
    one = load_engine(TargetSettings(engine="hf", path=target, device="cpu", dtype="float32"))
    batch = batches()["plain-0"]
    settings = TaskSettings.of("dspark", layer_ids=[-1, 1, 2, 3])
    try:
        args = (batch["input_ids"], batch["attention_mask"], batch["loss_mask"])
        got, expected = load_task(settings, two).compute(*args), load_task(settings, one).compute(*args)
    finally:
        two.close()
    worst = {field: (got[field].double() - tensor.double()).abs().max().item() for field, tensor in expected.items()}
    print(f"\nGLM-5.3 at degree 2 against 1: {worst}")
    assert max(worst.values()) < 1e-5, worst
    assert lost == [] and not torch.distributed.is_initialized()
