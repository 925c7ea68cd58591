"""NeMo AutoModel's EAGLE-3 recipe on draftfeed (draftfeed.integrations.nemo), against the real nemo-automodel package
and a real broker and worker on the tiny target.

The recipe's own methods run on an instance of its class whose attributes the test sets (the recipe's setup wants a
distributed run, a tokenizer and a dataset): its remote backend factory, its prefetch cap, its prefetch loop and its
forward step, with NeMo's own trainer module and draft model.

NeMo and the packages its recipe imports (torchao, datasets, ...) are installed apart from the venv, in
.nemo-packages (the Makefile: pip --target, --no-deps), and put on the path by the ``nemo`` fixture only: with
torchao importable, transformers loads it in every process that loads a model, every worker of the suite included.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from conftest import add_service, make_batch
from reference import make_packed_batch
from support.nemo import nemo_on_path

from draftfeed.integrations.nemo import DraftfeedEagle3TargetModel, use_draftfeed

pytestmark = pytest.mark.timeout(180)

SERVICE = "nemo-eagle3"
DRAFT_VOCAB = 300  # of the tiny target's 1000
TTT_STEPS = 3
STEPS = 4
PREFETCH = 3  # the recipe's target_prefetch_depth


@pytest.fixture(scope="module")
def nemo() -> SimpleNamespace:
    """NeMo's names the tests use, imported from .nemo-packages (after the venv's own packages on the path)."""
    nemo_on_path()
    from nemo_automodel.components.config.loader import ConfigNode
    from nemo_automodel.components.datasets.llm.eagle3 import build_eagle3_token_mapping
    from nemo_automodel.components.speculative.eagle import Eagle3TargetBackend, Eagle3TrainerModule, HFEagle3TargetModel
    from nemo_automodel.components.speculative.eagle.registry import resolve_eagle3_draft_spec
    from nemo_automodel.components.speculative.eagle.remote import RemoteEagle3TargetModel
    from nemo_automodel.recipes.llm.train_eagle3 import TrainEagle3Recipe

    class Recipe(TrainEagle3Recipe):
        """NeMo's recipe class, its attributes set by the test instead of by setup()."""

        def __init__(self, **attributes: object) -> None:
            for name, value in attributes.items():
                setattr(self, name, value)

    return SimpleNamespace(
        ConfigNode=ConfigNode,
        build_eagle3_token_mapping=build_eagle3_token_mapping,
        Eagle3TargetBackend=Eagle3TargetBackend,
        Eagle3TrainerModule=Eagle3TrainerModule,
        HFEagle3TargetModel=HFEagle3TargetModel,
        resolve_eagle3_draft_spec=resolve_eagle3_draft_spec,
        RemoteEagle3TargetModel=RemoteEagle3TargetModel,
        Recipe=Recipe,
    )


@pytest.fixture(scope="module")
def url(cluster, tiny_target) -> str:
    add_service(cluster, tiny_target, SERVICE)
    host_port = cluster.frontend.removeprefix("tcp://")
    return f"draftfeed://{host_port}/{SERVICE}?prefetch_depth={PREFETCH}&data_plane=frames"


@pytest.fixture(scope="module", autouse=True)
def drop_in(nemo):
    """The one documented call; NeMo's class as it was afterwards."""
    before = nemo.RemoteEagle3TargetModel.__dict__["from_urls"]
    use_draftfeed()
    use_draftfeed()  # a second call changes nothing
    try:
        yield
    finally:
        nemo.RemoteEagle3TargetModel.from_urls = before


def remote_recipe(nemo: SimpleNamespace, urls: list[str], **options: object):
    """The recipe's remote backend built as the recipe builds it (_setup_remote_target, from recipe_args): (recipe, recipe_args)."""
    recipe_args = nemo.ConfigNode({"target_model_backend": "remote", "remote_urls": urls, "remote_timeout": 60, "remote_max_retries": 3, **options})
    recipe = nemo.Recipe(device=torch.device("cpu"), dist_env=SimpleNamespace(is_main=True, world_size=1))
    recipe._setup_remote_target(recipe_args)
    return recipe, recipe_args


def test_the_recipes_remote_backend_gives_a_draftfeed_target_that_keeps_the_whole_prefetch_depth(nemo, url):
    recipe, recipe_args = remote_recipe(nemo, [url], target_prefetch_depth=8)
    target = recipe.target_wrapper
    try:
        assert isinstance(target, DraftfeedEagle3TargetModel) and isinstance(target, nemo.Eagle3TargetBackend)
        assert target.supports_async
        assert (target.url.broker, target.url.service) == (url.split("?")[0].replace("draftfeed://", "tcp://").rsplit("/", 1)[0], SERVICE)
        assert target.target.request_timeout == 60 and target.target.prefetch_depth == PREFETCH  # remote_timeout; the URL's option
        assert recipe._resolve_prefetch_depth(recipe_args) == 8  # not capped at one batch a server
        assert target.model_info() == {"num_hidden_layers": 8, "hidden_size": 64, "vocab_size": 1000, "aux_layer_ids": [1, 3, 4]}
    finally:
        target.close()


def test_other_urls_stay_with_nemos_own_backend(nemo):
    recipe, _ = remote_recipe(nemo, ["http://127.0.0.1:9/"])  # NeMo's client connects only when asked for something
    assert type(recipe.target_wrapper) is nemo.RemoteEagle3TargetModel


@pytest.mark.parametrize(
    "urls, message",
    [
        (["draftfeed://127.0.0.1:9/s?prefetch=4"], r"unknown option 'prefetch'; the options are prefetch_depth, .*data_endpoint"),
        (
            ["draftfeed://127.0.0.1:9/s?request_timeout=5"],
            r"'request_timeout' is not an option of the URL: it is the recipe's recipe_args.remote_timeout",
        ),
        (["draftfeed://127.0.0.1:9/s?prefetch_depth=two"], r"prefetch_depth='two': input should be a valid integer"),
        (["draftfeed://127.0.0.1:9/s", "http://127.0.0.1:9/"], r"remote_urls mixes draftfeed URLs with others \(http://127.0.0.1:9/\)"),
        (["draftfeed://127.0.0.1:9/s", "draftfeed://127.0.0.1:9/t"], r"2 different draftfeed URLs given .*: give one"),
    ],
    ids=["unknown", "from-the-recipe", "type", "mixed", "several"],
)
def test_a_wrong_url_is_refused_by_the_recipes_call_saying_what_to_change(nemo, urls, message):
    with pytest.raises(ValueError, match=message):
        remote_recipe(nemo, urls)


# ---------------------------------------------------------------- NeMo's trainer on both backends
def padded_batches() -> list[dict[str, torch.Tensor]]:
    """Right-padded rows of ragged lengths (with an unsupervised prompt)."""
    return [make_batch(2, 24, 1000, seed=seed) for seed in range(STEPS)]


def packed_batches() -> list[dict[str, torch.Tensor]]:
    """Rows of several documents, packed as NeMo packs them, one with trailing padding."""
    return [
        make_packed_batch([[7, 9, 8], [24]], pad=[0, 0], vocab_size=1000, seed=seed)
        if seed % 2
        else make_packed_batch([[10, 11], [5, 16]], pad=[3, 3], vocab_size=1000, seed=seed)
        for seed in range(STEPS)
    ]


def trainer_on(nemo: SimpleNamespace, target, template: torch.nn.Module, mapping: tuple[torch.Tensor, torch.Tensor]):
    """NeMo's trainer module around a copy of ``template``, seeded from ``target`` as the recipe seeds it; and its optimizer."""
    draft = copy.deepcopy(template)
    draft.copy_embeddings_from_target(target.get_input_embeddings())
    draft.set_vocab_mapping(mapping[0])
    draft.freeze_embeddings()
    trainer = nemo.Eagle3TrainerModule(draft, selected_token_ids=mapping[0], selected_token_mask=mapping[1], ttt_steps=TTT_STEPS)
    optimizer = torch.optim.AdamW([p for p in trainer.parameters() if p.requires_grad], lr=1e-2, betas=(0.9, 0.95))
    return trainer, optimizer


def train(recipe, optimizer: torch.optim.Optimizer, steps) -> list[torch.Tensor]:
    """The recipe's step: its _forward_batch, then backward, clip and the optimizer; the losses."""
    losses = []
    for batch, target_batch in steps:
        metrics = recipe._forward_batch(batch, target_batch)
        metrics.loss.backward()
        torch.nn.utils.clip_grad_norm_(recipe.trainer_module.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(metrics.loss.detach())
    return losses


@pytest.mark.parametrize("kind", ["prefetched", "packed"])
def test_nemos_trainer_on_draftfeed_gives_the_losses_of_its_colocated_backend(nemo, url, tiny_model, kind):
    batches = padded_batches() if kind == "prefetched" else packed_batches()
    mapping = nemo.build_eagle3_token_mapping(batches, target_vocab_size=1000, draft_vocab_size=DRAFT_VOCAB, special_token_ids=[0])
    config = tiny_model.config.to_dict() | {
        "draft_vocab_size": DRAFT_VOCAB,
        "target_hidden_size": tiny_model.config.hidden_size,
        "architectures": ["LlamaEagle3DraftModel"],
        "tie_word_embeddings": False,
        "attn_implementation": "eager",
    }
    torch.manual_seed(0)
    draft_class = nemo.resolve_eagle3_draft_spec(tiny_model.config.architectures).draft_cls
    template = draft_class(type(tiny_model.config).from_dict(config)).to(dtype=torch.float32)  # the recipe's compute dtype on CPU

    colocated = nemo.HFEagle3TargetModel(tiny_model)
    trainer, optimizer = trainer_on(nemo, colocated, template, mapping)
    recipe = nemo.Recipe(device=torch.device("cpu"), target_wrapper=colocated, trainer_module=trainer, target_prefetch_depth=0)
    expected = train(recipe, optimizer, ((batch, None) for batch in batches))

    remote, recipe_args = remote_recipe(nemo, [url], target_prefetch_depth=PREFETCH)
    try:
        remote.target_wrapper.set_vocab_mapping(*mapping)  # as the recipe's _setup_online_target does
        trainer_remote, optimizer_remote = trainer_on(nemo, remote.target_wrapper, template, mapping)
        assert torch.equal(trainer_remote.draft_model.model.embed_tokens.weight, trainer.draft_model.model.embed_tokens.weight)  # seeded alike
        remote.trainer_module = trainer_remote
        if kind == "prefetched":  # the recipe's prefetch loop, batches in flight on the worker while the draft trains
            remote.target_prefetch_depth = remote._resolve_prefetch_depth(recipe_args)
            assert remote.target_prefetch_depth == PREFETCH
            got = train(remote, optimizer_remote, remote._prefetched_batches(batches))
        else:  # packed rows take the recipe's step without prefetch, which hands the target the packing fields
            remote.target_prefetch_depth = 0
            got = train(remote, optimizer_remote, ((batch, None) for batch in batches))
    finally:
        remote.target_wrapper.close()

    differences = [f"step {i}: {a.item()!r} vs {b.item()!r}" for i, (a, b) in enumerate(zip(got, expected)) if not torch.equal(a, b)]
    assert not differences, "losses differ: " + "; ".join(differences)
    for name, param in trainer_remote.named_parameters():
        assert torch.equal(param, dict(trainer.named_parameters())[name]), f"{name} differs after {STEPS} steps"
    assert all(torch.isfinite(loss) for loss in got) and len(set(loss.item() for loss in got)) > 1  # it trained
    print(f"{kind}: losses {[loss.item() for loss in got]}")


def test_a_trainer_that_keeps_more_batches_in_flight_than_the_url_allows_is_told_how_to_fix_it(nemo, url, caplog):
    recipe, recipe_args = remote_recipe(nemo, [url], target_prefetch_depth=PREFETCH + 2)
    try:
        recipe.target_prefetch_depth = recipe._resolve_prefetch_depth(recipe_args)
        with caplog.at_level("WARNING", logger="draftfeed.nemo"):
            answered = [target_batch for _, target_batch in recipe._prefetched_batches(padded_batches() * 2)]
    finally:
        recipe.target_wrapper.close()
    assert len(answered) == 2 * STEPS and all(b.target_probs.shape == (2, 24, 1000) for b in answered)  # the identity mapping
    warnings = [r.getMessage() for r in caplog.records if r.name == "draftfeed.nemo"]
    assert len(warnings) == 1 and f"keeps {PREFETCH + 2} batches in flight but the draftfeed URL's prefetch_depth is {PREFETCH}" in warnings[0]
    assert f"add prefetch_depth={PREFETCH + 2} to the URL {url}" in warnings[0]
