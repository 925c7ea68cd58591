"""The automodel engine (issue 47): the target under NeMo AutoModel's own model code. DSpark and EAGLE-3 supervision
of draftfeed's tasks over it equal NeMo's own wrappers (HFDSparkTargetModel, HFEagle3TargetModel) around NeMo's own
model of the same checkpoint in process, bit for bit at real positions, on a padded batch: DeepSeek-V4.1, which only
NeMo implements (its DSpark features are the model's own: the streams entering each chosen layer), and DeepSeek-V3,
which transformers implements too. What it cannot run is refused in one line at start. Through a real worker: the
DeepSeek-V4.1 recipe test (tests/test_nemo_frontier.py)."""

from __future__ import annotations

import pytest
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
    }


@pytest.mark.parametrize("family", ["deepseek-v41", "deepseek-v3"])
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
