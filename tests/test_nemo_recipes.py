"""NeMo AutoModel's DFlash, JetSpec, EAGLE-1/2, ViSpec and DSpark recipes on draftfeed (draftfeed.integrations.nemo's
use_draftfeed()), against the real nemo-automodel package and real broker and workers on tiny targets.

The recipes' setup() wants a distributed run, a tokenizer and a dataset, so the tests run the parts that build the
target within the recipe's draftfeed target, as the wrapped setup() runs them: DFlash's own _build_target_model and
_build_target_wrapper methods, and for the recipes that load inline, the very names their setup() calls (the loader
and the wrapper class as the recipe module imports them). The trainer tests step NeMo's own trainer modules through
the recipes' own step methods (_run_trainer_step, _compute_metrics) on both the colocated wrapper and draftfeed.
"""

from __future__ import annotations

import copy
import importlib
import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import add_service, make_batch
from reference import make_packed_batch
from support.nemo import nemo_on_path, train_steps

from draftfeed.integrations.nemo import (
    DraftfeedDFlashTarget,
    DraftfeedDSparkTarget,
    DraftfeedEagleTarget,
    DraftfeedTargetModel,
    DraftfeedVispecTarget,
    use_draftfeed,
)
from draftfeed.integrations.nemo.recipes import draftfeed_target

pytestmark = pytest.mark.timeout(180)

LAYERS = [1, 3, 5]
LAYER_FLAGS = ("--target-layer-ids", ",".join(map(str, LAYERS)))
VOCAB = 1000
MASK_TOKEN = VOCAB - 1
BLOCK = 4
STEPS = 4
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def nemo() -> SimpleNamespace:
    """NeMo's recipe modules, from .nemo-packages (after the venv's own packages on the path), with use_draftfeed() in force."""
    nemo_on_path()
    use_draftfeed()
    use_draftfeed()  # a second call changes nothing
    from nemo_automodel.components.config.loader import ConfigNode

    def recipe_type(module: str, name: str) -> type:
        """NeMo's recipe class, its attributes set by the test instead of by setup()."""

        def __init__(self, **attributes: object) -> None:
            for key, value in attributes.items():
                setattr(self, key, value)

        return type(name, (getattr(importlib.import_module(f"nemo_automodel.recipes.llm.{module}"), name),), {"__init__": __init__})

    modules = {
        name: importlib.import_module(f"nemo_automodel.recipes.llm.{name}")
        for name in ("train_dflash", "train_eagle1", "train_vispec", "train_dspark")
    }
    return SimpleNamespace(
        ConfigNode=ConfigNode,
        recipe=recipe_type,
        **modules,
        dflash=importlib.import_module("nemo_automodel.components.speculative.dflash.registry"),
        dflash_target=importlib.import_module("nemo_automodel.components.speculative.dflash.target"),
        eagle_registry=importlib.import_module("nemo_automodel.components.speculative.eagle.registry"),
    )


@pytest.fixture(scope="module")
def qwen3_target(tmp_path_factory) -> Path:
    from draftfeed.tiny import build_tiny_target

    return build_tiny_target(tmp_path_factory.mktemp("targets") / "tiny-qwen3", arch="qwen3", vocab_size=VOCAB)


@pytest.fixture(scope="module")
def vispec_target(tmp_path_factory) -> Path:
    from draftfeed.tiny import build_tiny_target

    return build_tiny_target(tmp_path_factory.mktemp("targets") / "tiny-qwen2.5-vl", arch="qwen2.5-vl", vocab_size=VOCAB)


@pytest.fixture(scope="module")
def qwen3_model(qwen3_target):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(qwen3_target, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def urls(cluster, tiny_target, qwen3_target, vispec_target) -> dict[str, str]:
    """One service per recipe family: the URL of each."""
    add_service(cluster, qwen3_target, "dflash", "--task", "dflash", *LAYER_FLAGS)
    add_service(cluster, qwen3_target, "jetspec", "--task", "dflash", *LAYER_FLAGS, "--capture-logits")
    add_service(cluster, tiny_target, "eagle", "--task", "eagle")
    add_service(cluster, qwen3_target, "dspark", "--task", "dspark", *LAYER_FLAGS)
    add_service(cluster, vispec_target, "vispec", "--task", "vispec")
    host_port = cluster.frontend.removeprefix("tcp://")
    return {name: f"draftfeed://{host_port}/{name}?data_plane=frames" for name in ("dflash", "jetspec", "eagle", "dspark", "vispec")}


class NemosLoader(Exception):
    """NeMo's own target loader was entered."""


@pytest.fixture
def nemos_loader(nemo, monkeypatch) -> None:
    """NeMoAutoModelForCausalLM.from_pretrained stops with NemosLoader where NeMo's own loading starts (on a CPU
    machine NeMo's loader asks for CUDA)."""
    auto_model = importlib.import_module("nemo_automodel._transformers.auto_model")

    def entered(kwargs: object) -> None:
        raise NemosLoader

    monkeypatch.setattr(auto_model, "_reject_separate_distributed_kwargs", entered)


def recipe_config(nemo, target: Path, url: str | None, **options: object):
    """A recipe's config: recipe_args naming the target, and draftfeed's keys when ``url`` is given."""
    args: dict[str, object] = {"target_model_name_or_path": str(target), "target_force_hf": True, "mask_token_id": MASK_TOKEN, **options}
    if url is not None:
        args |= {"target_model_backend": "remote", "remote_urls": [url], "remote_timeout": 60}
    return nemo.ConfigNode({"recipe_args": args})


def dflash_recipe(nemo, name: str, cfg):
    module = {"TrainDFlashRecipe": "train_dflash", "TrainJetSpecRecipe": "train_jetspec"}[name]
    dist_env = SimpleNamespace(is_main=True, world_size=1, rank=0)
    return nemo.recipe(module, name)(
        cfg=cfg, device=CPU, compute_dtype=torch.float32, dist_env=dist_env, block_size=BLOCK, mask_token_id=MASK_TOKEN, draft_sliding_window=None
    )


def build_dflash_target(nemo, recipe, target: Path, layers=LAYERS):
    """The target and its wrapper as the recipe's setup() builds them, with the recipe's draftfeed target in force."""
    with draftfeed_target(recipe, "dflash"):
        spec = nemo.dflash.resolve_dflash_draft_spec(["Qwen3ForCausalLM"])
        recipe.target_model = recipe._build_target_model(recipe.cfg.recipe_args, str(target), spec)
        recipe.target_wrapper = recipe._build_target_wrapper(list(layers))
    return recipe


# ---------------------------------------------------------------- each recipe's target-building path
@pytest.mark.parametrize("name, service, logits", [("TrainDFlashRecipe", "dflash", False), ("TrainJetSpecRecipe", "jetspec", True)])
def test_the_dflash_recipes_build_draftfeeds_target_for_a_draftfeed_url_and_their_own_otherwise(
    nemo, urls, qwen3_target, qwen3_model, nemos_loader, name, service, logits
):
    recipe = build_dflash_target(nemo, dflash_recipe(nemo, name, recipe_config(nemo, qwen3_target, urls[service])), qwen3_target)
    model, wrapper = recipe.target_model, recipe.target_wrapper
    try:
        assert isinstance(model, DraftfeedTargetModel) and isinstance(wrapper, DraftfeedDFlashTarget)
        assert (wrapper.target_layer_ids, wrapper.capture_logits) == (LAYERS, logits)
        assert not list(model.parameters())  # no target weights: the two embeddings are fetched, frozen, held apart
        assert torch.equal(model.get_output_embeddings().weight, qwen3_model.lm_head.weight)
        assert torch.equal(model.get_input_embeddings().weight, qwen3_model.get_input_embeddings().weight)
        assert model.config.num_hidden_layers == 8 and not model.get_output_embeddings().weight.requires_grad
    finally:
        wrapper.close()

    own = dflash_recipe(nemo, name, recipe_config(nemo, qwen3_target, None))
    with pytest.raises(NemosLoader):  # NeMo's own loader is asked for the target (it needs CUDA, so it stops there)
        build_dflash_target(nemo, own, qwen3_target)
    own.target_model = qwen3_model
    wrapper = own._build_target_wrapper(LAYERS)
    assert type(wrapper).__name__ == "HFDFlashTargetModel" and wrapper.capture_logits == logits


def test_the_inline_loading_recipes_get_draftfeeds_target_where_their_setup_loads_it(
    nemo, urls, tiny_target, tiny_model, qwen3_target, vispec_target, nemos_loader
):
    """EAGLE-1/2, ViSpec (both stages) and DSpark load their target inside setup(): the calls setup() makes, by the
    names its module imports, give draftfeed's target and wrapper within the recipe's draftfeed target."""
    built = []
    cases = [
        ("train_eagle1", "TrainEagle1Recipe", "eagle", tiny_target, "NeMoAutoModelForCausalLM", lambda m, model: m.HFEagleTargetModel(model)),
        (
            "train_vispec",
            "TrainVispecStage1Recipe",
            "eagle",
            tiny_target,
            "AutoModelForImageTextToText",
            lambda m, model: m.HFEagleTargetModel(model),
        ),
        (
            "train_vispec",
            "TrainVispecRecipe",
            "vispec",
            vispec_target,
            "AutoModelForImageTextToText",
            lambda m, model: m.HFVispecTargetModel(model, image_token_id=VOCAB - 3),
        ),
        (
            "train_dspark",
            "TrainDSparkRecipe",
            "dspark",
            qwen3_target,
            "NeMoAutoModelForCausalLM",
            lambda m, model: m.HFDSparkTargetModel(model, target_layer_ids=LAYERS, cp_mesh=None),
        ),
    ]
    expected = {"eagle": DraftfeedEagleTarget, "vispec": DraftfeedVispecTarget, "dspark": DraftfeedDSparkTarget}
    try:
        for module_name, name, service, target, loader, wrap in cases:
            module = getattr(nemo, module_name)
            recipe = nemo.recipe(module_name, name)(cfg=recipe_config(nemo, target, urls[service]), device=CPU)
            with draftfeed_target(recipe, service):
                model = getattr(module, loader).from_pretrained(str(target), trust_remote_code=False, torch_dtype=torch.float32)
                model.to(CPU)
                model.requires_grad_(False)
                wrapper = wrap(module, model)
            built.append(wrapper)
            assert isinstance(model, DraftfeedTargetModel) and type(wrapper) is expected[service], name
            assert wrapper.get_input_embeddings().weight.shape == (VOCAB, model.config.get_text_config().hidden_size)
    finally:
        for wrapper in built:
            wrapper.close()
    # outside a draftfeed recipe's setup, the loader and the wrapper are NeMo's own
    with pytest.raises(NemosLoader):
        nemo.train_eagle1.NeMoAutoModelForCausalLM.from_pretrained(str(tiny_target), torch_dtype=torch.float32)
    assert type(nemo.train_eagle1.HFEagleTargetModel(tiny_model)).__name__ == "HFEagleTargetModel"


@pytest.mark.parametrize(
    "change, message",
    [
        (
            lambda a, u: a | {"remote_urls": ["http://127.0.0.1:9/"]},
            r"TrainDFlashRecipe has no remote backend of its own: recipe_args.remote_urls must be draftfeed://",
        ),
        (lambda a, u: a | {"remote_urls": []}, r"target_model_backend is remote but remote_urls is empty"),
        (lambda a, u: a | {"remote_urls": [u + "&prefetch=4"]}, r"unknown option 'prefetch'; the options are prefetch_depth"),
        (lambda a, u: a | {"remote_urls": [u, u.replace("/dflash", "/jetspec")]}, r"2 different draftfeed URLs given .*: give one"),
    ],
    ids=["not-draftfeed", "no-url", "unknown-option", "two-urls"],
)
def test_a_wrong_config_is_refused_by_setup_before_anything_loads(nemo, urls, qwen3_target, change, message):
    cfg = recipe_config(nemo, qwen3_target, urls["dflash"])
    args = change(cfg.recipe_args.to_dict(), urls["dflash"])
    recipe = nemo.recipe("train_dflash", "TrainDFlashRecipe")(cfg=nemo.ConfigNode({"recipe_args": args}))
    with pytest.raises(ValueError, match=message) as refused:
        recipe.setup()  # the wrapped setup checks the config before the recipe's own setup starts a process group
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize(
    "name, service, layers, options, message",
    [
        ("TrainDFlashRecipe", "dflash", [2, 4], {}, r"target_layer_ids: expected \[2, 4\], served \[1, 3, 5\].*start the service's workers"),
        ("TrainDFlashRecipe", "jetspec", LAYERS, {}, r"capture_logits: expected False, served True"),
        ("TrainJetSpecRecipe", "dflash", LAYERS, {}, r"capture_logits: expected True, served False"),
        (
            "TrainDFlashRecipe",
            "dflash",
            LAYERS,
            {"distributed": {"tp_size": 2}},
            r"distributed.tp_size=2 shards the target, which draftfeed's workers hold",
        ),
    ],
    ids=["layers", "logits-unasked", "logits-missing", "tensor-parallel"],
)
def test_a_recipe_whose_target_the_service_does_not_serve_is_refused_in_one_line(nemo, urls, qwen3_target, name, service, layers, options, message):
    cfg = recipe_config(nemo, qwen3_target, urls[service])
    recipe = dflash_recipe(nemo, name, nemo.ConfigNode({**cfg.to_dict(), **options}))
    with pytest.raises(ValueError, match=message) as refused:
        build_dflash_target(nemo, recipe, qwen3_target, layers)
    assert "\n" not in str(refused.value)


# ---------------------------------------------------------------- NeMo's trainers on both targets
def padded_batches() -> list[dict[str, torch.Tensor]]:
    return [make_batch(2, 24, VOCAB, seed=seed) for seed in range(STEPS)]


def packed_batches() -> list[dict[str, torch.Tensor]]:
    return [
        make_packed_batch([[7, 9, 8], [24]], pad=[0, 0], vocab_size=VOCAB, seed=seed)
        if seed % 2
        else make_packed_batch([[10, 11], [5, 16]], pad=[3, 3], vocab_size=VOCAB, seed=seed)
        for seed in range(STEPS)
    ]


def same_training(got: list[torch.Tensor], expected: list[torch.Tensor], trained: torch.nn.Module, reference: torch.nn.Module) -> None:
    differences = [f"step {i}: {a.item()!r} vs {b.item()!r}" for i, (a, b) in enumerate(zip(got, expected)) if not torch.equal(a, b)]
    assert not differences, "losses differ: " + "; ".join(differences)
    theirs = dict(reference.named_parameters())
    for name, param in trained.named_parameters():
        assert torch.equal(param, theirs[name]), f"{name} differs after {STEPS} steps by up to {(param - theirs[name]).abs().max().item():.3g}"
    assert all(torch.isfinite(loss) for loss in got) and len({loss.item() for loss in got}) > 1  # it trained
    print(f"losses {[loss.item() for loss in got]}")


def dflash_training(nemo, recipe, template: torch.nn.Module, batches) -> tuple[list[torch.Tensor], torch.nn.Module]:
    """The recipe's trainer module (its _build_trainer_module) on a copy of ``template``, stepped with its own
    _run_trainer_step on its target wrapper's batches: the losses and the trained draft."""
    recipe.draft_model = copy.deepcopy(template)
    trainer = recipe._build_trainer_module("sdpa", nemo.ConfigNode({"num_anchors": 6, "loss_decay_gamma": 7.0}))
    recipe.trainer_module = trainer
    torch.manual_seed(0)  # the anchors the trainer samples

    def step(batch):
        packing = {k: batch[k] for k in ("position_ids", "seq_lens", "doc_remaining") if k in batch}
        target_batch = recipe.target_wrapper.generate_batch(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], loss_mask=batch["loss_mask"], **packing
        )
        return recipe._run_trainer_step(target_batch)

    return train_steps(trainer, batches, step), recipe.draft_model


@pytest.mark.parametrize("name, service", [("TrainDFlashRecipe", "dflash"), ("TrainJetSpecRecipe", "jetspec")])
@pytest.mark.parametrize("kind", ["padded", "packed"])
def test_nemos_dflash_trainers_on_draftfeed_give_the_losses_of_the_colocated_wrapper(nemo, urls, qwen3_target, qwen3_model, name, service, kind):
    batches = padded_batches() if kind == "padded" else packed_batches()
    colocated = dflash_recipe(nemo, name, recipe_config(nemo, qwen3_target, None))
    colocated.target_model = qwen3_model
    colocated.target_wrapper = nemo.dflash_target.HFDFlashTargetModel(qwen3_model, target_layer_ids=LAYERS, capture_logits=service == "jetspec")
    spec = nemo.dflash.resolve_dflash_draft_spec(["Qwen3ForCausalLM"])
    draft_cls = colocated._draft_cls(spec)
    config = colocated._build_qwen3_draft_config(
        colocated.cfg.recipe_args,
        target_text_config=qwen3_model.config,
        draft_cls=draft_cls,
        draft_num_hidden_layers=1,
        num_target_layers=8,
        target_layer_ids=LAYERS,
        attention_backend="sdpa",
    )
    torch.manual_seed(0)
    template = draft_cls(config).to(dtype=torch.float32)
    expected, reference = dflash_training(nemo, colocated, template, batches)

    remote = build_dflash_target(nemo, dflash_recipe(nemo, name, recipe_config(nemo, qwen3_target, urls[service])), qwen3_target)
    assert isinstance(remote.target_model, DraftfeedTargetModel) and isinstance(remote.target_wrapper, DraftfeedDFlashTarget)
    try:
        got, trained = dflash_training(nemo, remote, template, batches)
    finally:
        remote.target_wrapper.close()
    same_training(got, expected, trained, reference)


def eagle1_training(nemo, wrapper, template: torch.nn.Module, batches) -> tuple[list[torch.Tensor], torch.nn.Module]:
    """NeMo's EagleTrainerModule as TrainEagle1Recipe.setup() builds it, stepped with the recipe's _compute_metrics."""
    from nemo_automodel.components.speculative.eagle.core_v12 import EagleTrainerModule

    draft = copy.deepcopy(template)
    draft.copy_embeddings_from_target(wrapper.get_input_embeddings())
    draft.freeze_embeddings()
    trainer = EagleTrainerModule(
        draft,
        target_lm_head=wrapper.get_lm_head(),
        hidden_loss_weight=1.0,
        token_loss_weight=0.1,
        feature_noise_config=nemo.train_eagle1._build_feature_noise(0.1),
    )
    recipe = nemo.recipe("train_eagle1", "TrainEagle1Recipe")(target_wrapper=wrapper, trainer_module=trainer, device=CPU)
    torch.manual_seed(0)  # the feature noise
    return train_steps(trainer, batches, recipe._compute_metrics), draft


@pytest.mark.parametrize("kind", ["padded", "packed"])
def test_nemos_eagle1_trainer_on_draftfeed_gives_the_losses_of_the_colocated_wrapper(nemo, urls, tiny_target, tiny_model, kind):
    batches = padded_batches() if kind == "padded" else packed_batches()
    draft_config = tiny_model.config.to_dict() | {"architectures": ["LlamaEagleDraftModel"], "draft_num_hidden_layers": 1}
    torch.manual_seed(0)
    spec = nemo.eagle_registry.resolve_eagle1_draft_spec(tiny_model.config.architectures)
    template = spec.draft_cls(type(tiny_model.config).from_dict(draft_config)).to(dtype=torch.float32)
    expected, reference = eagle1_training(nemo, nemo.train_eagle1.HFEagleTargetModel(tiny_model), template, batches)

    recipe = nemo.recipe("train_eagle1", "TrainEagle1Recipe")(cfg=recipe_config(nemo, tiny_target, urls["eagle"]), device=CPU)
    with draftfeed_target(recipe, "eagle"):  # as TrainEagle1Recipe.setup() builds its target
        wrapper = nemo.train_eagle1.HFEagleTargetModel(nemo.train_eagle1.NeMoAutoModelForCausalLM.from_pretrained(str(tiny_target)))
    assert isinstance(wrapper, DraftfeedEagleTarget)
    try:
        got, trained = eagle1_training(nemo, wrapper, template, batches)
    finally:
        wrapper.close()
    same_training(got, expected, trained, reference)
