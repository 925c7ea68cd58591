"""Packed rows (several documents a row, NeMo's seq_lens / position_ids / doc_remaining) and long rows (the
vocab-sized step in chunks, --chunk-tokens; --max-seq-len), through real broker and worker processes."""

from __future__ import annotations

import pytest
import torch
from conftest import add_service, assert_supervision_equal, make_batch, reference_dspark, reference_eagle3
from reference import make_packed_batch

from draftfeed import RemoteDSparkTarget, RemoteEagle3Target
from draftfeed.consumers.engines.hf import HFEngine
from draftfeed.consumers.tasks.eagle3 import Eagle3Task
from draftfeed.consumers.validation import validate_batch
from draftfeed.contract.packing import check_packing
from draftfeed.schemas.errors import BadRequest, RemoteTargetError

pytestmark = pytest.mark.timeout(240)

EAGLE = "packed-eagle3"
DSPARK = "packed-dspark"
CHUNK_TOKENS = 128  # the packed batches below fit one chunk; the long ones do not
MAX_SEQ_LEN = 100
AUX = [1, 3, 4]  # the default aux layers of the 8-layer tiny target
DSPARK_IDS = [1, 3, 4, 6, 7]  # its default DSpark target layers


@pytest.fixture(scope="module")
def services(cluster, tiny_target):
    add_service(cluster, tiny_target, EAGLE, "--chunk-tokens", str(CHUNK_TOKENS), "--max-seq-len", str(MAX_SEQ_LEN))
    return add_service(cluster, tiny_target, DSPARK, "--task", "dspark")


def packed(seed: int) -> dict[str, torch.Tensor]:
    """Two rows of 40: three documents and 3 padding tokens; one document the whole row."""
    return make_packed_batch([[12, 9, 16], [40]], pad=[3, 0], vocab_size=1000, seed=seed)


# ---------------------------------------------------------------- the contract's checks, both sides
@pytest.mark.parametrize(
    "change, message",
    [
        (lambda b: b["seq_lens"].__setitem__((0, 0), 11), r"seq_lens row 0 sums to 39, not the row's 40 tokens"),
        (
            lambda b: b["seq_lens"].__setitem__((0, slice(0, 2)), torch.tensor([-1, 22])),
            r"seq_lens\[0, 0\] is -1: a document's length cannot be negative",
        ),
        (lambda b: b["position_ids"].__setitem__((0, 12), 12), r"position_ids\[0, 12\] is 12 but seq_lens \[12, 9, 19\] put position 12 at 0"),
        (lambda b: b.__setitem__("seq_lens", b["seq_lens"][:1]), r"seq_lens has shape \[1, 3\]; it must be \[batch, max_docs\] = \[2, D\]"),
        (lambda b: b.__setitem__("seq_lens", None), r"position_ids restart inside a row but no seq_lens came with them"),
        (lambda b: b.__setitem__("position_ids", b["position_ids"].float()), r"position_ids must be int64, got torch.float32"),
    ],
    ids=["sum", "negative", "positions", "shape", "positions-alone", "dtype"],
)
def test_a_packed_batch_that_does_not_add_up_is_refused_saying_what_is_wrong(change, message):
    batch = packed(seed=1)
    change(batch)
    with pytest.raises(BadRequest, match=message):
        check_packing(batch["attention_mask"], batch["position_ids"], batch["seq_lens"], batch["doc_remaining"])
    sent = {k: batch[k] for k in ("input_ids", "attention_mask", "loss_mask", "position_ids", "seq_lens") if batch[k] is not None}
    with pytest.raises(BadRequest, match=message):  # the worker's check is the same
        validate_batch(sent, 1000)


def test_plain_position_ids_alone_are_an_unpacked_batch():
    batch = make_batch(2, 16, 1000, seed=3)
    assert check_packing(batch["attention_mask"], torch.arange(16).expand(2, 16), None) is None


def test_a_rank_refuses_a_bad_packed_batch_before_sending_it(services):
    batch = packed(seed=2)
    batch["seq_lens"][1, 0] = 41
    with RemoteEagle3Target(services.frontend, EAGLE) as target:
        with pytest.raises(ValueError, match=r"generate_batch: seq_lens row 1 sums to 41"):
            target.generate_batch(**batch)


# ---------------------------------------------------------------- exactness
def test_packed_eagle3_equals_the_in_process_block_causal_computation(services, tiny_model):
    with RemoteEagle3Target(services.frontend, EAGLE) as target:
        for seed in (10, 11):
            batch = packed(seed)
            supervision = target.generate_batch(**batch)
            assert_supervision_equal(supervision, reference_eagle3(tiny_model, batch, AUX))
        through_iterate = [s for _b, s in target.iterate(packed(seed) for seed in (12, 13))]
        for seed, supervision in zip((12, 13), through_iterate):
            assert_supervision_equal(supervision, reference_eagle3(tiny_model, packed(seed), AUX))


def test_packed_dspark_equals_the_in_process_block_causal_computation(services, tiny_model):
    with RemoteDSparkTarget(services.frontend, DSPARK) as target:
        batch = packed(seed=20)
        assert_supervision_equal(target.generate_batch(**batch), reference_dspark(tiny_model, batch, DSPARK_IDS))


@torch.no_grad()
def test_each_document_of_a_packed_row_equals_it_run_alone(services, tiny_model):
    """Within float tolerance: alone, a document's attention runs over fewer keys, summed in another order."""
    batch = packed(seed=30)
    with RemoteEagle3Target(services.frontend, EAGLE) as target:
        got = target.generate_batch(**batch)
    worst = 0.0
    start = 0
    for length in [12, 9, 16]:
        alone = {
            "input_ids": batch["input_ids"][:1, start : start + length],
            "attention_mask": torch.ones(1, length, dtype=torch.int64),
            "loss_mask": torch.ones(1, length, dtype=torch.int64),
        }
        expected = reference_eagle3(tiny_model, alone, AUX)["aux_hidden_states"][0]
        gap = (got.aux_hidden_states[0, start : start + length] - expected).abs().max().item()
        worst = max(worst, gap)
        start += length
    print(f"largest |difference| of a packed document's aux hidden states from the document alone: {worst:.3g}")
    assert worst < 1e-5


def test_an_unpacked_batch_is_computed_as_before_and_carries_no_packing_fields(services, tiny_model):
    batch = make_batch(2, 24, 1000, seed=40)
    with RemoteEagle3Target(services.frontend, EAGLE) as target:
        supervision = target.generate_batch(**batch)
    assert supervision.position_ids is None and supervision.seq_lens is None and supervision.doc_remaining is None
    assert_supervision_equal(supervision, reference_eagle3(tiny_model, batch, AUX))


# ---------------------------------------------------------------- long rows
def test_a_row_over_max_seq_len_is_refused_naming_both_numbers(services):
    with RemoteEagle3Target(services.frontend, EAGLE) as target:
        with pytest.raises(RemoteTargetError, match=rf"rows of 101 positions; the target of service '{EAGLE}' takes at most {MAX_SEQ_LEN}"):
            target.generate_batch(**make_batch(1, MAX_SEQ_LEN + 1, 1000, seed=50, ragged=False))


def test_a_batch_over_chunk_tokens_equals_the_whole_computation_within_tolerance(services, tiny_model):
    batch = make_batch(2, MAX_SEQ_LEN, 1000, seed=60)  # 200 positions: two chunks of 128 and 72
    with RemoteEagle3Target(services.frontend, EAGLE) as target:
        got = target.generate_batch(**batch).as_dict()
    expected = reference_eagle3(tiny_model, batch, AUX)
    assert torch.equal(got["aux_hidden_states"], expected["aux_hidden_states"])  # the forward is not chunked
    gap = (got["target_probs"] - expected["target_probs"]).abs().max().item()
    print(f"largest |difference| of chunked target_probs from the whole computation: {gap:.3g}")
    assert gap < 1e-6
    assert torch.equal(got["position_mask"], expected["position_mask"])


@pytest.fixture(scope="module")
def hf_engine(tiny_target):
    return HFEngine(str(tiny_target))


@pytest.mark.parametrize("form", ["probs", "hidden", "probs-bf16"])
def test_chunked_supervision_in_process_every_form(hf_engine, form):
    """The task itself: one chunk covering the batch is the whole computation bit for bit; smaller chunks are within
    tolerance (the probabilities) or equal (the argmax and position mask), packed rows included."""
    whole = Eagle3Task(hf_engine, AUX, form)  # type: ignore[arg-type]
    one_chunk = Eagle3Task(hf_engine, AUX, form, chunk_tokens=80)  # type: ignore[arg-type]
    chunked = Eagle3Task(hf_engine, AUX, form, chunk_tokens=7)  # type: ignore[arg-type]
    batch = packed(seed=70)
    documents = check_packing(batch["attention_mask"], batch["position_ids"], batch["seq_lens"])
    args = (batch["input_ids"], batch["attention_mask"], batch["loss_mask"], None, documents)
    expected, same, small = whole.compute(*args), one_chunk.compute(*args), chunked.compute(*args)
    assert set(expected) == set(same) == set(small)
    for name in expected:
        assert torch.equal(same[name], expected[name]), name
        if small[name].is_floating_point():
            gap = (small[name].float() - expected[name].float()).abs().max().item()
            bound = 1e-6 if small[name].dtype == torch.float32 else 2**-8  # bfloat16: one rounding step at 1
            assert gap <= bound, f"{name}: largest |difference| {gap:.3g}"
        else:
            assert torch.equal(small[name], expected[name]), name


def test_the_flash_attention_path_packs_by_position_ids_alone(tiny_target):
    """A FlashAttention target takes no 4D mask: each row runs alone and transformers finds its documents from where
    its position ids restart. Run here through SDPA, which packs the same way; equal to the mask path within tolerance."""
    from draftfeed.consumers.engines.base import Capture

    engine = HFEngine(str(tiny_target))
    batch = packed(seed=80)
    documents = check_packing(batch["attention_mask"], batch["position_ids"], batch["seq_lens"])
    capture = Capture(layer_ids=tuple(AUX), final_hidden=True, logits=True)
    by_mask = engine.forward(batch["input_ids"], batch["attention_mask"], capture, documents)
    engine.force_position_id_packing = True
    by_positions = engine.forward(batch["input_ids"], batch["attention_mask"], capture, documents)
    real = batch["attention_mask"].bool()
    for name, got, expected in [("final_hidden", by_positions.final_hidden, by_mask.final_hidden), ("logits", by_positions.logits, by_mask.logits)]:
        gap = (got - expected)[real].abs().max().item()
        assert gap < 1e-5, f"{name}: largest |difference| at real positions {gap:.3g}"
    inside = batch["attention_mask"].clone()
    inside[0, 5] = 0  # padding in the middle of the first document
    with pytest.raises(BadRequest, match="row 0: padding inside a document"):
        engine.forward(batch["input_ids"], inside, capture, documents)


def test_dspark_rows_over_the_targets_positions_are_refused_and_the_worker_checks_too(services, tiny_target):
    from transformers import AutoConfig

    limit = AutoConfig.from_pretrained(tiny_target).max_position_embeddings
    with RemoteDSparkTarget(services.frontend, DSPARK) as target:
        with pytest.raises(RemoteTargetError, match=rf"rows of {limit + 1} positions; the target of service '{DSPARK}' takes at most {limit}"):
            target.generate_batch(**make_batch(1, limit + 1, 1000, seed=90, ragged=False))
    # The worker refuses by itself what a broker that does not know its limit would pass on.
    batch = make_batch(1, 65, 1000, seed=91, ragged=False)
    with pytest.raises(BadRequest, match=r"rows of 65 positions are over this worker's limit of 64 \(--max-seq-len"):
        validate_batch(batch, 1000, max_seq_len=64)
