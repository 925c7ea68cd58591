"""NeMo AutoModel's P-EAGLE (TrainEagle3Recipe with parallel_drafting) on draftfeed (use_draftfeed()), against the real
nemo-automodel package and a real broker and workers on the tiny target.

The recipe's own setup() runs, wrapped by use_draftfeed(), with three of its edges stood in for: the process group
(one process), the tokenizer and the dataloader (the test's batches). Everything between them is NeMo's: the P-EAGLE
gates, the colocated target path with its loader and HFEagle3TargetModel, the draft, the P-EAGLE trainer module, the
optimizer and the LR schedule. The same setup with the recipe's own colocated target is the reference; both are stepped
with the recipe's step methods (_forward_batch, _peagle_partitioned_step, _prefetched_batches). torch's flex_attention
has no backward pass on CPU, so the draft's COD attention runs as a dense computation of the same mask, on both sides.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import add_service, make_batch
from support.nemo import nemo_on_path

from draftfeed.integrations.nemo import DraftfeedTargetModel, use_draftfeed
from draftfeed.integrations.nemo.peagle import DraftfeedPeagleTarget, asks_for_draftfeed
from draftfeed.integrations.nemo.recipes import draftfeed_target

pytestmark = pytest.mark.timeout(120)

VOCAB = 1000
AUX = [1, 3, 4]  # NeMo's default aux layers of the 8-layer tiny target: [1, L // 2 - 1, L - 4]
STEPS = 4
PREFETCH = 2


@pytest.fixture(scope="module")
def nemo() -> SimpleNamespace:
    nemo_on_path()
    use_draftfeed()
    use_draftfeed()  # a second call changes nothing
    from nemo_automodel.components.config.loader import ConfigNode

    return SimpleNamespace(
        ConfigNode=ConfigNode,
        train_eagle3=importlib.import_module("nemo_automodel.recipes.llm.train_eagle3"),
        target=importlib.import_module("nemo_automodel.components.speculative.eagle.target"),
        backend=importlib.import_module("nemo_automodel.components.speculative.eagle.backend"),
        peagle_draft=importlib.import_module("nemo_automodel.components.speculative.eagle.peagle_draft"),
    )


@pytest.fixture(scope="module")
def urls(cluster, tiny_target) -> dict[str, str]:
    add_service(cluster, tiny_target, "peagle", "--task", "dflash", "--capture-logits", "--target-layer-ids", ",".join(map(str, AUX)))
    add_service(cluster, tiny_target, "dflash", "--task", "dflash", "--target-layer-ids", "1,3,5")  # another recipe's service
    host_port = cluster.frontend.removeprefix("tcp://")
    return {name: f"draftfeed://{host_port}/{name}?data_plane=frames&prefetch_depth={PREFETCH}" for name in ("peagle", "dflash")}


@pytest.fixture(scope="module")
def llama(tiny_target):
    """The colocated reference's target, loaded once (the recipe freezes it and moves it in place)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).eval()


def batches() -> list[dict[str, torch.Tensor]]:
    """Right-padded ragged rows, an unsupervised prompt each."""
    return [make_batch(2, 24, VOCAB, seed=seed) for seed in range(STEPS)]


def config(nemo, target: Path, output: Path, url: str | None = None, **options: object):
    args: dict[str, object] = {
        "target_model_name_or_path": str(target),
        "parallel_drafting": True,
        "mask_token_id": VOCAB - 1,
        "num_depths": 4,
        "num_draft_layers": 2,
        "draft_vocab_size": 300,
        "seq_length": 24,
        "micro_batch_size": 2,
        "train_data_path": "the test's batches",
        "num_epochs": 1,
        "output_dir": str(output),
        **options,
    }
    if url is not None:
        args |= {"target_model_backend": "remote", "remote_urls": [url], "remote_timeout": 60}
    return nemo.ConfigNode({"recipe_args": args, "optimizer": {"lr": 1e-2}})


def dense_attention(q, k, v, *, block_mask, scale):
    """The draft's COD attention as flex_attention computes it, densely: torch's flex_attention has no backward on CPU.
    A query that sees nothing (a padded position) gets zeros, as from flex_attention."""
    from torch.nn.attention.flex_attention import create_mask

    visible = create_mask(block_mask.mask_mod, None, None, q.shape[-2], k.shape[-2], device=q.device)
    scores = (q @ k.transpose(-2, -1) * scale).masked_fill(~visible, torch.finfo(q.dtype).min)
    return (scores.softmax(dim=-1) * visible) @ v


@pytest.fixture
def edges(nemo, monkeypatch) -> None:
    """The recipe's setup() in this one process: no process group, a tokenizer of ids only, the test's batches; and
    the draft's attention without flex_attention (dense_attention), on both targets alike."""
    monkeypatch.setattr(nemo.peagle_draft, "_peagle_flex_attention", dense_attention)
    module = nemo.train_eagle3
    monkeypatch.setattr(module, "initialize_distributed", lambda **_: SimpleNamespace(rank=0, world_size=1, device=None, is_main=True))
    monkeypatch.setattr(module, "setup_logging", lambda: None)
    tokenizer = SimpleNamespace(bos_token_id=None, eos_token_id=None, pad_token_id=0, unk_token_id=None)
    monkeypatch.setattr(module, "NeMoAutoTokenizer", SimpleNamespace(from_pretrained=lambda *_, **__: tokenizer))
    monkeypatch.setattr(module.TrainEagle3Recipe, "_build_train_dataloader", lambda self, path, split: batches())


def set_up(nemo, cfg, monkeypatch=None, colocated=None):
    """NeMo's recipe after its own (wrapped) setup(); ``colocated``: the model NeMo's loader gives (it needs CUDA here)."""
    if colocated is not None:
        with monkeypatch.context() as patched:
            patched.setattr(nemo.train_eagle3, "NeMoAutoModelForCausalLM", SimpleNamespace(from_pretrained=lambda *_, **__: colocated))
            return set_up(nemo, cfg)
    torch.manual_seed(0)  # the draft's initial weights
    recipe = nemo.train_eagle3.TrainEagle3Recipe(cfg)
    recipe.setup()
    return recipe


def train(recipe, prefetch: bool = False) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """STEPS optimizer steps as the recipe's loop takes them: _peagle_partitioned_step for sequence_partitions > 1,
    else _forward_batch, on batches from _prefetched_batches when ``prefetch``. The losses and the trained draft."""
    torch.manual_seed(0)  # COD sampling
    source = recipe._prefetched_batches(batches()) if prefetch else ((batch, None) for batch in batches())
    losses = []
    for batch, target_batch in source:
        if recipe._peagle_partitioned:
            metrics = recipe._peagle_partitioned_step(batch)
        else:
            metrics = recipe._forward_batch(batch, target_batch)
            (metrics.loss / float(recipe.grad_accumulation_steps)).backward()
        torch.nn.utils.clip_grad_norm_(recipe.trainer_module.parameters(), recipe.max_grad_norm)
        recipe.optimizer.step()
        recipe.lr_scheduler.step()
        recipe.optimizer.zero_grad(set_to_none=True)
        losses.append(metrics.loss.detach())
    return losses, {name: param.detach().clone() for name, param in recipe.draft_model.named_parameters()}


@pytest.fixture(scope="module")
def references() -> dict[int, tuple[list[torch.Tensor], dict[str, torch.Tensor]]]:
    """The colocated runs' losses and draft, by sequence_partitions (computed once each)."""
    return {}


@pytest.mark.parametrize("mode", ["flat", "partitioned", "prefetch"])
def test_the_peagle_recipe_on_draftfeed_gives_the_losses_of_its_colocated_wrapper(
    nemo, urls, tiny_target, llama, edges, monkeypatch, tmp_path, references, mode
):
    partitions = {"sequence_partitions": 2} if mode == "partitioned" else {}
    key = partitions.get("sequence_partitions", 1)
    if key not in references:
        colocated = set_up(nemo, config(nemo, tiny_target, tmp_path / "colocated", **partitions), monkeypatch, colocated=llama)
        assert type(colocated.target_wrapper) is nemo.target.HFEagle3TargetModel and colocated.target_prefetch_depth == 0
        references[key] = train(colocated)
    expected, reference = references[key]

    depth = {"target_prefetch_depth": PREFETCH} if mode == "prefetch" else {}
    cfg = config(nemo, tiny_target, tmp_path / "draftfeed", urls["peagle"], **partitions, **depth)
    recipe = set_up(nemo, cfg)
    try:
        assert isinstance(recipe.target_model, DraftfeedTargetModel) and isinstance(recipe.target_wrapper, DraftfeedPeagleTarget)
        assert recipe.cfg.recipe_args.target_model_backend == "remote"  # colocated only while setup() ran
        assert recipe.target_wrapper.aux_layer_ids == AUX and recipe._peagle_partitioned == (mode == "partitioned")
        assert recipe.target_prefetch_depth == (PREFETCH if mode == "prefetch" else 0)
        got, trained = train(recipe, prefetch=mode == "prefetch")
    finally:
        recipe.target_wrapper.close()

    differences = [f"step {i}: {a.item()!r} vs {b.item()!r}" for i, (a, b) in enumerate(zip(got, expected)) if not torch.equal(a, b)]
    assert not differences, "losses differ: " + "; ".join(differences)
    for name, param in trained.items():
        assert torch.equal(param, reference[name]), f"{name} differs after {STEPS} steps"
    assert all(torch.isfinite(loss) for loss in got) and len({loss.item() for loss in got}) > 1  # it trained
    print(f"{mode}: losses {[loss.item() for loss in got]}")


# ---------------------------------------------------------------- the batch, the config, the refusals
@pytest.mark.parametrize("ragged", [False, True], ids=["full", "ragged"])
def test_the_batch_is_the_one_nemos_wrapper_gives(nemo, urls, tiny_target, llama, tmp_path, ragged):
    """Every field of the trainer's inputs, dtype and all, the shift and its zero tail included. Padded positions are
    zeros on draftfeed (docs/contract.md, "Padding"): the aux states there, and the shifted logits of a position whose
    next token is padding; no loss reads either."""
    batch = make_batch(2, 24, VOCAB, seed=7, ragged=ragged)
    recipe = nemo.train_eagle3.TrainEagle3Recipe(config(nemo, tiny_target, tmp_path, urls["peagle"]))
    recipe.device = torch.device("cpu")
    with draftfeed_target(recipe, "dflash"):  # as the wrapped setup() has it while NeMo's colocated path runs
        model = nemo.train_eagle3.NeMoAutoModelForCausalLM.from_pretrained(str(tiny_target))
        wrapper = nemo.train_eagle3.HFEagle3TargetModel(model, aux_layer_ids=None, cp_mesh=None)
    try:
        assert isinstance(wrapper, DraftfeedPeagleTarget) and isinstance(wrapper, nemo.backend.Eagle3TargetBackend)
        got = wrapper.generate_batch(**batch).to_trainer_inputs()
        pending = wrapper.generate_batch_async(batch["input_ids"], batch["attention_mask"], batch["loss_mask"])
        assert all(torch.equal(a, b) for a, b in zip(pending.result().to_trainer_inputs().values(), got.values()))
    finally:
        wrapper.close()
    expected = nemo.target.HFEagle3TargetModel(llama).generate_batch(**batch).to_trainer_inputs()
    assert list(got) == list(expected) == ["input_ids", "attention_mask", "loss_mask", "aux_hidden_states", "target_logits"]
    real = batch["attention_mask"].bool()
    next_real = torch.cat([real[:, 1:], torch.zeros_like(real[:, :1])], dim=1)
    for name, at in {"aux_hidden_states": real, "target_logits": next_real}.items():
        assert got[name].dtype == expected[name].dtype and got[name].shape == expected[name].shape, name
        assert torch.equal(got[name][at], expected[name][at]), name
        assert not got[name][~at].any(), name  # zeros, and the logits' shifted-in tail
        assert ragged or torch.equal(got[name], expected[name]), name
    for name in ("input_ids", "attention_mask", "loss_mask"):
        assert got[name].dtype == expected[name].dtype and torch.equal(got[name], expected[name]), name


def test_only_a_peagle_config_naming_draftfeed_is_served(nemo, urls, tiny_target, tmp_path, edges):
    url = urls["peagle"]
    eagle3 = config(nemo, tiny_target, tmp_path, url, parallel_drafting=False)
    nemos = config(nemo, tiny_target, tmp_path, "http://127.0.0.1:9/")
    assert asks_for_draftfeed(config(nemo, tiny_target, tmp_path, url).recipe_args)
    assert not asks_for_draftfeed(eagle3.recipe_args)  # EAGLE-3 keeps the recipe's remote backend (eagle3.py)
    assert not asks_for_draftfeed(config(nemo, tiny_target, tmp_path).recipe_args)  # colocated: NeMo's own target
    assert not asks_for_draftfeed(nemos.recipe_args)
    with pytest.raises(NotImplementedError, match=r"parallel_drafting \(P-EAGLE\) only supports target_model_backend='colocated'"):
        nemo.train_eagle3.TrainEagle3Recipe(nemos).setup()  # NeMo's own refusal, its config untouched


@pytest.mark.parametrize(
    "service, options, message",
    [
        (
            "dflash",
            {},
            r"TrainEagle3Recipe: service 'dflash' .*target_layer_ids: expected \[1, 3, 4\], served \[1, 3, 5\]; capture_logits: "
            r"expected True, served False: start its workers with --task dflash --capture-logits --target-layer-ids 1,3,4, or set",
        ),
        ("peagle", {"aux_layer_ids": [2, 3, 4]}, r"expected \[2, 3, 4\], served \[1, 3, 4\]: start its workers with .*--target-layer-ids 2,3,4"),
        ("peagle", {"sequence_partitions": 2, "target_prefetch_depth": 2}, r"would have every batch computed twice: set target_prefetch_depth: 0"),
        ("peagle", {"remote_urls": ["URL", "http://127.0.0.1:9/"]}, r"remote_urls mixes draftfeed URLs with others \(http://127.0.0.1:9/\)"),
        ("peagle", {"distributed": {"tp_size": 2}}, r"distributed.tp_size=2 shards the target, which draftfeed's workers hold"),
    ],
    ids=["not-peagles-service", "other-aux-layers", "partitions-and-prefetch", "mixed-urls", "tensor-parallel"],
)
def test_what_draftfeed_cannot_serve_is_refused_in_one_line(nemo, urls, tiny_target, tmp_path, edges, service, options, message):
    cfg = config(nemo, tiny_target, tmp_path, urls[service]).to_dict()
    distributed = options.pop("distributed", None)
    cfg["recipe_args"] |= {
        key: [urls[service] if url == "URL" else url for url in value] if key == "remote_urls" else value for key, value in options.items()
    }
    recipe = nemo.train_eagle3.TrainEagle3Recipe(nemo.ConfigNode(cfg | ({"distributed": distributed} if distributed else {})))
    with pytest.raises(ValueError, match=message) as refused:
        recipe.setup()
    assert "\n" not in str(refused.value)
    assert recipe.cfg.recipe_args.target_model_backend == "remote"
