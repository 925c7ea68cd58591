"""NeMo AutoModel's DSpark recipe on its frontier targets, with a draftfeed target (issue 47): the recipe's own builder
of a DeepSeek-V4 target (``build_deepseek_v4_target``, which on its own asks for CUDA and an expert-parallel process
group), called as the recipe's setup() calls it with ``target_model_backend: remote``, gives the config as NeMo reads
it, draftfeed's stand-in (no weights) and no process group; NeMo's DSpark wrapper around it is draftfeed's, whose
supervision equals NeMo's wrapper around the model in process, bit for bit at real positions. A target the service
does not serve (a reduced depth) is refused in one line; DeepSeek-V4.1's target options give the stand-in too, served
by a worker of ``--engine automodel``, and so does the Kimi-K3 builder (served here by the fake frontier engine at its
widths: no engine runs KDA on a CPU). A few training steps of the recipe's own drafts (DeepSeek-V4 on hf, GLM-5.2
and DeepSeek-V4.1 on ``--engine automodel``) give the losses and trained drafts of NeMo's wrapper in process, bit for bit.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import add_service, make_batch
from reference import difference_at_real
from support.automodel import automodel_service
from support.nemo import nemo_on_path, train_steps

from draftfeed.integrations.nemo import use_draftfeed
from draftfeed.integrations.nemo.recipes import draftfeed_target
from draftfeed.integrations.nemo.standin import DraftfeedTargetModel
from draftfeed.integrations.nemo.wrappers import DraftfeedDSparkTarget

pytestmark = pytest.mark.timeout(240)

LAYERS = [-1, 1, 3, 5]  # of the tiny DeepSeek-V4's 6 layers: the embeddings, two layers, the post-norm last one
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def v4_target(tmp_path_factory) -> Path:
    from draftfeed.tiny import build_tiny_target

    return build_tiny_target(tmp_path_factory.mktemp("v4") / "deepseek-v4", arch="deepseek-v4", num_hidden_layers=6)


@pytest.fixture(scope="module")
def url(cluster, v4_target) -> str:
    add_service(cluster, v4_target, "v4-dspark", "--task", "dspark", "--target-layer-ids", ",".join(map(str, LAYERS)))
    return f"draftfeed://{cluster.frontend.removeprefix('tcp://')}/v4-dspark?data_plane=frames"


@pytest.fixture(scope="module")
def nemo(url) -> SimpleNamespace:
    nemo_on_path()
    use_draftfeed()
    from nemo_automodel.components.config.loader import ConfigNode

    train_dspark = importlib.import_module("nemo_automodel.recipes.llm.train_dspark")

    def recipe(cfg):
        """The DSpark recipe with its config and device, as its constructor and setup() would set them."""
        plain = type("Recipe", (train_dspark.TrainDSparkRecipe,), {"__init__": lambda self, **kw: self.__dict__.update(kw)})
        return plain(cfg=cfg, device=CPU)

    return SimpleNamespace(ConfigNode=ConfigNode, train_dspark=train_dspark, recipe=recipe)


def config(nemo, target: Path, url: str, **options):
    args = {"target_model_name_or_path": str(target), "target_model_backend": "remote", "remote_urls": [url], "remote_timeout": 60, **options}
    return nemo.ConfigNode({"recipe_args": args})


def call_builder(nemo, recipe, target: Path, builder: str = "build_deepseek_v4_target"):
    """The recipe's builder of a frontier target (DeepSeek-V4's, GLM-5.2's), by the name its module calls, with the
    arguments its setup() passes."""
    return getattr(nemo.train_dspark, builder)(
        cfg=recipe.cfg,
        world_size=1,
        device=CPU,
        compute_dtype=torch.float32,
        target_path=str(target),
        recipe_cfg=recipe.cfg.recipe_args,
        trust_remote_code=False,
    )


def build_target(nemo, recipe, target: Path):
    """What setup() does for a DeepSeek-V4 target: its builder, then the wrapper."""
    with draftfeed_target(recipe, "dspark"):
        target_config, model, setup = call_builder(nemo, recipe, target)
        wrapper = nemo.train_dspark.HFDSparkTargetModel(model, target_layer_ids=LAYERS, cp_mesh=None)
    return target_config, model, setup, wrapper


def assert_same_dspark(wrapper, in_process, batch) -> None:
    """Both wrappers' DSpark batches of ``batch`` are equal at real positions (and draftfeed's zero at padded ones)."""
    got, want = wrapper.generate_batch(**batch), in_process.generate_batch(**batch)
    for name in ("target_hidden_states", "target_last_hidden_states"):
        assert difference_at_real(name, getattr(got, name), getattr(want, name), batch["attention_mask"].bool()) is None


def test_the_deepseek_v4_builder_gives_draftfeeds_target_equal_to_nemos_wrapper(nemo, url, v4_target):
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    recipe = nemo.recipe(config(nemo, v4_target, url))
    target_config, model, setup, wrapper = build_target(nemo, recipe, v4_target)
    try:
        assert setup is None and isinstance(model, DraftfeedTargetModel) and type(wrapper) is DraftfeedDSparkTarget
        assert (target_config.model_type, target_config.num_hidden_layers, target_config.num_nextn_predict_layers) == ("deepseek_v4", 6, 0)
        # transformers' classes by name: with NeMo imported, the auto classes read deepseek_v4 as NeMo's own config
        reference = DeepseekV4ForCausalLM.from_pretrained(v4_target, config=DeepseekV4Config.from_pretrained(v4_target), dtype=torch.float32)
        in_process = nemo.train_dspark.HFDSparkTargetModel(reference.eval(), LAYERS)
        for seed in (1, 2):
            assert_same_dspark(wrapper, in_process, make_batch(2, 24, 1000, seed=seed))
    finally:
        wrapper.close()
    # outside the recipe's draftfeed target, the builder is NeMo's own (which asks for CUDA on this machine)
    with pytest.raises(RuntimeError, match="requires CUDA"):
        call_builder(nemo, recipe, v4_target)


def test_a_reduced_target_depth_is_refused_in_one_line(nemo, url, v4_target):
    recipe = nemo.recipe(config(nemo, v4_target, url, target_num_hidden_layers=4))
    with pytest.raises(ValueError, match=r"num_hidden_layers: expected 4, served 6") as refused:
        build_target(nemo, recipe, v4_target)
    assert "\n" not in str(refused.value)


V41_LAYERS = [3, 4, 5]  # the tiny DeepSeek-V4.1's dspark_target_layer_ids, which NeMo's draft insists on


@pytest.mark.long  # the automodel engine's DeepSeek-V4.1 is in the suite (test_automodel_engine.py); the recipe's path is long
def test_deepseek_v41_target_options_give_draftfeeds_target_served_by_the_automodel_engine(nemo, cluster, tmp_path):
    """The recipe's DeepSeek-V4.1 path (``DeepseekV41DSparkTargetConfig.build``, CUDA and a process group on its own)
    gives the stand-in, whose DSpark wrapper, served by a worker of ``--engine automodel``, equals NeMo's wrapper
    around NeMo's own model in process."""
    from support.nemo import nemo_reference

    from draftfeed.tiny import build_tiny_nemo_target

    v41 = build_tiny_nemo_target(tmp_path / "deepseek-v41", draft_layers=1)
    v41_url = automodel_service(cluster, v41, "v41-dspark", V41_LAYERS)
    recipe = nemo.recipe(config(nemo, v41, v41_url))
    options = nemo.train_dspark.DeepseekV41DSparkTargetConfig(target_path=str(v41))
    with draftfeed_target(recipe, "dspark"):
        model = options.build(device=CPU, compute_dtype=torch.float32, distributed_setup=None)
        wrapper = nemo.train_dspark.HFDSparkTargetModel(model, target_layer_ids=V41_LAYERS, cp_mesh=None)
    try:
        assert isinstance(model, DraftfeedTargetModel) and type(wrapper) is DraftfeedDSparkTarget
        assert model.config.model_type == "deepseek_v41"
        in_process = nemo.train_dspark.HFDSparkTargetModel(nemo_reference(v41), V41_LAYERS)
        assert_same_dspark(wrapper, in_process, make_batch(2, 24, 256, seed=5))
        # A few steps of the recipe's DeepSeek-V4.1 draft (its config builds it): the losses and the trained draft of
        # the draftfeed target equal those of NeMo's wrapper around NeMo's own model in process, bit for bit.
        v41_config = nemo.train_dspark.DeepseekV41Config.from_pretrained(str(v41))
        batches = [make_batch(2, 24, 256, seed=seed) for seed in (41, 42, 43)]
        expected, reference_draft = dspark_training(nemo, in_process, v41_config, batches, V41_LAYERS)
        got, trained = dspark_training(nemo, wrapper, v41_config, batches, V41_LAYERS)
        assert [loss.item() for loss in got] == [loss.item() for loss in expected]
        assert all(torch.equal(a, b) for a, b in zip(trained.state_dict().values(), reference_draft.state_dict().values()))
    finally:
        wrapper.close()
    with pytest.raises(RuntimeError, match="requires CUDA"):  # outside the recipe's draftfeed target: NeMo's own
        options.build(device=CPU, compute_dtype=torch.float32, distributed_setup=None)


KIMI_LAYERS = [0, 2, 3]  # of the small Kimi-K3's 4 layers (3: the post-norm last one)
KIMI_SHAPE = {"hidden_size": 64, "num_hidden_layers": 4, "vocab_size": 256}


def test_the_kimi_k3_builder_gives_draftfeeds_target(nemo, cluster, tmp_path):
    """The recipe's Kimi-K3 builder (on its own: CUDA, an expert mesh and fla's KDA kernels), called as setup() calls
    it, gives the checkpoint's text config as NeMo's builder reads it (tagged KimiK3ForCausalLM), draftfeed's stand-in
    and no process group, and its DSpark wrapper is draftfeed's, checked against the service's target info. No engine
    runs KDA on a CPU (the automodel engine refuses it: test_automodel_engine.py), so the service here is the fake
    frontier engine at the checkpoint's widths: the batches are the fake's values, compared with its own function."""
    from nemo_automodel.components.models.kimi_k3.config import KimiK3Config

    from draftfeed.bench.frontier import frontier_dspark

    kimi = tmp_path / "kimi-k3"
    KimiK3Config(text_config=KIMI_SHAPE | {"num_attention_heads": 4}).save_pretrained(kimi)
    engine = ["--engine", "draftfeed.bench.frontier:FakeFrontierEngine", "--dtype", "bfloat16"]
    engine += [flag for key, value in KIMI_SHAPE.items() for flag in ("--engine-option", f"{key}={value}")]
    add_service(cluster, kimi, "kimi-dspark", *engine, "--task", "dspark", "--target-layer-ids", ",".join(map(str, KIMI_LAYERS)))
    kimi_url = f"draftfeed://{cluster.frontend.removeprefix('tcp://')}/kimi-dspark?data_plane=frames"
    recipe = nemo.recipe(config(nemo, kimi, kimi_url))
    with draftfeed_target(recipe, "dspark"):
        target_config, model, setup = call_builder(nemo, recipe, kimi, "build_kimi_k3_target")
        wrapper = nemo.train_dspark.HFDSparkTargetModel(model, target_layer_ids=KIMI_LAYERS, cp_mesh=None)
    try:
        assert setup is None and isinstance(model, DraftfeedTargetModel) and type(wrapper) is DraftfeedDSparkTarget
        assert (target_config.model_type, target_config.architectures, target_config.num_hidden_layers) == ("kimi_linear", ["KimiK3ForCausalLM"], 4)
        batch = make_batch(2, 24, 256, seed=7)
        got = wrapper.generate_batch(**batch)
        want = frontier_dspark(batch["input_ids"], batch["attention_mask"], KIMI_LAYERS, 4, 64)
        for name in ("target_hidden_states", "target_last_hidden_states"):
            assert difference_at_real(name, getattr(got, name), want[name], batch["attention_mask"].bool()) is None
    finally:
        wrapper.close()
    reduced = nemo.recipe(config(nemo, kimi, kimi_url, target_num_hidden_layers=2))
    with pytest.raises(ValueError, match=r"num_hidden_layers: expected 2, served 4") as refused:
        with draftfeed_target(reduced, "dspark"):
            _, model, _ = call_builder(nemo, reduced, kimi, "build_kimi_k3_target")
            nemo.train_dspark.HFDSparkTargetModel(model, target_layer_ids=[0, 1], cp_mesh=None)
    assert "\n" not in str(refused.value)
    with pytest.raises(RuntimeError, match="requires CUDA"):  # outside the recipe's draftfeed target: NeMo's own
        call_builder(nemo, recipe, kimi, "build_kimi_k3_target")


def dspark_training(nemo, wrapper, target_config, batches, layers=LAYERS) -> tuple[list[torch.Tensor], torch.nn.Module]:
    """NeMo's DSpark draft for the target's architecture (DeepSeek-V4, GLM-5.2; DeepSeek-V4.1's config builds its own)
    as the recipe's setup() builds it (its own draft-config builder, registry and trainer module), stepped with the
    recipe's own ``_forward_batch`` on ``wrapper``'s batches: the losses and the trained draft."""
    from nemo_automodel.components.speculative.dspark import config as draft_configs
    from nemo_automodel.components.speculative.dspark.core import DSparkTrainerModule
    from nemo_automodel.components.speculative.dspark.registry import ModelOwnedDSparkProvider, resolve_dspark_draft_spec

    architecture = target_config.architectures[0]
    build_config = {
        "DeepseekV4ForCausalLM": draft_configs.build_deepseek_v4_draft_config,
        "GlmMoeDsaForCausalLM": draft_configs.build_glm_5_2_draft_config,
    }
    owned = isinstance(target_config, ModelOwnedDSparkProvider)
    settings = {"num_draft_layers": 1, "block_size": 4, "mask_token_id": target_config.get_text_config().vocab_size - 1, "markov_rank": 8}
    if owned:  # DeepSeek-V4.1's draft takes these from its checkpoint, as the recipe must
        text = target_config.text_config
        settings = {
            "num_draft_layers": text.num_nextn_predict_layers,
            "block_size": text.dspark_block_size,
            "mask_token_id": text.dspark_noise_token_id,
            "markov_rank": text.dspark_markov_rank,
        }
    margs = nemo.train_dspark._DraftArgs(
        target_layer_ids=layers,
        num_anchors=4,
        markov_head_type="vanilla",
        confidence_head_alpha=1.0,
        confidence_head_with_markov=True,
        confidence_head_stop_gradient=False,
        **settings,
    )
    torch.manual_seed(0)
    if owned:
        draft = target_config.build_dspark_draft(margs).float()
    else:
        draft = resolve_dspark_draft_spec([architecture]).draft_cls(build_config[architecture](target_config, margs)).float()
    draft.initialize_embeddings_and_head(embed_tokens=wrapper.get_input_embeddings(), lm_head=wrapper.get_output_embeddings(), freeze=True)
    trainer = DSparkTrainerModule(draft, loss_decay_gamma=None, ce_loss_alpha=0.1, l1_loss_alpha=0.9, confidence_head_alpha=1.0)
    recipe = nemo.recipe(nemo.ConfigNode({"recipe_args": {}}))
    recipe.__dict__.update(target_wrapper=wrapper, trainer_module=trainer, compute_dtype=torch.float32)
    return train_steps(trainer, batches, recipe._forward_batch, before_each=lambda index: torch.manual_seed(100 + index)), draft  # the anchors


def test_nemos_dspark_trainer_on_a_deepseek_v4_draftfeed_target_gives_the_losses_of_its_colocated_target(nemo, url, v4_target):
    """A few steps of the recipe's DeepSeek-V4 DSpark draft: on the target its builder gives with
    ``target_model_backend: remote`` (served by a worker) the losses and the trained draft equal, bit for bit, those of
    the same steps on NeMo's wrapper around the model in process (NeMo's own builder of this target asks for CUDA, so
    the colocated target here is its wrapper over transformers' model, as the builder would load it)."""
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    recipe = nemo.recipe(config(nemo, v4_target, url))
    target_config, _model, _setup, remote = build_target(nemo, recipe, v4_target)
    reference = DeepseekV4ForCausalLM.from_pretrained(v4_target, config=DeepseekV4Config.from_pretrained(v4_target), dtype=torch.float32)
    colocated = nemo.train_dspark.HFDSparkTargetModel(reference.eval(), LAYERS)
    batches = [make_batch(2, 24, 1000, seed=seed) for seed in (21, 22, 23)]
    try:
        expected, reference_draft = dspark_training(nemo, colocated, target_config, batches)
        got, trained = dspark_training(nemo, remote, target_config, batches)
    finally:
        remote.close()
    assert [loss.item() for loss in got] == [loss.item() for loss in expected]
    assert all(torch.equal(a, b) for a, b in zip(trained.state_dict().values(), reference_draft.state_dict().values()))


GLM_LAYERS = [1, 3, 5]  # of the tiny GLM-5.2's 6 layers


def test_nemos_dspark_trainer_on_a_glm_5_2_target_served_by_nemos_own_model_gives_the_losses_of_its_colocated_target(nemo, cluster, tmp_path):
    """The recipe's GLM-5.2 builder (``build_glm_5_2_target``, which on its own asks for CUDA and loads NeMo's own
    model of it), called as setup() calls it with ``target_model_backend: remote``, gives draftfeed's target; served by a
    worker of ``--engine automodel`` (NeMo's own model, as the builder would load it), a few steps of the recipe's
    GLM-5.2 draft give losses and a trained draft equal bit for bit to the same steps on NeMo's wrapper around NeMo's
    own model in process: the colocated target the builder would give, built here without CUDA."""
    from support.nemo import nemo_reference

    from draftfeed.tiny import build_tiny_target

    glm = build_tiny_target(tmp_path / "glm-5.2", arch="glm-moe-dsa", num_hidden_layers=6)
    glm_url = automodel_service(cluster, glm, "glm-dspark", GLM_LAYERS)
    recipe = nemo.recipe(config(nemo, glm, glm_url))
    with draftfeed_target(recipe, "dspark"):
        target_config, model, setup = call_builder(nemo, recipe, glm, "build_glm_5_2_target")
        remote = nemo.train_dspark.HFDSparkTargetModel(model, target_layer_ids=GLM_LAYERS, cp_mesh=None)
    colocated = nemo.train_dspark.HFDSparkTargetModel(nemo_reference(glm), GLM_LAYERS)
    batches = [make_batch(2, 24, target_config.vocab_size, seed=seed) for seed in (31, 32, 33)]
    try:
        assert isinstance(model, DraftfeedTargetModel) and setup is None and type(remote) is DraftfeedDSparkTarget
        expected, reference_draft = dspark_training(nemo, colocated, target_config, batches, GLM_LAYERS)
        got, trained = dspark_training(nemo, remote, target_config, batches, GLM_LAYERS)
    finally:
        remote.close()
    assert [loss.item() for loss in got] == [loss.item() for loss in expected]
    assert all(torch.equal(a, b) for a, b in zip(trained.state_dict().values(), reference_draft.state_dict().values()))
