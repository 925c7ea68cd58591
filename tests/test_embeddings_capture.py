"""What "the embeddings" are on an image-text target (issue 34): DSpark's layer id -1 and ViSpec's ``inputs_embeds``
are one tensor, the input of decoder layer 0 as the target's own forward gives it, the vision features merged in at
the image tokens (``output_hidden_states[0]``; docs/contract.md, "Image-text targets").

Measured against NeMo AutoModel 0.7.0 in process, on Qwen2.5-VL, Qwen3-VL-MoE, Gemma 3 and Llama 4 with images:
every DSpark tensor equals NeMo's ``HFDSparkTargetModel`` bit for bit at real positions but one slice: layer -1 at
the image tokens, where NeMo's wrapper hooks the token-embedding module and so gives the placeholder token's text
embedding (its own ``extract_context_feature``, its ``spec_generate`` and its ViSpec wrapper take
``output_hidden_states[0]``, the merged one, as the worker does). The tests pin both sides of that difference, so a
change on either side shows.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from reference import difference_at_real, make_packed_batch, reference_dspark, text_model
from support.images import IMAGE, Llama4InProcess, gemma_batch, llama4_batch, qwen_batch
from support.nemo import nemo_on_path

from draftfeed.consumers.engines.hf import HFEngine
from draftfeed.consumers.settings import TaskSettings
from draftfeed.consumers.tasks import load_task
from draftfeed.contract.images import IMAGE_INPUTS
from draftfeed.contract.ops import shift_left

pytestmark = pytest.mark.timeout(180)

FAMILIES = ["qwen2.5-vl", "qwen3-vl-moe", "gemma3-multimodal", "llama4"]
LAYER_IDS = [-1, 0, 2, 3]  # -1 the embeddings, 3 the final norm's output of a 4-layer target


@pytest.fixture(scope="module")
def targets(tmp_path_factory) -> dict[str, Path]:
    from draftfeed.tiny import build_tiny_target

    root = tmp_path_factory.mktemp("embeddings")
    return {arch: build_tiny_target(root / arch, arch=arch, num_hidden_layers=4) for arch in FAMILIES}


def in_process(path: Path):
    """The model as a trainer loads it; Llama 4's image-text model as its forward computes it (support/images.py)."""
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    return Llama4InProcess(model) if type(model).__name__ == "Llama4ForConditionalGeneration" else model


def image_batch(arch: str, config) -> dict[str, torch.Tensor]:
    """Two rows, one image and two (of different sizes for Qwen), right-padded."""
    if arch.startswith("qwen"):
        return qwen_batch(config, [[(1, 4, 4)], [(1, 4, 4), (1, 2, 4)]], seed=34)
    if arch == "llama4":
        return llama4_batch(config, [1, 2], seed=34)
    return gemma_batch(config, [1, 2], seed=34)


def images_of(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: batch[name] for name in IMAGE_INPUTS if name in batch}


def assert_equal_at(name: str, got: torch.Tensor, expected: torch.Tensor, where: torch.Tensor) -> None:
    problem = difference_at_real(name, got, expected, where)
    assert problem is None, problem


@torch.no_grad()
def layer_zero_input(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """``output_hidden_states[0]`` of the model's own forward with the batch's images."""
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"], **images_of(batch)}
    return text_model(model)(**inputs, use_cache=False, output_hidden_states=True).hidden_states[0]


@pytest.mark.parametrize("arch", FAMILIES)
def test_dspark_layer_minus_one_is_decoder_layer_zeros_input_with_the_images_merged(targets, arch):
    nemo_on_path()
    from nemo_automodel.components.speculative.dspark.target import HFDSparkTargetModel

    torch.set_num_threads(1)  # as the workers run
    model = in_process(targets[arch])
    config = getattr(model, "inner", model).config
    batch = image_batch(arch, config)
    task = load_task(TaskSettings.of("dspark", LAYER_IDS), HFEngine(str(targets[arch])))
    got = task.compute(batch["input_ids"], batch["attention_mask"], batch["loss_mask"], None, None, images_of(batch))
    nemos = HFDSparkTargetModel(model, LAYER_IDS).generate_batch(**batch)

    real = batch["attention_mask"].bool()
    image = real & (batch["input_ids"] == IMAGE)
    text = real & ~image
    assert image.any(dim=1).all(), "every row holds image tokens"
    width = config.get_text_config().hidden_size
    embeddings, rest = got["target_hidden_states"][..., :width], got["target_hidden_states"][..., width:]
    nemo_embeddings, nemo_rest = nemos.target_hidden_states[..., :width], nemos.target_hidden_states[..., width:]

    # The worker's -1: decoder layer 0's input at every real position, image tokens included.
    assert_equal_at("layer -1", embeddings, layer_zero_input(model, batch), real)
    # NeMo's wrapper agrees everywhere else: layers 0, 2, the final norm, the last hidden state, and -1 at text tokens.
    assert_equal_at("layers 0, 2, 3", rest, nemo_rest, real)
    assert_equal_at("target_last_hidden_states", got["target_last_hidden_states"], nemos.target_last_hidden_states, real)
    assert torch.equal(embeddings[text], nemo_embeddings[text])
    # At the image tokens NeMo's wrapper gives the placeholder's token embedding, which the images do not reach.
    token_embeddings = model.get_input_embeddings()(batch["input_ids"])
    assert torch.equal(nemo_embeddings[image], token_embeddings[image])
    gap = (embeddings[image] - nemo_embeddings[image]).abs().max().item()
    print(f"{arch}: layer -1 at the image tokens differs from NeMo's wrapper by up to {gap:.3g}")
    assert gap > 1e-3, f"{arch}: the image features change the embeddings at the image tokens by only {gap:.3g}"


@pytest.mark.parametrize("arch", ["qwen2.5-vl", "gemma3-multimodal"])
def test_vispec_and_dspark_take_the_same_embeddings(targets, arch):
    """One definition: ViSpec's ``inputs_embeds`` is DSpark's layer -1, shifted left."""
    from draftfeed.consumers.tasks.vispec import image_token_id

    torch.set_num_threads(1)
    engine = HFEngine(str(targets[arch]))
    model = in_process(targets[arch])
    batch = image_batch(arch, model.config)
    args = (batch["input_ids"], batch["attention_mask"], batch["loss_mask"], None, None, images_of(batch))
    dspark = load_task(TaskSettings.of("dspark", [-1]), engine).compute(*args)["target_hidden_states"]
    vispec = load_task(TaskSettings.of("vispec", image_token_id=image_token_id(model.config)), engine).compute(*args)["inputs_embeds"]
    assert_equal_at("inputs_embeds", vispec, shift_left(dspark), shift_left(batch["attention_mask"]))


@pytest.mark.parametrize("by_position_ids", [False, True], ids=["block-causal-mask", "position-ids"])
def test_packed_rows_of_a_target_that_scales_its_embeddings(tmp_path, by_position_ids):
    """Gemma 3 scales its token embeddings before decoder layer 0: layer -1 of packed rows, on both of the hf engine's
    packing paths (a 4D mask, or position ids alone as for FlashAttention), is that scaled input, bit for bit."""
    from transformers import AutoModelForCausalLM

    from draftfeed.contract.packing import check_packing
    from draftfeed.tiny import build_tiny_target

    torch.set_num_threads(1)
    path = build_tiny_target(tmp_path / "gemma3", arch="gemma3", num_hidden_layers=4)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    engine = HFEngine(str(path))
    engine.force_position_id_packing = by_position_ids
    batch = make_packed_batch([[12, 9, 16], [40]], pad=[3, 0], vocab_size=1000, seed=34)
    documents = check_packing(batch["attention_mask"], batch["position_ids"], batch["seq_lens"])
    got = load_task(TaskSettings.of("dspark", [-1]), engine).compute(batch["input_ids"], batch["attention_mask"], batch["loss_mask"], None, documents)
    assert_equal_at("layer -1", got["target_hidden_states"], reference_dspark(model, batch, [-1])["target_hidden_states"], batch["attention_mask"])
    unscaled = model.get_input_embeddings().weight[batch["input_ids"]]
    assert not torch.equal(got["target_hidden_states"][0, 0], unscaled[0, 0])  # the scaling is there to see
