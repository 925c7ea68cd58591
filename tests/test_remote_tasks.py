"""DFlash (and JetSpec's logits), EAGLE-1/2 and ViSpec through a real broker and workers: each rank-side client's
supervision equals NeMo AutoModel's own in-process wrapper of that task (HFDFlashTargetModel, HFEagleTargetModel,
HFVispecTargetModel) bit for bit at real positions, with zeros at padded ones (the project's rule; NeMo leaves
whatever the target computed there), packed rows included where the wrapper takes them, in both forms (the logits
as sent, and the compact form whose logits the rank rebuilds); a rank or a submit of the wrong task is refused; each
task's supervision is recorded and replayed bit for bit.

NeMo is imported from .nemo-packages as tests/test_nemo.py does (after the workers have started).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import add_service, make_batch, raw_peer
from reference import difference, difference_at_real, make_packed_batch, shift_left
from support.images import IMAGE, gemma_batch
from support.nemo import nemo_on_path

from draftfeed import (
    DFlashSupervision,
    DFlashTargetInfo,
    EagleSupervision,
    RemoteDFlashTarget,
    RemoteEagleTarget,
    RemoteVispecTarget,
    VispecSupervision,
)
from draftfeed.dataplane.frames.codec import pack_tensors
from draftfeed.schemas.frames import pack, unpack
from draftfeed.schemas.messages import FRONTEND_OUTBOUND, ErrorReply, Hello, Submit
from draftfeed.store.inspect import info_lines

pytestmark = pytest.mark.timeout(240)

LAYER_IDS = [1, 4, 7]  # of the tiny target's 8 decoder layers
DFLASH = {"dflash": False, "dflash-logits": True, "dflash-hidden": True}  # service -> capture_logits
EAGLE = ["eagle-logits", "eagle-hidden"]
VISPEC = ["vispec-logits", "vispec-hidden"]
# The fields each task shifts left by one: their real positions are those whose next position is real.
SHIFTED = {"target_hidden_states", "target_logits", "inputs_embeds"}


@pytest.fixture(scope="module")
def vispec_target(tmp_path_factory) -> Path:
    """Gemma 3's image-text model: its own logits are soft-capped, ViSpec's (lm_head raw) are not."""
    from draftfeed.tiny import build_tiny_target

    return build_tiny_target(tmp_path_factory.mktemp("vispec") / "gemma3", arch="gemma3-multimodal", num_hidden_layers=4)


@pytest.fixture(scope="module")
def vispec_model(vispec_target):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(vispec_target, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def services(cluster, tiny_target, vispec_target):
    ids = ("--target-layer-ids", ",".join(map(str, LAYER_IDS)))
    add_service(cluster, tiny_target, "dflash", "--task", "dflash", *ids)
    add_service(cluster, tiny_target, "dflash-logits", "--task", "dflash", *ids, "--capture-logits")
    add_service(cluster, tiny_target, "dflash-hidden", "--task", "dflash", *ids, "--capture-logits", "--supervision", "hidden")
    add_service(cluster, tiny_target, "eagle-logits", "--task", "eagle")
    add_service(cluster, tiny_target, "eagle-hidden", "--task", "eagle", "--supervision", "hidden")
    add_service(cluster, vispec_target, "vispec-logits", "--task", "vispec")
    add_service(cluster, vispec_target, "vispec-hidden", "--task", "vispec", "--supervision", "hidden")
    return cluster


@pytest.fixture(scope="module")
def nemo(services) -> SimpleNamespace:
    """NeMo's three target wrappers and their batch dataclasses, imported once the workers run."""
    nemo_on_path()
    from nemo_automodel.components.speculative.dflash.target import DFlashTargetBatch, HFDFlashTargetModel
    from nemo_automodel.components.speculative.eagle.target_v12 import EagleTargetBatch, HFEagleTargetModel
    from nemo_automodel.components.speculative.eagle.vispec_target import HFVispecTargetModel, VispecTargetBatch

    return SimpleNamespace(
        DFlashTargetBatch=DFlashTargetBatch,
        HFDFlashTargetModel=HFDFlashTargetModel,
        EagleTargetBatch=EagleTargetBatch,
        HFEagleTargetModel=HFEagleTargetModel,
        VispecTargetBatch=VispecTargetBatch,
        HFVispecTargetModel=HFVispecTargetModel,
    )


def text_batches(seed: int) -> list[dict[str, torch.Tensor]]:
    """Two ragged batches and one of packed rows (two and three documents, then padding)."""
    return [
        make_batch(3, 19, 1000, seed=seed),
        make_batch(2, 11, 1000, seed=seed + 1),
        make_packed_batch([[5, 7], [4, 4, 3]], [2, 3], 1000, seed=seed + 2),
    ]


def image_batches(model, seed: int) -> list[dict[str, torch.Tensor]]:
    """Rows of text and one or two images each (Gemma 3's layout), padded."""
    return [gemma_batch(model.config, layout, seed + i) for i, layout in enumerate([[1, 2], [2], [1]])]


def assert_equals_nemo(supervision, expected, attention_mask: torch.Tensor) -> None:
    """Every field of NeMo's batch ``expected`` equals the supervision's of that name: bit for bit at real positions,
    zero at padded ones (for a shifted field, a position whose next one is padding). Says where and by how much not."""
    real = attention_mask.bool()
    problems = []
    for field in dataclasses.fields(expected):
        want, got = getattr(expected, field.name), getattr(supervision, field.name)
        if want is None or got is None:
            if (want is None) != (got is None):
                problems.append(f"{field.name}: got {type(got).__name__}, NeMo {type(want).__name__}")
            continue
        if want.is_floating_point():
            problem = difference_at_real(field.name, got, want, shift_left(real) if field.name in SHIFTED else real)
        else:
            problem = difference(field.name, got, want)
        if problem is not None:
            problems.append(problem)
    assert not problems, "; ".join(problems)


def test_the_fields_are_nemos(nemo):
    for ours, theirs in (
        (DFlashSupervision, nemo.DFlashTargetBatch),
        (EagleSupervision, nemo.EagleTargetBatch),
        (VispecSupervision, nemo.VispecTargetBatch),
    ):
        assert [f.name for f in dataclasses.fields(ours)] == [f.name for f in dataclasses.fields(theirs)]


@pytest.mark.parametrize("service", list(DFLASH))
def test_dflash_equals_nemos_wrapper(services, nemo, tiny_model, service):
    capture = DFLASH[service]
    wrapper = nemo.HFDFlashTargetModel(tiny_model, LAYER_IDS, capture_logits=capture)
    with RemoteDFlashTarget(services.frontend, service, prefetch_depth=2) as target:
        assert target.target_layer_ids == LAYER_IDS and target.capture_logits is capture
        for batch, supervision in target.iterate(text_batches(seed=10)):
            assert supervision.hidden_states.shape == (*batch["input_ids"].shape, len(LAYER_IDS) * 64)
            assert (supervision.logits is not None) is capture
            assert_equals_nemo(supervision, wrapper.generate_batch(**batch), batch["attention_mask"])


@pytest.mark.parametrize("service", EAGLE)
def test_eagle_equals_nemos_wrapper(services, nemo, tiny_model, service):
    wrapper = nemo.HFEagleTargetModel(tiny_model)
    with RemoteEagleTarget(services.frontend, service, prefetch_depth=2) as target:
        for batch, supervision in target.iterate(text_batches(seed=20)):
            assert supervision.target_logits.shape == (*batch["input_ids"].shape, 1000)
            assert_equals_nemo(supervision, wrapper.generate_batch(**batch), batch["attention_mask"])


@pytest.mark.parametrize("service", VISPEC)
def test_vispec_equals_nemos_wrapper(services, nemo, vispec_model, service):
    wrapper = nemo.HFVispecTargetModel(vispec_model, image_token_id=IMAGE)
    with RemoteVispecTarget(services.frontend, service, prefetch_depth=2) as target:
        assert target.image_token_id == IMAGE
        for batch, supervision in target.iterate(image_batches(vispec_model, seed=30)):
            assert bool(supervision.image_mask.any())
            assert_equals_nemo(supervision, wrapper.generate_batch(**batch), batch["attention_mask"])


@pytest.mark.parametrize(
    "cls, field, services_",
    [
        (RemoteDFlashTarget, "logits", ("dflash-logits", "dflash-hidden")),
        (RemoteEagleTarget, "target_logits", tuple(EAGLE)),
        (RemoteVispecTarget, "target_logits", tuple(VISPEC)),
    ],
    ids=["dflash", "eagle", "vispec"],
)
def test_the_compact_forms_logits_equal_the_logits_sent(services, vispec_model, cls, field, services_):
    """The rank's rebuild (lm_head weight fetched once) against the worker's logits: torch.equal on the CPU in float32."""
    batches = image_batches(vispec_model, seed=40) if cls is RemoteVispecTarget else text_batches(seed=40)
    answers = {}
    for service in services_:
        with cls(services.frontend, service, prefetch_depth=2) as target:
            answers[service] = [getattr(supervision, field) for _, supervision in target.iterate(batches)]
    for index, (sent, rebuilt) in enumerate(zip(*answers.values())):
        gap = (sent.double() - rebuilt.double()).abs().max().item()
        assert torch.equal(sent, rebuilt), f"batch {index}: the rebuilt {field} differ from those sent by up to {gap:.3g}"


@pytest.mark.parametrize("cls, service", [(RemoteEagleTarget, "eagle-hidden"), (RemoteVispecTarget, "vispec-logits")])
def test_get_lm_head_is_the_targets_frozen_output_embedding(services, tiny_model, vispec_model, cls, service):
    model = vispec_model if cls is RemoteVispecTarget else tiny_model
    with cls(services.frontend, service) as target:
        head = target.get_lm_head()
        assert isinstance(head, torch.nn.Linear) and head.bias is None and not head.weight.requires_grad
        assert torch.equal(head.weight, model.lm_head.weight)
        assert head is target.get_lm_head() and head.weight is target.get_output_embeddings().weight  # fetched once


def test_check_target_info_names_capture_logits(services):
    with RemoteDFlashTarget(services.frontend, "dflash-logits") as target:
        good = DFlashTargetInfo(num_hidden_layers=8, hidden_size=64, vocab_size=1000, target_layer_ids=LAYER_IDS, capture_logits=True)
        target.check_target_info(good)
        with pytest.raises(ValueError, match=r"capture_logits: expected False, served True"):
            target.check_target_info(good.model_copy(update={"capture_logits": False}))


@pytest.mark.parametrize(
    "cls, service, served",
    [(RemoteDFlashTarget, "eagle-logits", "eagle"), (RemoteEagleTarget, "vispec-logits", "vispec"), (RemoteVispecTarget, "dflash", "dflash")],
)
def test_a_rank_of_the_wrong_task_is_refused_at_model_info(services, cls, service, served):
    with cls(services.frontend, service, request_timeout=30) as target:
        with pytest.raises(ValueError, match=rf"service '{service}' serves {served} supervision; {cls.__name__} needs {cls.TASK} supervision"):
            target.model_info()


@pytest.mark.parametrize("kind, service", [("dflash", "eagle-logits"), ("eagle", "vispec-hidden"), ("vispec", "dflash-hidden")])
def test_the_broker_refuses_a_submit_of_the_wrong_task(services, kind, service):
    identity = f"skips-checks-{kind}".encode()
    with raw_peer(services.frontend, identity) as sock:
        hello = Hello(rank=identity.decode(), service=service, data_endpoint="tcp://127.0.0.1:9", window=1, host="h", pid=1, task=kind)
        sock.send_multipart(pack(hello))
        sock.send_multipart(pack_tensors(Submit, make_batch(1, 4, 1000, seed=0), request_id=1, kind=kind), copy=False)
        replies = []
        while sock.poll(10_000):
            replies.append(unpack(sock.recv_multipart(), FRONTEND_OUTBOUND)[0])
            if isinstance(replies[-1], ErrorReply):
                break
    assert replies and isinstance(replies[-1], ErrorReply) and replies[-1].request_id == 1
    served = service.split("-")[0]
    assert f"serves {served} supervision, not {kind}" in replies[-1].message


def test_vispec_refuses_packed_rows_in_one_line(services):
    with RemoteVispecTarget(services.frontend, "vispec-logits") as target:
        with pytest.raises(ValueError) as refused:
            target.generate_batch(**make_packed_batch([[5, 7]], [2], 1000, seed=0))
        assert str(refused.value).startswith("RemoteVispecTarget.generate_batch: ViSpec takes no packed rows (seq_lens)")
        assert "\n" not in str(refused.value) and target.in_flight == 0


# What ``draftfeed store info`` says of each recorded service's form.
FORM_LINES = {
    "dflash-hidden": "form: hidden",
    "dflash": "form: layer hidden states, no logits (the one form of DFlash without capture_logits)",
    "eagle-hidden": "form: hidden",
    "vispec-logits": "form: logits",
}


@pytest.mark.parametrize(
    "cls, service",
    [
        (RemoteDFlashTarget, "dflash-hidden"),
        (RemoteDFlashTarget, "dflash"),
        (RemoteEagleTarget, "eagle-hidden"),
        (RemoteVispecTarget, "vispec-logits"),
    ],
)
def test_record_then_replay_is_bit_for_bit(services, vispec_model, tmp_path, cls, service):
    batches = image_batches(vispec_model, seed=50) if cls is RemoteVispecTarget else text_batches(seed=50)
    with cls(services.frontend, service, prefetch_depth=2, store=tmp_path, store_mode="record") as target:
        live = [{name: t.clone() for name, t in supervision.as_dict().items()} for _, supervision in target.iterate(batches)]
    info = info_lines(tmp_path)
    assert f"task: {cls.TASK}" in info and FORM_LINES[service] in info, info
    with cls(None, service, prefetch_depth=2, store=tmp_path, store_mode="replay") as replay:
        for index, (_, supervision) in enumerate(replay.iterate(batches)):
            got = supervision.as_dict()
            assert set(got) == set(live[index]), f"batch {index}: fields {sorted(got)}, recorded {sorted(live[index])}"
            problems = [p for name, t in live[index].items() if (p := difference(name, got[name], t)) is not None]
            assert not problems, f"replayed batch {index}: " + "; ".join(problems)
