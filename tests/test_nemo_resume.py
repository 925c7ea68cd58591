"""What NeMo AutoModel's EAGLE-3 recipe on draftfeed trains on after a stop and a resume from its own checkpoint.

The recipe's own training loop (``_train_epochs``: its prefetch loop, step and step checkpoints) and its own
``save_checkpoint`` / ``load_checkpoint`` (NeMo's Checkpointer, on CPU without a process group) run on instances of its
class whose attributes the test sets, as in tests/test_nemo.py, against a real broker and worker on the tiny target.
A run is stopped right after its checkpoint at step STOP; a new instance loads that checkpoint and goes on to the step
budget. The dataset's indices each step trained on are recorded and compared with an uninterrupted run's
(docs/nemo.md, "Stopping and resuming").
"""

from __future__ import annotations

import copy
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import add_service, make_batch
from support.nemo import nemo_on_path

from draftfeed.integrations.nemo import use_draftfeed

pytestmark = pytest.mark.timeout(180)

SERVICE = "nemo-resume"
DRAFT_VOCAB = 300
SAMPLES = 12  # rows of the dataset
MICRO_BATCH = 2  # 6 batches an epoch
EPOCHS = 2  # 12 optimizer steps in all (grad_accumulation_steps 1)
PER_EPOCH = SAMPLES // MICRO_BATCH
STEPS = EPOCHS * PER_EPOCH
STOP = 2  # a step checkpoint every STOP steps; the run stops right after the one at step STOP, in epoch 0
DEPTH = 3  # the recipe's target_prefetch_depth


class Stopped(Exception):
    """The run's stop, right after the checkpoint at step STOP (a preemption)."""


class Rows(torch.utils.data.Dataset):
    """SAMPLES right-padded rows, each carrying its own index; records the indices the dataloader reads, in order."""

    def __init__(self) -> None:
        self.rows = [{key: value[0] for key, value in make_batch(1, 24, 1000, seed=i).items()} | {"index": torch.tensor(i)} for i in range(SAMPLES)]
        self.read: list[int] = []

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        self.read.append(i)
        return self.rows[i]


@pytest.fixture(scope="module")
def nemo() -> SimpleNamespace:
    """NeMo's names, imported from .nemo-packages (as tests/test_nemo.py's fixture does), and the recipe class."""
    nemo_on_path()
    from nemo_automodel.components.config.loader import ConfigNode
    from nemo_automodel.components.datasets.llm.eagle3 import build_eagle3_token_mapping
    from nemo_automodel.components.speculative.eagle import Eagle3TrainerModule
    from nemo_automodel.components.speculative.eagle.registry import resolve_eagle3_draft_spec
    from nemo_automodel.components.speculative.eagle.remote import RemoteEagle3TargetModel
    from nemo_automodel.recipes.llm.train_eagle3 import TrainEagle3Recipe

    class Recipe(TrainEagle3Recipe):
        """NeMo's recipe class, its attributes set by the test; records what each step trains on and stops on cue."""

        def __init__(self, **attributes: object) -> None:
            self.trained: list[list[int]] = []  # the dataset indices of each trained batch, in order
            self.stop_at: int | None = None
            self.drawn_at_stop: list[int] | None = None  # the rows the dataloader had read by the stop
            self.weights_at_stop: dict[str, torch.Tensor] = {}
            for name, value in attributes.items():
                setattr(self, name, value)

        def _forward_batch(self, batch, target_batch=None):
            self.trained.append(batch["index"].tolist())
            return super()._forward_batch(batch, target_batch)

        def save_checkpoint(self, epoch: int, step: int, *args, **kwargs) -> None:
            super().save_checkpoint(epoch, step, *args, **kwargs)
            if step == self.stop_at:
                self.drawn_at_stop = list(self.train_dataloader.dataset.read)
                self.weights_at_stop = {name: p.detach().clone() for name, p in self.draft_model.named_parameters()}
                raise Stopped

    return SimpleNamespace(
        ConfigNode=ConfigNode,
        build_eagle3_token_mapping=build_eagle3_token_mapping,
        Eagle3TrainerModule=Eagle3TrainerModule,
        resolve_eagle3_draft_spec=resolve_eagle3_draft_spec,
        RemoteEagle3TargetModel=RemoteEagle3TargetModel,
        Recipe=Recipe,
    )


@pytest.fixture(scope="module")
def url(cluster, tiny_target) -> str:
    add_service(cluster, tiny_target, SERVICE)
    return f"draftfeed://{cluster.frontend.removeprefix('tcp://')}/{SERVICE}?prefetch_depth={DEPTH}&data_plane=frames"


@pytest.fixture(scope="module", autouse=True)
def drop_in(nemo):
    before = nemo.RemoteEagle3TargetModel.__dict__["from_urls"]
    use_draftfeed()
    try:
        yield
    finally:
        nemo.RemoteEagle3TargetModel.from_urls = before


@pytest.fixture(scope="module")
def template(nemo, tiny_model):
    """The draft every run starts from (the recipe's draft for the tiny target, seeded)."""
    config = tiny_model.config.to_dict() | {
        "draft_vocab_size": DRAFT_VOCAB,
        "target_hidden_size": tiny_model.config.hidden_size,
        "architectures": ["LlamaEagle3DraftModel"],
        "tie_word_embeddings": False,
        "attn_implementation": "eager",
    }
    torch.manual_seed(0)
    draft_class = nemo.resolve_eagle3_draft_spec(tiny_model.config.architectures).draft_cls
    return draft_class(type(tiny_model.config).from_dict(config)).to(dtype=torch.float32)


def recipe_on(
    nemo, url: str, template, output_dir: Path, sampler: str = "ranks", depth: int = DEPTH, every_steps: int | None = STOP, every_epoch: bool = False
):
    """The recipe as its setup() leaves it for a remote target, with the dataloader NeMo's build_eagle3_dataloader
    builds (shuffled): on a rank of a multi-rank run (``sampler="ranks"``) a DistributedSampler, whose order depends only
    on the epoch; in a one-process run (``"one-process"``) a shuffling DataLoader, whose order is drawn from torch's RNG
    when an epoch starts. Step checkpoints every ``every_steps`` steps (ckpt_every_steps) and at each epoch's end if
    ``every_epoch`` (save_checkpoint_every_epoch). The checkpoint, if any, is loaded by the caller."""
    from nemo_automodel.components.training.rng import StatefulRNG

    rng = StatefulRNG(seed=42, ranked=False)  # seeds torch's RNG, as the recipe's setup does
    dataset = Rows()
    by_rank = torch.utils.data.DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True) if sampler == "ranks" else None
    mapping = nemo.build_eagle3_token_mapping(
        [torch.utils.data.default_collate(dataset.rows)], target_vocab_size=1000, draft_vocab_size=DRAFT_VOCAB, special_token_ids=[0]
    )
    checkpoint = {"enabled": True, "checkpoint_dir": str(output_dir), "save_consolidated": False, "model_save_format": "torch_save"}
    recipe = nemo.Recipe(
        cfg=nemo.ConfigNode({"checkpoint": checkpoint}),
        device=torch.device("cpu"),
        dist_env=SimpleNamespace(is_main=True, world_size=1),
        output_dir=output_dir,
        train_dataloader=torch.utils.data.DataLoader(dataset, batch_size=MICRO_BATCH, sampler=by_rank, shuffle=by_rank is None),
        val_dataloader=None,
        tokenizer=None,
        runtime=SimpleNamespace(global_step=0),
        _resume_epoch=0,
        _peagle_partitioned=False,
        grad_accumulation_steps=1,
        max_grad_norm=1.0,
        num_epochs=EPOCHS,
        total_optim_steps=STEPS,
        log_every_steps=10_000,
        ckpt_every_steps=every_steps,
        save_checkpoint_every_epoch=every_epoch,
        rng=rng,
    )
    recipe._setup_remote_target(nemo.ConfigNode({"target_model_backend": "remote", "remote_urls": [url], "remote_timeout": 60}))
    recipe.target_prefetch_depth = depth
    recipe.target_wrapper.set_vocab_mapping(*mapping)
    recipe.draft_model = copy.deepcopy(template)
    recipe.draft_model.copy_embeddings_from_target(recipe.target_wrapper.get_input_embeddings())
    recipe.draft_model.set_vocab_mapping(mapping[0])
    recipe.draft_model.freeze_embeddings()
    recipe.trainer_module = nemo.Eagle3TrainerModule(recipe.draft_model, selected_token_ids=mapping[0], selected_token_mask=mapping[1], ttt_steps=3)
    recipe.optimizer = torch.optim.AdamW([p for p in recipe.trainer_module.parameters() if p.requires_grad], lr=1e-2, betas=(0.9, 0.95))
    recipe.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(recipe.optimizer, lambda step: 1.0 / (1 + step))
    recipe._build_checkpointer(target_path="tiny")
    return recipe


def train(recipe) -> None:
    """The recipe's run_train_validation_loop, less its progress bar and teardown: its epochs from _resume_epoch."""
    try:
        recipe._train_epochs(max(0, int(recipe._resume_epoch)), False)
    finally:
        recipe.target_wrapper.close()


def sampler_order() -> list[list[int]]:
    """The batches (dataset indices) an uninterrupted run trains on, step by step: the DistributedSampler's order."""
    sampler = torch.utils.data.DistributedSampler(range(SAMPLES), num_replicas=1, rank=0, shuffle=True)
    order = []
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        indices = list(sampler)
        order += [indices[i : i + MICRO_BATCH] for i in range(0, SAMPLES, MICRO_BATCH)]
    return order


@pytest.fixture(scope="module")
def uninterrupted(nemo, url, template, tmp_path_factory):
    """uninterrupted(sampler): a run from the first step to the last, with the same checkpoints, never stopped."""
    runs = {}

    def run(sampler: str):
        if sampler not in runs:
            recipe = recipe_on(nemo, url, template, tmp_path_factory.mktemp("uninterrupted"), sampler)
            train(recipe)
            assert recipe.runtime.global_step == STEPS and all(epoch_rows(recipe.trained, e) == list(range(SAMPLES)) for e in range(EPOCHS))
            if sampler == "ranks":
                assert recipe.trained == sampler_order()
            runs[sampler] = recipe
        return runs[sampler]

    return run


def epoch_rows(trained: list[list[int]], epoch: int) -> list[int]:
    """The rows of the batches ``trained`` took in ``epoch`` (its steps), sorted."""
    return sorted(i for batch in trained[epoch * PER_EPOCH : (epoch + 1) * PER_EPOCH] for i in batch)


def stop_and_resume(nemo, url, template, output_dir: Path, stop_at: int, checkpoint: str, **options):
    """A run stopped right after its checkpoint at step ``stop_at``, and a new one that loads ``checkpoint`` (the
    folder the recipe named) and trains on to the step budget: (stopped, resumed)."""
    stopped = recipe_on(nemo, url, template, output_dir, **options)
    stopped.stop_at = stop_at
    with pytest.raises(Stopped):
        train(stopped)
    resumed = recipe_on(nemo, url, template, output_dir, **options)
    resumed.load_checkpoint(str(output_dir / checkpoint))  # what setup() does with checkpoint.restore_from
    restored = {name: p.detach().clone() for name, p in resumed.draft_model.named_parameters()}
    assert [name for name, p in stopped.weights_at_stop.items() if not torch.equal(p, restored[name])] == []
    assert resumed.runtime.global_step == stop_at and resumed.lr_scheduler.last_epoch == stop_at
    train(resumed)
    return stopped, resumed


@pytest.mark.parametrize(
    "sampler, depth", [("ranks", DEPTH), ("ranks", 0), ("one-process", DEPTH)], ids=["ranks-prefetch", "ranks-no-prefetch", "one-process"]
)
def test_a_resume_from_a_step_checkpoint_trains_its_epochs_first_batches_again_and_never_the_last_ones(
    nemo, url, template, uninterrupted, tmp_path, sampler, depth
):
    stopped, resumed = stop_and_resume(nemo, url, template, tmp_path, STOP, f"epoch_0_step_{STOP}", sampler=sampler, depth=depth)
    order = uninterrupted(sampler).trained
    folder = tmp_path / f"epoch_0_step_{STOP}"
    files = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())
    print(f"\n{sampler}, depth {depth}: uninterrupted {order}")
    print(f"stopped {stopped.trained}, rows read by the stop {stopped.drawn_at_stop}; resumed {resumed.trained}; checkpoint {files}")
    meta = torch.load(folder / "eagle_meta.pt")
    assert sorted(meta) == ["epoch", "global_step", "selected_token_ids", "selected_token_mask"] and (meta["epoch"], meta["global_step"]) == (0, STOP)
    assert not [f for f in files if "dataloader" in f]  # nothing of the dataloader is saved
    assert stopped.trained == order[:STOP]
    # the prefetch loop had drawn ``depth`` batches past the step; they are not what the resume loses
    assert stopped.drawn_at_stop == [i for batch in order[: STOP + depth] for i in batch]
    # the resume starts the checkpoint's epoch again, from its first batch, and stops at the step budget: it trains
    # STEPS - STOP batches, a whole epoch 0 and the first PER_EPOCH - STOP of epoch 1
    assert len(resumed.trained) == STEPS - STOP and resumed.runtime.global_step == STEPS
    assert epoch_rows(resumed.trained, 0) == list(range(SAMPLES))
    if sampler == "ranks":  # in the same order as before the stop: the stopped run's batches again, then the rest
        assert resumed.trained == order[: STEPS - STOP]
        print(f"trained twice: {order[:STOP]} (epoch 0's first {STOP}); never: {order[STEPS - STOP :]} (epoch {EPOCHS - 1}'s last {STOP})")
    else:  # in a new order, drawn from the RNG as it was at the checkpoint
        assert resumed.trained[:PER_EPOCH] != order[:PER_EPOCH]


@pytest.mark.parametrize("sampler", ["ranks", "one-process"])
def test_a_resume_from_an_epoch_checkpoint_trains_on_as_if_never_stopped(nemo, url, template, uninterrupted, tmp_path, sampler):
    whole = uninterrupted(sampler)
    options = {"sampler": sampler, "every_steps": None, "every_epoch": True}
    stopped, resumed = stop_and_resume(nemo, url, template, tmp_path, PER_EPOCH, f"epoch_1_step_{PER_EPOCH}", **options)
    assert stopped.trained == whole.trained[:PER_EPOCH]
    assert resumed._resume_epoch == 1 and resumed.trained == whole.trained[PER_EPOCH:]
    final = dict(whole.draft_model.named_parameters())
    differ = [name for name, p in resumed.draft_model.named_parameters() if not torch.equal(p, final[name])]
    assert not differ, f"after the resumed run, the draft's {differ} differ from the uninterrupted run's"
