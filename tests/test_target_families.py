"""Every target family the hf engine loads, text and image-text: its text decoder is found and its supervision is
exact against the in-process computation (text-only batches; issue 28).

The engine is checked in-process for every family (what it catches equals what the model's own forward gives); the
families that needed a new rule to load or to find their decoder are also served by a real worker."""

from __future__ import annotations

import pytest
import torch
from conftest import add_service, assert_supervision_equal, make_batch, reference_eagle3
from reference import difference, text_model

from draftfeed import RemoteEagle3Target
from draftfeed.consumers.engines.base import Capture
from draftfeed.consumers.engines.hf import HFEngine
from draftfeed.tiny import FRONTIER_ARCHS, HYPER_CONNECTION_ARCHS, MOE_ARCHS, build_tiny_target

pytestmark = pytest.mark.timeout(300)

LAYERS = 4  # every family takes it (Qwen3-Next's layer pattern repeats every 4)
# The families that needed a new rule: Llama 4's decoder (get_decoder() returns the model itself; its image-text
# model nests a causal LM), and image-text configs AutoModelForCausalLM refuses (Qwen-VL) or loads without vision.
NEW_FAMILIES = ("llama4-text", "llama4", "qwen2.5-vl", "qwen3-vl-moe")
# The frontier families (issue 47), DeepSeek-V4 and GLM-5.3 (glm5-next) among them with layers of several residual
# streams, [B, S, streams, H]: caught as the layers give them (docs/contract.md).
FAMILIES = ("llama", "qwen3", "gemma3", "gemma3-multimodal", *MOE_ARCHS, *NEW_FAMILIES, *HYPER_CONNECTION_ARCHS, *FRONTIER_ARCHS)


class Targets(dict):
    """Each family's tiny target, built when first asked for."""

    def __init__(self, folder) -> None:
        super().__init__()
        self.folder = folder

    def __missing__(self, family: str):
        self[family] = build_tiny_target(self.folder / family, arch=family, num_hidden_layers=LAYERS)
        return self[family]


@pytest.fixture(scope="module")
def targets(tmp_path_factory) -> Targets:
    return Targets(tmp_path_factory.mktemp("families"))


def own_class_model(path):
    """The model as its checkpoint names it (config.architectures), not as the worker chose to load it."""
    import transformers

    # the class's own config: a process that imported NeMo reads some model types as NeMo's configs through AutoConfig
    raw, _ = transformers.PretrainedConfig.get_config_dict(path)
    cls = getattr(transformers, raw["architectures"][0])
    return cls.from_pretrained(path, config=cls.config_class.from_pretrained(path), dtype=torch.float32).eval()


@pytest.mark.parametrize("family", FAMILIES)
@torch.inference_mode()
def test_the_engine_catches_what_the_models_own_forward_gives(family, targets):
    path = targets[family]
    engine = HFEngine(str(path), device="cpu", dtype="float32")
    model = own_class_model(path)
    batch = make_batch(2, 12, 1000, seed=7)
    got = engine.forward(batch["input_ids"], batch["attention_mask"], Capture(layer_ids=(0, 1, 2), embeddings=True, final_hidden=True, logits=True))
    out = text_model(model)(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False, output_hidden_states=True)
    real = batch["attention_mask"].bool()
    expected = {
        "embeddings": out.hidden_states[0],
        **{f"layer {i}": out.hidden_states[i + 1] for i in (0, 1, 2)},
        "final_hidden": out.hidden_states[-1],
        "logits": out.logits,
    }
    caught = {
        "embeddings": got.embeddings,
        **{f"layer {i}": got.layer_outputs[i] for i in (0, 1, 2)},
        "final_hidden": got.final_hidden,
        "logits": got.logits,
    }
    problems = [p for name, tensor in expected.items() if (p := difference(f"{family} {name}", caught[name][real], tensor[real])) is not None]
    assert not problems, "; ".join(problems)


@pytest.fixture(scope="module")
def served(cluster, targets):
    for family in NEW_FAMILIES:
        add_service(cluster, targets[family], family, "--aux-layer-ids", "0,1,2")
    return cluster


@pytest.mark.parametrize("family", NEW_FAMILIES)
def test_a_worker_serves_the_family_exact_eagle3_supervision(served, targets, family):
    model = own_class_model(targets[family])
    batch = make_batch(2, 16, 1000, seed=11)
    with RemoteEagle3Target(served.frontend, family) as target:
        assert target.model_info().num_hidden_layers == LAYERS
        assert_supervision_equal(target.generate_batch(**batch), reference_eagle3(model, batch, [0, 1, 2]))


def test_a_target_no_class_takes_is_one_line_naming_its_type_and_the_classes_tried(tmp_path):
    from draftfeed.consumers.engines.loading import auto_class

    class NotADecoderConfig:
        model_type = "resnet"
        architectures = ["ResNetForImageClassification"]

    with pytest.raises(ValueError) as refused:
        auto_class(NotADecoderConfig())
    message = str(refused.value)
    assert "\n" not in message and "'resnet'" in message and "AutoModelForImageTextToText nor AutoModelForCausalLM" in message
