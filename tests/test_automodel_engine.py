"""The automodel engine (issue 47): the target under NeMo AutoModel's own model code. DSpark and EAGLE-3 supervision
of draftfeed's tasks over it equal NeMo's own wrappers (HFDSparkTargetModel, HFEagle3TargetModel) around NeMo's own
model of the same checkpoint in process, bit for bit at real positions, on a padded batch: DeepSeek-V4.1, which only
NeMo implements (its DSpark features are the model's own: the streams entering each chosen layer), and DeepSeek-V3,
which transformers implements too, and GLM-5 (glm_moe_dsa). What it cannot run is refused in one line at start (NeMo code
that asks for a GPU on a CPU: Qwen3-MoE). Through a real worker: the
DeepSeek-V4.1 recipe test (tests/test_nemo_frontier.py)."""

from __future__ import annotations

import pytest
import torch
from conftest import make_batch
from reference import difference_at_real
from support.nemo import nemo_on_path, nemo_reference

from draftfeed.consumers.tasks.dspark import DSparkTask
from draftfeed.consumers.tasks.eagle3 import Eagle3Task

pytestmark = pytest.mark.timeout(240)

DSPARK_IDS, AUX_IDS = [1, 3, 5], [1, 2, 3]


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    nemo_on_path()
    from draftfeed.tiny import build_tiny_nemo_target, build_tiny_target

    folder = tmp_path_factory.mktemp("automodel")
    return {
        "deepseek-v41": build_tiny_nemo_target(folder / "deepseek-v41", vocab_size=256),
        "deepseek-v3": build_tiny_target(folder / "deepseek-v3", arch="deepseek-v3", num_hidden_layers=6, vocab_size=256),
        "glm-moe-dsa": build_tiny_target(folder / "glm-moe-dsa", arch="glm-moe-dsa", num_hidden_layers=6, vocab_size=256),
    }


@pytest.mark.parametrize("family", ["deepseek-v41", "deepseek-v3", "glm-moe-dsa"])
def test_dspark_and_eagle3_equal_nemos_wrappers_over_nemos_model(family, targets):
    from nemo_automodel.components.speculative.dspark.target import HFDSparkTargetModel
    from nemo_automodel.components.speculative.eagle.target import HFEagle3TargetModel

    from draftfeed.consumers.engines.automodel import AutoModelEngine

    engine, model = AutoModelEngine(str(targets[family]), device="cpu", dtype="float32"), nemo_reference(targets[family])
    assert engine.model_features == (family == "deepseek-v41")
    batch = make_batch(2, 24, 256, seed=13)
    ids, mask, loss = batch["input_ids"], batch["attention_mask"], batch["loss_mask"]
    assert not mask.all(), "the batch must be padded"
    dspark = DSparkTask(engine, target_layer_ids=DSPARK_IDS).compute(ids, mask, loss)
    want = HFDSparkTargetModel(model, DSPARK_IDS).generate_batch(ids, mask, loss)
    problems = [
        difference_at_real("target_hidden_states", dspark["target_hidden_states"], want.target_hidden_states, mask),
        difference_at_real("target_last_hidden_states", dspark["target_last_hidden_states"], want.target_last_hidden_states, mask),
    ]
    eagle3 = Eagle3Task(engine, aux_layer_ids=AUX_IDS).compute(ids, mask, loss)
    aux = HFEagle3TargetModel(model, AUX_IDS).generate_batch(ids, mask, loss).aux_hidden_states
    problems.append(difference_at_real("aux_hidden_states", eagle3["aux_hidden_states"], aux, mask))
    assert [p for p in problems if p] == []


def test_what_the_automodel_engine_cannot_run_is_refused_in_one_line(targets, tmp_path):
    from draftfeed.consumers.engines.automodel import AutoModelEngine

    with pytest.raises(ValueError, match=r"^--engine-option attn=te runs on CUDA only in NeMo AutoModel; on a CPU use --engine-option attn=sdpa"):
        AutoModelEngine(str(targets["deepseek-v41"]), device="cpu", attn="te")
    from draftfeed.tiny import build_tiny_target

    gemma = build_tiny_target(tmp_path / "gemma3", arch="gemma3", num_hidden_layers=2, vocab_size=256)
    with pytest.raises(
        ValueError, match=r"^NeMo AutoModel has no model implementation of its own for Gemma3ForCausalLM; serve this target with --engine hf"
    ):
        AutoModelEngine(str(gemma), device="cpu")
    qwen3_moe = build_tiny_target(tmp_path / "qwen3-moe", arch="qwen3-moe", num_hidden_layers=2, vocab_size=256)
    with pytest.raises(ValueError, match=r"^NeMo AutoModel's Qwen3MoeForCausalLM cannot be built here: its code asks for a GPU while it is built"):
        AutoModelEngine(str(qwen3_moe), device="cpu")  # NeMo 0.7.0 puts its rotary cache on cuda:N, whatever the device
    from nemo_automodel.components.models.kimi_k3.config import KimiK3Config

    KimiK3Config().save_pretrained(tmp_path / "kimi-k3")  # the released shape's config: refused before any weight is read
    with pytest.raises(ValueError, match=r"Kimi-K3's linear attention \(KDA\) runs .* on the fla package's Triton and CUDA kernels only") as refused:
        AutoModelEngine(str(tmp_path / "kimi-k3"), device="cpu")
    assert "serve it on GPUs (--device cuda)" in str(refused.value) and "\n" not in str(refused.value)


@pytest.mark.parametrize("family", ["deepseek-v41", "deepseek-v3"])
def test_an_update_in_place_equals_a_fresh_start_from_the_same_weights(family, targets, tmp_path):
    """Weight updates (issue 48) on the automodel engine, under the checkpoint's names and mapped by NeMo's own
    adapter (DeepSeek-V3's experts stacked): a step of decoder layer 1 from a file gives DSpark supervision equal bit
    for bit to an engine started fresh from a checkpoint holding those weights; part of a layer is refused naming
    what is missing; the original layer published back (pulled whole into memory) gives the first supervision again."""
    import shutil

    from safetensors.torch import load_file, save_file
    from support.weights import publish_into

    from draftfeed.consumers.engines.automodel import AutoModelEngine
    from draftfeed.dataplane.weights.worker import UpdateRefused
    from draftfeed.schemas.messages import UpdateWeights

    target = targets[family]
    batch = make_batch(2, 24, 256, seed=21)

    def supervise(engine) -> dict:
        return DSparkTask(engine, target_layer_ids=DSPARK_IDS).compute(batch["input_ids"], batch["attention_mask"], batch["loss_mask"])

    def differences(got: dict, want: dict) -> list[str]:
        return [p for name in want if (p := difference_at_real(name, got[name], want[name], batch["attention_mask"]))]

    files = {file.name: load_file(str(file)) for file in sorted(target.glob("*.safetensors"))}
    layer = {name: t for saved in files.values() for name, t in saved.items() if name.startswith(("model.layers.1.", "layers.1."))}
    step = {name: t + 0.01 if t.is_floating_point() else t for name, t in layer.items()}
    save_file(step, str(tmp_path / "step.safetensors"))
    stepped = tmp_path / "stepped"
    shutil.copytree(target, stepped)
    for file_name, saved in files.items():
        save_file({name: step.get(name, t) for name, t in saved.items()}, str(stepped / file_name))

    engine = AutoModelEngine(str(target), device="cpu", dtype="float32")
    before = supervise(engine)
    engine.update_weights(UpdateWeights(update=1, weights=str(tmp_path / "step.safetensors"), target_version=1), check_finite=True)
    after = supervise(engine)
    assert differences(after, before), "the step changed nothing"
    assert differences(after, supervise(AutoModelEngine(str(stepped), device="cpu", dtype="float32"))) == []

    part = dict(list(step.items())[:1])
    save_file(part, str(tmp_path / "part.safetensors"))
    with pytest.raises(UpdateRefused, match=r"engine automodel loads an update a decoder layer at a time .* are not in it"):
        engine.update_weights(UpdateWeights(update=2, weights=str(tmp_path / "part.safetensors"), target_version=2), check_finite=True)
    assert differences(supervise(engine), after) == []

    publish_into(engine, layer, update=3)
    assert differences(supervise(engine), before) == []


@pytest.fixture(scope="module")
def sharded_reference(targets, tmp_path_factory):
    """NeMo's own model of each target over 2 processes, experts over both (tests/automodel_reference.py), with NeMo's
    wrappers around it."""
    from support.automodel import sharded_reference

    return sharded_reference(
        {family: targets[family] for family in SHARDED}, tmp_path_factory.mktemp("automodel-reference") / "reference.safetensors"
    )


# Only NeMo implements the first; transformers implements the second too. Both run in make test-long (with their
# reference, about 2 minutes on 2 cores): make test keeps the single-process cases above, to stay within its 10 minutes.
SHARDED = ("deepseek-v41", "deepseek-v3")


@pytest.mark.long
@pytest.mark.parametrize("family", SHARDED)
def test_over_two_processes_with_experts_spread_equals_nemos_own_sharded_model(family, targets, sharded_reference, tmp_path, monkeypatch):
    """``--engine automodel --tensor-parallel 2 --expert-parallel``: the worker's two processes (this one and a follower
    it starts) shard NeMo's model as NeMo's recipes do (FSDP, experts over both ranks); DSpark and EAGLE-3 supervision
    equal NeMo's own wrappers around NeMo's own model sharded the same way in two processes of the test's own, bit for
    bit at real positions, and rank 0 holds about half the parameters after its forwards. On DeepSeek-V4.1, a file
    update lands in every rank's shards: it changes the supervision, and the old layer put back gives the first
    supervision again, bit for bit."""

    from automodel_reference import AUX_IDS, batches
    from conftest import WORKER_ENV
    from safetensors.torch import load_file, save_file
    from support.automodel import nemo_path_env

    from draftfeed.consumers.engines.parallel.engine import TensorParallelEngine
    from draftfeed.schemas.messages import UpdateWeights

    monkeypatch.setenv("PYTHONPATH", nemo_path_env()["PYTHONPATH"])  # the follower's
    monkeypatch.setenv("OMP_NUM_THREADS", WORKER_ENV["OMP_NUM_THREADS"])  # the follower's threads, the reference's
    lost: list[str] = []
    engine = TensorParallelEngine("automodel", str(targets[family]), ["cpu", "cpu"], "float32", expert_parallel=True, on_lost=lost.append)
    ids, mask, loss = (batches()["one"][key] for key in ("input_ids", "attention_mask", "loss_mask"))

    def supervise() -> dict:
        dspark = DSparkTask(engine, target_layer_ids=DSPARK_IDS).compute(ids, mask, loss)
        eagle3 = Eagle3Task(engine, aux_layer_ids=AUX_IDS).compute(ids, mask, loss)
        return {f"dspark/{name}": dspark[name] for name in ("target_hidden_states", "target_last_hidden_states")} | {
            "eagle3/aux_hidden_states": eagle3["aux_hidden_states"]
        }

    def differences(got: dict, want: dict) -> list[str]:
        return [p for name in want if (p := difference_at_real(name, got[name], want[name], mask))]

    try:
        assert engine.model_features == (family == "deepseek-v41")
        first = supervise()
        assert differences(first, {name: sharded_reference[f"{family}/one/{name}"] for name in first}) == []
        held = [(p.to_local().numel(), p.numel()) for p in engine.inner.model.parameters()]  # rank 0's shards, after forwards
        assert sum(mine for mine, _ in held) <= 0.55 * sum(whole for _, whole in held), "rank 0 holds more than its half of the target"
        if family != "deepseek-v41":
            return  # the update below is the same code for every family: run once, to keep make test short
        saved = {name: t for file in sorted(targets[family].glob("*.safetensors")) for name, t in load_file(str(file)).items()}
        layer = {name: t for name, t in saved.items() if name.startswith(("model.layers.1.", "layers.1."))}
        save_file({name: t + 0.01 if t.is_floating_point() else t for name, t in layer.items()}, str(tmp_path / "step.safetensors"))
        save_file(layer, str(tmp_path / "back.safetensors"))
        engine.update_weights(UpdateWeights(update=1, weights=str(tmp_path / "step.safetensors"), target_version=1), check_finite=True)
        assert differences(supervise(), first), "the step changed nothing"
        engine.update_weights(UpdateWeights(update=2, weights=str(tmp_path / "back.safetensors"), target_version=2), check_finite=True)
        assert differences(supervise(), first) == []
        assert lost == []
    finally:
        engine.close()


@pytest.mark.long
@pytest.mark.timeout(400)
def test_a_worker_killed_mid_run_leaves_the_run_to_another_every_batch_once_in_order(targets, sharded_reference, fast_cluster):
    """Two workers of ``--engine automodel --tensor-parallel 2 --expert-parallel`` (DeepSeek-V4.1, DSpark); one is
    SIGKILLed after the third batch. The run completes on the other: every batch once, in order, each equal bit for
    bit to NeMo's own model sharded alike (the reference); the killed worker's follower does not outlive it."""
    from automodel_reference import RUN_BATCHES, batches
    from conftest import run_concurrently, wait_until
    from support.automodel import nemo_path_env
    from test_tensor_parallel import follower_pid, gone

    from draftfeed import RemoteDSparkTarget

    env = nemo_path_env()
    flags = ["--engine", "automodel", "--tensor-parallel", "2", "--expert-parallel", "--task", "dspark", "--target-layer-ids", "1,3,5"]
    target = targets["deepseek-v41"]
    starts = [
        lambda name=name: fast_cluster.add_worker(target, *flags, "--service", "am-run", "--name", name, env=env) for name in ("doomed", "survivor")
    ]
    run_concurrently(*starts, timeout_s=300)
    doomed = next(worker for worker in fast_cluster.workers if worker.ready["worker"].startswith("doomed"))
    follower = follower_pid(doomed)
    named = batches()
    names = [f"run-{i}" for i in range(RUN_BATCHES)]
    results = []
    with RemoteDSparkTarget(fast_cluster.frontend, "am-run", prefetch_depth=3) as remote:
        for index, (batch, supervision) in enumerate(remote.iterate(named[name] for name in names)):
            results.append((batch, supervision))
            if index == 2:
                doomed.kill()
    assert [batch is named[name] for (batch, _), name in zip(results, names)] == [True] * len(names), "a batch missing, repeated or out of order"
    problems = [
        problem
        for name, (batch, supervision) in zip(names, results)
        for field in ("target_hidden_states", "target_last_hidden_states")
        if (
            problem := difference_at_real(
                f"{name} {field}", getattr(supervision, field), sharded_reference[f"deepseek-v41/{name}/dspark/{field}"], batch["attention_mask"]
            )
        )
    ]
    assert problems == []
    wait_until(lambda: gone(follower), timeout_s=15, what=f"the killed worker's follower (pid {follower}) to die with it")
    assert fast_cluster.status()["counters"]["requests_failed"] == 0


def block_fp8_copy(source, fp8, dequantized, block: int = 128) -> None:
    """``source``'s checkpoint as DeepSeek ships it (every projection's weight in float8_e4m3fn, one float32
    ``weight_scale_inv`` per 128 x 128 block, its ``quantization_config`` saying so) in ``fp8``, and in
    ``dequantized`` the float32 weights those give back (each block's float8 values times its scale)."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    quantized, back = {}, {}
    for name, tensor in load_file(str(source / "model.safetensors")).items():
        if not (name.endswith("proj.weight") and tensor.dim() == 2):
            quantized[name] = back[name] = tensor
            continue
        rows, cols = tensor.shape
        scales = torch.zeros(-(-rows // block), -(-cols // block))
        values, restored = torch.empty_like(tensor, dtype=torch.float8_e4m3fn), torch.empty_like(tensor)
        for i in range(scales.shape[0]):
            for j in range(scales.shape[1]):
                where = (slice(i * block, (i + 1) * block), slice(j * block, (j + 1) * block))
                scales[i, j] = tensor[where].abs().max().clamp(min=1e-12) / torch.finfo(torch.float8_e4m3fn).max
                values[where] = (tensor[where] / scales[i, j]).to(torch.float8_e4m3fn)
                restored[where] = values[where].float() * scales[i, j]
        quantized[name], quantized[f"{name}_scale_inv"], back[name] = values, scales, restored
    for folder, weights in ((fp8, quantized), (dequantized, back)):
        shutil.copytree(source, folder)
        save_file(weights, str(folder / "model.safetensors"))
    config = json.loads((fp8 / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [block, block], "activation_scheme": "dynamic"}
    (fp8 / "config.json").write_text(json.dumps(config))


def test_a_block_fp8_deepseek_checkpoint_loads_as_shipped_dequantized_by_nemos_adapter(targets, tmp_path):
    """DeepSeek-V3 (and Kimi-K2) ship block-FP8 weights. The automodel engine loads such a checkpoint on a CPU through
    NeMo's own adapter, which dequantizes each weight with its block scales as it maps it: DSpark supervision equals
    bit for bit that of a float32 checkpoint holding the dequantized weights. The hf engine refuses it on a CPU in one
    line that names this engine."""
    from draftfeed.consumers.engines.automodel import AutoModelEngine
    from draftfeed.consumers.engines.hf import quantization_problem

    fp8, dequantized = tmp_path / "fp8", tmp_path / "dequantized"
    block_fp8_copy(targets["deepseek-v3"], fp8, dequantized)
    batch = make_batch(2, 24, 256, seed=13)
    got, want = (
        DSparkTask(AutoModelEngine(str(path), device="cpu", dtype="float32"), target_layer_ids=DSPARK_IDS).compute(
            batch["input_ids"], batch["attention_mask"], batch["loss_mask"]
        )
        for path in (fp8, dequantized)
    )
    problems = [
        difference_at_real(name, got[name], want[name], batch["attention_mask"]) for name in ("target_hidden_states", "target_last_hidden_states")
    ]
    assert [p for p in problems if p] == []
    said = quantization_problem(str(fp8), "cpu")
    assert said is not None and "--engine automodel" in said and "\n" not in said, said


@pytest.mark.parametrize("family", ["deepseek-v41", "deepseek-v3", "glm-moe-dsa"])
def test_packed_rows_run_each_document_as_a_row_of_its_own(family, targets):
    """A packed batch (two and three documents, then padding) on the automodel engine: DSpark supervision equals, bit
    for bit at real positions, NeMo's wrapper around NeMo's model over the same documents as rows of their own (each
    from position 0, right-padded to the longest), put back at the documents' positions; padded positions are zeros."""
    from nemo_automodel.components.speculative.dspark.target import HFDSparkTargetModel
    from reference import make_packed_batch

    from draftfeed.consumers.engines.automodel import AutoModelEngine
    from draftfeed.contract.packing import Documents

    packed = make_packed_batch([[5, 7], [4, 4, 3]], [2, 3], 256, seed=14)
    ids, mask, loss = packed["input_ids"], packed["attention_mask"], packed["loss_mask"]
    documents = Documents(seq_lens=packed["seq_lens"], position_ids=packed["position_ids"])
    engine = AutoModelEngine(str(targets[family]), device="cpu", dtype="float32")
    got = DSparkTask(engine, target_layer_ids=DSPARK_IDS).compute(ids, mask, loss, documents=documents)
    segments = documents.segments(mask)
    assert len(segments) == 5
    longest = max(len(positions) for _, positions in segments)
    rows = {
        name: torch.zeros(len(segments), longest, dtype=tensor.dtype)
        for name, tensor in (("input_ids", ids), ("attention_mask", mask), ("loss_mask", loss))
    }
    for index, (row, positions) in enumerate(segments):
        for name, tensor in (("input_ids", ids), ("attention_mask", mask), ("loss_mask", loss)):
            rows[name][index, : len(positions)] = tensor[row, positions]
    alone = HFDSparkTargetModel(nemo_reference(targets[family]), DSPARK_IDS).generate_batch(**rows)
    problems = []
    for name in ("target_hidden_states", "target_last_hidden_states"):
        want = torch.zeros_like(got[name])
        for index, (row, positions) in enumerate(segments):
            want[row, positions] = getattr(alone, name)[index, : len(positions)]
        problems.append(difference_at_real(f"packed {name}", got[name], want, mask))
    assert [p for p in problems if p] == []


@pytest.mark.long
def test_a_layout_nemo_cannot_shard_is_refused_in_one_line(targets, monkeypatch):
    """DeepSeek-V3's 16 experts over 3 processes: NeMo's parallelizer refuses (an assertion); the worker says so in one
    line naming what to change, instead of a traceback."""

    from support.automodel import nemo_path_env

    from draftfeed.consumers.engines.parallel.engine import TensorParallelEngine

    monkeypatch.setenv("PYTHONPATH", nemo_path_env()["PYTHONPATH"])
    with pytest.raises(ValueError) as refused:
        TensorParallelEngine("automodel", str(targets["deepseek-v3"]), ["cpu"] * 3, "float32", expert_parallel=True, on_lost=lambda _why: None)
    said = str(refused.value)
    assert "\n" not in said and said.startswith("NeMo AutoModel cannot shard its DeepseekV3ForCausalLM over 3 processes with --expert-parallel"), said
    assert "n_routed_experts 16 must be divisible by expert_parallel_degree 3" in said and "leave --expert-parallel out" in said, said
