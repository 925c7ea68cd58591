"""The sglang engine, run against a FAKE sglang (tests/fake_sglang), since sglang cannot be installed here.

The fake has the module paths, names and call signatures the adapter uses (sglang 0.5.9's), and copies
sglang's capture semantics (``set_eagle3_layers_to_capture(ids)`` keeps what enters layer id + 1; the
logits processor stores the aux states under ``CaptureHiddenMode.FULL``), computed with transformers on CPU.

What this proves: the adapter's own logic, i.e. one request per row holding only its real tokens,
results put back at the right positions, HF layer ids passed through unchanged, full logits and the final norm's
output taken from the logits processor, pools cleared between requests, the refusals and the version gate.

Tasks (issue 29): EAGLE-3 (both forms), DSpark without id -1, DFlash at layers 0..L-2 (with JetSpec's logits, both
forms), EAGLE-1/2 (both forms) equal hf within 1e-6; refused at start in one line: the last layer L - 1 as an EAGLE-3
aux id or a DFlash layer, and the embeddings (DSpark's id -1, ViSpec's inputs_embeds). What it does
NOT prove: that the real sglang's internals have these signatures and behave this way (they move between
versions), nor sglang's numerics on a GPU; that needs a run against a real sglang install.

Tensor parallel (issue 26): ``load_engine(TargetSettings(engine="sglang", path=..., tensor_parallel=2))`` runs this process and one follower
process, each a fake ``ModelRunner`` at its tp_rank, joined in a gloo group on the worker's ``engine_port``; the fake
holds vocab shards of the embeddings and lm_head and runs collectives in every forward. That proves the
orchestration (ranks in step, sglang's group set up and torn down by the runner, embeddings gathered from shards),
not sglang's sharded layers, NCCL or GPUs.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest
import torch
from conftest import make_batch

from draftfeed.consumers.engines import load_engine
from draftfeed.consumers.engines.base import Capture
from draftfeed.consumers.settings import TargetSettings, TaskSettings
from draftfeed.consumers.tasks import load_task

TESTS = str(Path(__file__).parent)
FAKE = str(Path(__file__).parent / "fake_sglang")
LAYERS = 6
AUX_IDS = [0, 2, 4]


def forget_sglang() -> None:
    for name in [name for name in sys.modules if name == "sglang" or name.startswith("sglang.")]:
        del sys.modules[name]


@pytest.fixture
def fake_sglang(monkeypatch):
    forget_sglang()
    monkeypatch.syspath_prepend(FAKE)
    import sglang

    assert "fake" in (sglang.__doc__ or "").lower()
    yield sglang
    forget_sglang()


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    from draftfeed.tiny import build_tiny_target

    return build_tiny_target(tmp_path_factory.mktemp("sglang") / "tiny", num_hidden_layers=LAYERS, hidden_size=64, vocab_size=512)


@pytest.fixture
def engine(fake_sglang, target):
    from draftfeed.consumers.engines.sglang import SGLangEngine

    engine = SGLangEngine(str(target), device="cpu", dtype="float32")
    yield engine
    engine.close()


def test_eagle3_supervision_equals_hf(engine, target):
    hf = load_engine(TargetSettings(engine="hf", path=str(target), device="cpu", dtype="float32"))
    batch = make_batch(3, 24, 512, seed=3)
    assert not bool(batch["attention_mask"].all())  # padded rows
    args = (batch["input_ids"], batch["attention_mask"], batch["loss_mask"], None)
    task = load_task(TaskSettings.of("eagle3", AUX_IDS), engine)
    expected = load_task(TaskSettings.of("eagle3", AUX_IDS), hf).compute(*args)
    for _ in range(2):  # a second batch runs only if the pools were cleared
        got = task.compute(*args)
        assert set(got) == set(expected)
        for name, tensor in expected.items():
            assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, name
            assert torch.allclose(got[name].float(), tensor.float(), rtol=0, atol=1e-6), name
    assert engine.shape.num_hidden_layers == LAYERS and engine.shape.vocab_size == 512
    assert torch.equal(engine.input_embeddings(), hf.input_embeddings())
    assert torch.equal(engine.output_embeddings(), hf.output_embeddings())


def test_packed_rows_run_each_document_as_its_own_request_and_equal_hf(engine, target):
    from reference import make_packed_batch

    from draftfeed.contract.packing import check_packing

    hf = load_engine(TargetSettings(engine="hf", path=str(target), device="cpu", dtype="float32"))
    batch = make_packed_batch([[7, 5, 9], [21]], pad=[3, 3], vocab_size=512, seed=5)
    documents = check_packing(batch["attention_mask"], batch["position_ids"], batch["seq_lens"])
    args = (batch["input_ids"], batch["attention_mask"], batch["loss_mask"], None, documents)
    expected = load_task(TaskSettings.of("eagle3", AUX_IDS), hf).compute(*args)
    got = load_task(TaskSettings.of("eagle3", AUX_IDS), engine).compute(*args)
    for name, tensor in expected.items():
        assert torch.allclose(got[name].float(), tensor.float(), rtol=0, atol=1e-6), name


def test_padding_and_empty_rows_are_zero(engine):
    engine.prepare([Capture(layer_ids=(1,), logits=True)])
    ids = torch.tensor([[5, 6, 7, 0], [0, 0, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 0], [0, 0, 0, 0]])
    out = engine.forward(ids, mask, Capture(layer_ids=(1,), logits=True))
    assert out.logits is not None and out.logits.shape == (2, 4, 512)
    assert not out.logits[0, :3].eq(0).all()
    assert out.logits[0, 3].eq(0).all() and out.logits[1].eq(0).all()
    assert out.layer_outputs[1][1].eq(0).all()


@pytest.fixture(scope="module")
def hf(target):
    return load_engine(TargetSettings(engine="hf", path=str(target), device="cpu", dtype="float32"))


def assert_agrees(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], label: str) -> None:
    """The same fields, dtypes and shapes as hf, every value within 1e-6 (the fake runs each row alone); the largest
    difference printed."""
    assert set(got) == set(expected), f"{label}: {sorted(got)} != {sorted(expected)}"
    worst = {}
    for name, tensor in expected.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, f"{label} {name}"
        worst[name] = float((got[name].double() - tensor.double()).abs().max())
        assert worst[name] <= 1e-6, f"{label} {name}: largest |difference| {worst[name]:.2e} > 1e-6"
    print(f"\n{label} vs hf, largest |difference|: " + ", ".join(f"{name} {value:.1e}" for name, value in worst.items()))


def task_args(seed: int) -> tuple[torch.Tensor, ...]:
    batch = make_batch(3, 24, 512, seed=seed)
    return batch["input_ids"], batch["attention_mask"], batch["loss_mask"], None


# The final norm's output is what the model hands its logits processor, kept beside the aux layers (FullLogits).
@pytest.mark.parametrize(
    ("task", "options"),
    [
        ("eagle3", {"layer_ids": AUX_IDS, "supervision": "hidden"}),
        ("dspark", {"layer_ids": [0, 2, LAYERS - 1]}),  # L - 1: the final norm's output
        ("dflash", {"layer_ids": [0, 2, LAYERS - 2], "capture_logits": True}),  # JetSpec's logits
        ("dflash", {"layer_ids": [0, 2, LAYERS - 2], "capture_logits": True, "supervision": "hidden"}),
        ("dflash", {"draft_layers": 2}),  # the recipe's default layers (1 and L - 3), no logits
        ("eagle", {}),
        ("eagle", {"supervision": "hidden"}),
    ],
)
def test_tasks_that_need_the_final_hidden_state_or_logits_equal_hf(engine, hf, task, options):
    args = task_args(seed=4)
    got = load_task(TaskSettings.of(task, **options), engine).compute(*args)
    assert_agrees(got, load_task(TaskSettings.of(task, **options), hf).compute(*args), f"{task} {options}")


@pytest.mark.parametrize(
    ("task", "options", "match"),
    [
        ("dspark", {"layer_ids": [-1, 1, 2]}, r"embeddings .*DSpark's layer id -1.*use --engine hf or vllm"),
        ("vispec", {"image_token_id": 511}, r"embeddings .*ViSpec's inputs_embeds.*use --engine hf or vllm"),
        (
            "eagle3",
            {"layer_ids": [0, 2, LAYERS - 1]},
            rf"cannot capture layer ids \[{LAYERS - 1}\].*choose layers below {LAYERS - 1}, or use --engine hf or vllm",
        ),
        ("dflash", {"layer_ids": [1, 3, LAYERS - 1]}, rf"cannot capture layer ids \[{LAYERS - 1}\].*last layer {LAYERS - 1}'s output"),
    ],
)
def test_refuses_what_sglang_cannot_capture_in_one_line(engine, task, options, match):
    with pytest.raises(ValueError, match=match) as refused:
        load_task(TaskSettings.of(task, **options), engine)
    assert "\n" not in str(refused.value)


def test_missing_sglang_is_a_clear_error(monkeypatch, target):
    forget_sglang()
    monkeypatch.setitem(sys.modules, "sglang", None)  # import sglang fails, whatever is installed
    from draftfeed.consumers.engines.sglang import SGLangEngine

    with pytest.raises(ValueError, match=r"needs sglang.*sglang >=0\.5\.9,<0\.6"):
        SGLangEngine(str(target), device="cpu")


def test_wrong_version_is_refused(fake_sglang, monkeypatch, target):
    from draftfeed.consumers.engines.sglang import SGLangEngine

    monkeypatch.setattr(fake_sglang, "__version__", "0.4.0")
    monkeypatch.delenv("DRAFTFEED_SKIP_ENGINE_VERSION_CHECK", raising=False)
    with pytest.raises(ValueError, match=r"sglang 0\.4\.0 is installed.*>=0\.5\.9,<0\.6"):
        SGLangEngine(str(target), device="cpu")


def test_own_options_are_refused(fake_sglang, target):
    from draftfeed.consumers.engines.sglang import SGLangEngine

    with pytest.raises(ValueError, match="sets these itself"):
        SGLangEngine(str(target), device="cpu", model_path="x")


def test_close_tears_down(engine, fake_sglang):
    from sglang._fake import DESTROYED

    engine.prepare([Capture(layer_ids=(0,), logits=True)])
    DESTROYED.clear()
    engine.close()
    assert DESTROYED == ["model_parallel", "distributed_environment"]
    engine.close()  # a second close does nothing


def test_parallel_options_are_refused(fake_sglang, target):
    from draftfeed.consumers.engines.sglang import SGLangEngine

    with pytest.raises(ValueError, match=r"^--engine-option tp_size: set --tensor-parallel N instead"):
        SGLangEngine(str(target), device="cpu", tp_size=2)
    with pytest.raises(ValueError, match=r"^--engine-option tp_size: set --tensor-parallel N instead"):
        load_engine(TargetSettings(engine="sglang", path=str(target), device="cpu", dtype="float32", engine_options={"tp_size": 1}))
    with pytest.raises(ValueError, match=r"^--engine-option pp_size: .*--tensor-parallel N"):
        SGLangEngine(str(target), device="cpu", pp_size=2)


@pytest.fixture
def no_sigterm():
    """A SIGTERM to this process (TensorParallelEngine's default on_lost) is recorded, not obeyed: pytest lives on."""
    received: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: received.append(signum))
    yield received
    signal.signal(signal.SIGTERM, previous)


TP_TASKS = {"eagle": {}, "dflash": {"layer_ids": [1, 3], "capture_logits": True}}


def test_tensor_parallel_2_equals_tp_1(fake_sglang, target, monkeypatch, no_sigterm):
    import torch.distributed as dist

    from draftfeed.consumers.engines.parallel.engine import TensorParallelEngine
    from draftfeed.consumers.engines.sglang import SGLangEngine

    # The follower processes import the fake too, and compute with one thread as this process does.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [FAKE, TESTS, os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    batch = make_batch(3, 24, 512, seed=3)
    args = (batch["input_ids"], batch["attention_mask"], batch["loss_mask"], None)
    one = SGLangEngine(str(target), device="cpu", dtype="float32")
    try:
        expected = load_task(TaskSettings.of("eagle3", AUX_IDS), one).compute(*args)
        # EAGLE-1/2 and JetSpec: the final hidden state and the logits kept by every rank's logits processor
        others = {task: load_task(TaskSettings.of(task, **options), one).compute(*args) for task, options in TP_TASKS.items()}
        embeddings = (one.input_embeddings(), one.output_embeddings())
    finally:
        one.close()
    assert not dist.is_initialized()  # at tp 1 the fake makes no group

    engine = load_engine(TargetSettings(engine="sglang", path=str(target), device="cpu", dtype="float32", tensor_parallel=2))
    pids = engine.pids
    try:
        assert isinstance(engine, TensorParallelEngine) and len(pids) == 2
        task = load_task(TaskSettings.of("eagle3", AUX_IDS), engine)  # prepare starts sglang on every rank
        runner = engine.inner._runner
        assert (runner.tp_rank, runner.tp_size, runner.gpu_id, runner.server_args.tp_size) == (0, 2, 0, 2)
        assert dist.is_initialized() and dist.get_world_size() == 2  # sglang's group (the fake's), not draftfeed's
        assert runner.model.lm_head.weight.shape == (256, 64)  # this rank's half of the vocab
        for _ in range(2):
            got = task.compute(*args)
            assert set(got) == set(expected)
            for name, tensor in expected.items():
                assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
        for name, options in TP_TASKS.items():
            got = load_task(TaskSettings.of(name, **options), engine).compute(*args)
            assert set(got) == set(others[name]) and all(torch.equal(got[key], others[name][key]) for key in got), name
        assert torch.equal(engine.input_embeddings(), embeddings[0])
        assert torch.equal(engine.output_embeddings(), embeddings[1])

    finally:
        engine.close()
    assert engine.lost is None and no_sigterm == []
    for pid in pids[1:]:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert not dist.is_initialized()  # sglang's group left with its runner
