"""The DFlash, EAGLE-1/2 and ViSpec tasks in process, against NeMo AutoModel's own target wrappers (nemo-automodel
0.7.0 from .nemo-packages) on the same model: every tensor the worker computes equals the wrapper's at real positions,
bit for bit, and is zero at padded ones. Through real brokers and workers: tests/test_remote_tasks.py.

Also the tasks' layer ids and the worker's one-line refusals of flags that do not go together.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import WORKER_ENV
from reference import difference_at_real, make_batch, make_packed_batch
from support import preload
from support.images import gemma_batch, qwen_batch
from support.nemo import nemo_on_path

from draftfeed.consumers.engines.hf import HFEngine
from draftfeed.consumers.settings import TaskSettings
from draftfeed.consumers.tasks import load_task
from draftfeed.consumers.tasks.dflash import default_dflash_layer_ids
from draftfeed.consumers.tasks.vispec import image_token_id
from draftfeed.contract.ops import shift_left
from draftfeed.contract.packing import Documents

pytestmark = pytest.mark.timeout(180)
DFLASH_IDS = [1, 4, 7]  # the last is the last decoder layer's output, before the final norm


@pytest.fixture(scope="module")
def nemo() -> SimpleNamespace:
    nemo_on_path()
    from nemo_automodel.components.speculative.dflash.draft_qwen3 import build_target_layer_ids
    from nemo_automodel.components.speculative.dflash.target import HFDFlashTargetModel
    from nemo_automodel.components.speculative.eagle.target_v12 import HFEagleTargetModel
    from nemo_automodel.components.speculative.eagle.vispec_target import HFVispecTargetModel

    return SimpleNamespace(
        build_target_layer_ids=build_target_layer_ids, DFlash=HFDFlashTargetModel, Eagle=HFEagleTargetModel, Vispec=HFVispecTargetModel
    )


@pytest.fixture(scope="module")
def engine(tiny_target):
    torch.set_num_threads(1)  # as the workers run
    return HFEngine(str(tiny_target))


def batches() -> list[dict[str, torch.Tensor]]:
    """Right-padded ragged rows, and packed rows with trailing padding."""
    return [make_batch(3, 24, 1000, seed=4), make_packed_batch([[7, 9, 5], [10, 11]], pad=[3, 3], vocab_size=1000, seed=5)]


def packing(batch: dict[str, torch.Tensor]) -> tuple[Documents | None, dict[str, torch.Tensor]]:
    """The worker's documents and the wrapper's keyword arguments of a batch."""
    if "seq_lens" not in batch:
        return None, {}
    return Documents(seq_lens=batch["seq_lens"], position_ids=batch["position_ids"]), {
        name: batch[name] for name in ("position_ids", "seq_lens", "doc_remaining")
    }


def assert_equal_at(name: str, got: torch.Tensor, expected: torch.Tensor, real: torch.Tensor) -> None:
    """Equal at real positions (``real`` [B, S]), zero elsewhere; a difference is named with where and how large."""
    problem = difference_at_real(name, got, expected, real)
    assert problem is None, problem


@pytest.mark.parametrize("capture_logits", [False, True], ids=["dflash", "jetspec"])
def test_dflash_equals_nemos_wrapper(nemo, engine, tiny_model, capture_logits):
    task = load_task(TaskSettings.of("dflash", DFLASH_IDS, capture_logits=capture_logits), engine)
    wrapper = nemo.DFlash(tiny_model, DFLASH_IDS, capture_logits=capture_logits)
    for batch in batches():
        documents, packed = packing(batch)
        got = task.compute(batch["input_ids"], batch["attention_mask"], batch["loss_mask"], None, documents)
        expected = wrapper.generate_batch(batch["input_ids"], batch["attention_mask"], batch["loss_mask"], **packed)
        assert_equal_at("hidden_states", got["hidden_states"], expected.hidden_states, batch["attention_mask"])
        assert set(got) == ({"hidden_states", "logits"} if capture_logits else {"hidden_states"})
        if capture_logits:
            assert_equal_at("logits", got["logits"], expected.logits, batch["attention_mask"])


def test_dflash_compact_form_sends_the_final_hidden_state_instead_of_logits(engine, tiny_model):
    task = load_task(TaskSettings.of("dflash", DFLASH_IDS, supervision="hidden", capture_logits=True), engine)
    batch = batches()[0]
    got = task.compute(batch["input_ids"], batch["attention_mask"], batch["loss_mask"], None)
    final = tiny_model(**{k: batch[k] for k in ("input_ids", "attention_mask")}, output_hidden_states=True).hidden_states[-1]
    assert set(got) == {"hidden_states", "final_hidden_states"}
    assert_equal_at("final_hidden_states", got["final_hidden_states"], final, batch["attention_mask"])


@pytest.mark.parametrize("form", ["logits", "hidden"])
def test_eagle_equals_nemos_wrapper(nemo, engine, tiny_model, form):
    task = load_task(TaskSettings.of("eagle", supervision=form), engine)
    wrapper = nemo.Eagle(tiny_model)
    for batch in batches():
        documents, packed = packing(batch)
        got = task.compute(batch["input_ids"], batch["attention_mask"], batch["loss_mask"], None, documents)
        expected = wrapper.generate_batch(batch["input_ids"], batch["attention_mask"], batch["loss_mask"], **packed)
        assert_equal_at("input_hidden_states", got["input_hidden_states"], expected.input_hidden_states, batch["attention_mask"])
        if form == "logits":
            assert_equal_at("target_logits", got["target_logits"], expected.target_logits, shift_left(batch["attention_mask"]))
        else:
            assert set(got) == {"input_hidden_states"}  # the rank rebuilds the logits


@pytest.fixture(scope="module")
def image_text(tmp_path_factory) -> dict[str, Path]:
    from draftfeed.tiny import build_tiny_target

    root = tmp_path_factory.mktemp("vispec")
    return {arch: build_tiny_target(root / arch, arch=arch, num_hidden_layers=4) for arch in ("qwen2.5-vl", "gemma3-multimodal")}


@pytest.mark.parametrize("arch", ["qwen2.5-vl", "gemma3-multimodal"])
def test_vispec_equals_nemos_wrapper(nemo, image_text, arch):
    from transformers import AutoConfig, AutoModelForImageTextToText

    torch.set_num_threads(1)
    model = AutoModelForImageTextToText.from_pretrained(image_text[arch], dtype=torch.float32).eval()
    token = image_token_id(AutoConfig.from_pretrained(image_text[arch]))
    task = load_task(TaskSettings.of("vispec", image_token_id=token), HFEngine(str(image_text[arch])))
    wrapper = nemo.Vispec(model, image_token_id=token)
    batch = qwen_batch(model.config, [[(1, 4, 4)], [(1, 4, 4), (1, 2, 4)]], 6) if arch.startswith("qwen") else gemma_batch(model.config, [1, 2], 6)
    images = {name: t for name, t in batch.items() if name not in ("input_ids", "attention_mask", "loss_mask")}
    got = task.compute(batch["input_ids"], batch["attention_mask"], batch["loss_mask"], None, None, images)
    expected = wrapper.generate_batch(batch["input_ids"], batch["attention_mask"], batch["loss_mask"], **images)
    shifted = shift_left(batch["attention_mask"])
    assert_equal_at("inputs_embeds", got["inputs_embeds"], expected.inputs_embeds, shifted)
    assert_equal_at("input_hidden_states", got["input_hidden_states"], expected.input_hidden_states, batch["attention_mask"])
    assert_equal_at("target_logits", got["target_logits"], expected.target_logits, shifted)
    assert expected.image_mask.any()  # the batch has images where the rank's image mask says so (built on the rank)


def test_the_default_dflash_layers_are_the_recipes(nemo):
    for layers in range(5, 96):
        for draft_layers in range(1, 9):
            assert default_dflash_layer_ids(layers, draft_layers) == nemo.build_target_layer_ids(layers, draft_layers), (layers, draft_layers)


@pytest.mark.parametrize(
    "arguments, message",
    [
        (["--task", "eagle", "--capture-logits"], "--capture-logits is DFlash's (JetSpec's logits); --task eagle does not take it"),
        (["--task", "dflash", "--supervision", "hidden"], "--supervision hidden: DFlash sends logits only with --capture-logits"),
        (["--task", "eagle", "--supervision", "probs"], "--supervision probs: task eagle is sent as logits or hidden"),
        (["--task", "vispec", "--aux-layer-ids", "1,2,3"], "--aux-layer-ids does not apply to --task vispec"),
        (["--task", "eagle3", "--target-layer-ids", "1,2"], "--target-layer-ids does not apply to --task eagle3"),
        (["--task", "vispec"], "--task vispec needs an image-text target: this llama config has no image_token_id or image_token_index"),
    ],
    ids=["capture-logits", "compact-without-logits", "form", "layers-eagle3", "layers-vispec", "text-only"],
)
def test_flags_that_do_not_go_together_are_one_line(tiny_target, arguments, message):
    argv = ["worker", "--broker", "tcp://127.0.0.1:9", "--target", str(tiny_target), *arguments]
    result = preload.run_module("draftfeed.launch", argv, {**os.environ, **WORKER_ENV}, 120)
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and message in result.stderr.strip().splitlines()[-1], result.stderr  # the last line, alone


@pytest.mark.parametrize(
    "layer_ids, message",
    [
        (
            [1, 8],
            "--target-layer-ids [1, 8]: layer 8 does not exist in a 8-layer target; pass --target-layer-ids with distinct decoder layers in [0, 7]",
        ),
        ([3, 3], "--target-layer-ids [3, 3] repeat a layer"),
        ([], "--target-layer-ids []: DFlash needs at least one layer"),
    ],
)
def test_dflash_layer_ids_are_checked_in_one_line(engine, layer_ids, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        load_task(TaskSettings.of("dflash", layer_ids), engine)


def test_the_vispec_worker_refuses_packed_rows(image_text):
    from draftfeed.schemas.errors import BadRequest

    task = load_task(TaskSettings.of("vispec", image_token_id=997), HFEngine(str(image_text["qwen2.5-vl"])))
    batch = make_packed_batch([[5, 6], [11]], pad=[0, 0], vocab_size=990, seed=1)
    with pytest.raises(BadRequest, match=r"ViSpec takes no packed rows \(seq_lens\): send one sequence a row"):
        task.compute(batch["input_ids"], batch["attention_mask"], batch["loss_mask"], None, packing(batch)[0])
