"""The frontier families transformers implements (issue 47: DeepSeek-V3.2, GLM-5, GLM-5.3, MiniMax-M2, Qwen3.5-MoE,
Kimi-K2.5, MiniMax-M3, and DeepSeek-V4): DSpark, EAGLE-3 and DFlash supervision of draftfeed's tasks over the hf
engine equal NeMo AutoModel's own wrappers (HFDSparkTargetModel, HFEagle3TargetModel, HFDFlashTargetModel) around the
same model in process, bit for bit at real positions, on a padded batch (NeMo's DFlash wrapper takes no image-text
model); the layers of several residual streams (DeepSeek-V4, GLM-5.3) read as
docs/contract.md says. Tiny random-weight targets of each (draftfeed.tiny), text batches; the image-text ones loaded
as image-text models. Through real workers: DeepSeek-V4 in tests/test_hyper_connections.py.
"""

from __future__ import annotations

import pytest
import torch
from conftest import make_batch
from reference import difference_at_real, make_packed_batch
from support.nemo import nemo_on_path

from draftfeed.consumers.engines.hf import HFEngine
from draftfeed.consumers.tasks.dflash import DFlashTask
from draftfeed.consumers.tasks.dspark import DSparkTask
from draftfeed.consumers.tasks.eagle3 import Eagle3Task
from draftfeed.contract.packing import Documents
from draftfeed.schemas.errors import BadRequest
from draftfeed.tiny import FRONTIER_ARCHS, FRONTIER_IMAGE_TEXT_ARCHS, HYPER_CONNECTION_ARCHS, build_tiny_target

pytestmark = pytest.mark.timeout(240)

LAYERS = 4
# Families with layers that attend over the whole row whatever the block mask says (compressed or linear attention):
# a packed document differs from itself alone, so the hf engine refuses their packed rows (engines/hf.py).
MIXES_PACKED_DOCUMENTS = {"deepseek-v4", "glm5-next", "qwen3.5-moe", "minimax-m3-vl"}
DSPARK_IDS, AUX_IDS = [-1, 1, 2, 3], [0, 1, 2]


def own_class_model(path):
    """The model by the class its checkpoint names, read by that class's own config (a process that imported NeMo reads
    some model types as NeMo's own configs through the auto classes)."""
    import transformers
    from transformers import PretrainedConfig

    raw, _ = PretrainedConfig.get_config_dict(path)
    cls = getattr(transformers, raw["architectures"][0])
    return cls.from_pretrained(path, config=cls.config_class.from_pretrained(path), dtype=torch.float32).eval()


@pytest.mark.parametrize("family", [*HYPER_CONNECTION_ARCHS, *FRONTIER_ARCHS])
def test_dspark_eagle3_and_dflash_equal_nemos_wrappers(family, tmp_path):
    nemo_on_path()
    from nemo_automodel.components.speculative.dflash.target import HFDFlashTargetModel
    from nemo_automodel.components.speculative.dspark.target import HFDSparkTargetModel
    from nemo_automodel.components.speculative.eagle.target import HFEagle3TargetModel

    path = build_tiny_target(tmp_path / family, arch=family, num_hidden_layers=LAYERS)
    engine, model = HFEngine(str(path), device="cpu", dtype="float32"), own_class_model(path)
    batch = make_batch(2, 24, 1000, seed=13)
    ids, mask, loss = batch["input_ids"], batch["attention_mask"], batch["loss_mask"]
    real = mask.bool()
    dspark = DSparkTask(engine, target_layer_ids=DSPARK_IDS).compute(ids, mask, loss)
    want = HFDSparkTargetModel(model, DSPARK_IDS).generate_batch(ids, mask, loss)
    eagle3 = Eagle3Task(engine, aux_layer_ids=AUX_IDS).compute(ids, mask, loss)
    aux = HFEagle3TargetModel(model, AUX_IDS).generate_batch(ids, mask, loss).aux_hidden_states
    dflash = DFlashTask(engine, target_layer_ids=AUX_IDS).compute(ids, mask, loss)["hidden_states"]
    if family in FRONTIER_IMAGE_TEXT_ARCHS:  # NeMo's DFlash wrapper finds no decoder in an image-text model
        with pytest.raises(ValueError, match="Unsupported model structure for DFlash"):
            HFDFlashTargetModel(model, AUX_IDS).generate_batch(ids, mask, loss)
        hidden_states = dflash
    else:
        hidden_states = HFDFlashTargetModel(model, AUX_IDS).generate_batch(ids, mask, loss).hidden_states
    problems = [
        difference_at_real("target_hidden_states", dspark["target_hidden_states"], want.target_hidden_states, real),
        difference_at_real("target_last_hidden_states", dspark["target_last_hidden_states"], want.target_last_hidden_states, real),
        difference_at_real("aux_hidden_states", eagle3["aux_hidden_states"], aux, real),
        difference_at_real("hidden_states", dflash, hidden_states, real),
    ]
    # Packed rows (two and three documents, then padding): DSpark, the task whose NeMo recipe packs. A family some of
    # whose layers attend over the whole row whatever the block mask says is refused in one line (NeMo's wrapper
    # computes the mixture without a word).
    packed = make_packed_batch([[5, 7], [4, 4, 3]], [2, 3], 1000, seed=14)
    documents = Documents(seq_lens=packed["seq_lens"], position_ids=packed["position_ids"])
    task, arguments = DSparkTask(engine, target_layer_ids=DSPARK_IDS), (packed["input_ids"], packed["attention_mask"], packed["loss_mask"])
    if family in MIXES_PACKED_DOCUMENTS:
        with pytest.raises(BadRequest, match="does not keep packed documents apart"):
            task.compute(*arguments, documents=documents)
    else:
        got = task.compute(*arguments, documents=documents)
        inputs = {k: packed[k] for k in ("input_ids", "attention_mask", "loss_mask", "position_ids", "seq_lens", "doc_remaining")}
        packed_want = HFDSparkTargetModel(model, DSPARK_IDS).generate_batch(**inputs)
        problems += [
            difference_at_real(f"packed {name}", got[name], getattr(packed_want, name), packed["attention_mask"].bool())
            for name in ("target_hidden_states", "target_last_hidden_states")
        ]
    assert not any(problems), f"{family}: " + "; ".join(p for p in problems if p)
    hidden = engine.shape.hidden_size
    assert dspark["target_hidden_states"].shape == (*ids.shape, len(DSPARK_IDS) * hidden)


@pytest.mark.parametrize("model_type, architecture", [("deepseek_v41", "DeepseekV41ForCausalLM"), ("kimi_k3", "KimiK3ForCausalLM")])
def test_a_model_type_transformers_lacks_is_one_line(tmp_path, model_type, architecture, monkeypatch):
    """DeepSeek-V4.1 and Kimi-K3 exist in NeMo AutoModel's own model code only: the hf engine says so in one line, not
    transformers' advice to upgrade, and names the engine that runs them. As in a worker's process, where nothing
    registered them with transformers: a test process that imported NeMo has (NeMo registers its configs on import)."""
    import json

    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from draftfeed.consumers.engines.loading import transformers_config

    monkeypatch.delitem(CONFIG_MAPPING._extra_content, model_type, raising=False)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type, "architectures": [architecture]}))
    with pytest.raises(ValueError) as refused:
        transformers_config(str(tmp_path))
    said = str(refused.value)
    assert f"model type {model_type!r} ({architecture}) is not implemented by transformers" in said and "\n" not in said, said
    assert "--engine automodel" in said, said
