"""The other forms of EAGLE-3 supervision: compact (final hidden state + argmax) and bfloat16 probabilities."""

from __future__ import annotations

import pytest
import torch
from conftest import add_service, assert_supervision_equal, make_batch, reference_eagle3
from reference import draft_vocab

from draftfeed import RemoteEagle3Target

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def services(cluster, tiny_target, tmp_path_factory):
    from draftfeed.tiny import build_tiny_target

    gemma = build_tiny_target(tmp_path_factory.mktemp("gemma") / "gemma3", arch="gemma3", num_hidden_layers=6)
    multimodal = build_tiny_target(tmp_path_factory.mktemp("gemma") / "gemma3-mm", arch="gemma3-multimodal", num_hidden_layers=6)
    add_service(cluster, tiny_target, "hidden", "--supervision", "hidden")
    add_service(cluster, tiny_target, "bf16", "--supervision", "probs-bf16")
    add_service(cluster, gemma, "gemma-hidden", "--supervision", "hidden", "--aux-layer-ids", "0,2,4")
    add_service(cluster, multimodal, "mm-hidden", "--supervision", "hidden", "--aux-layer-ids", "0,2,4")
    cluster.gemma, cluster.multimodal = gemma, multimodal
    return cluster


def test_compact_form_with_the_identity_mapping_is_bit_identical(services, tiny_model):
    batches = [make_batch(3, 25, 1000, seed=70 + i) for i in range(3)]
    with RemoteEagle3Target(services.frontend, "hidden") as target:
        for batch, supervision in target.iterate(batches):
            assert_supervision_equal(supervision, reference_eagle3(tiny_model, batch, [1, 3, 4]))


def test_compact_form_with_a_draft_vocab_is_within_float_tolerance(services, tiny_model):
    ids, mask = draft_vocab(128)
    batches = [make_batch(2, 30, 1000, seed=80 + i) for i in range(3)]
    worst = 0.0
    with RemoteEagle3Target(services.frontend, "hidden") as target:
        target.set_vocab_mapping(ids, mask)
        for batch, supervision in target.iterate(batches):
            expected = reference_eagle3(tiny_model, batch, [1, 3, 4], ids, mask)
            for name in ("aux_hidden_states", "position_mask", "input_ids", "loss_mask", "attention_mask"):
                assert torch.equal(supervision.as_dict()[name], expected[name]), name
            assert supervision.target_probs.dtype == torch.float32 and supervision.target_probs.shape == expected["target_probs"].shape
            worst = max(worst, (supervision.target_probs - expected["target_probs"]).abs().max().item())
    print(f"compact form, draft vocab 128 of 1000: max |target_probs - reference| = {worst:.3g}")
    assert worst <= 1e-6


@pytest.mark.parametrize("service, attr", [("gemma-hidden", "gemma"), ("mm-hidden", "multimodal")], ids=["soft-capped", "multimodal"])
def test_compact_form_reproduces_the_targets_own_logits(services, service, attr):
    """Gemma's text model soft-caps its logits; the multimodal class (in this transformers) names the
    soft-cap in its config but does not apply it. Either way the rank must rebuild what the target computes."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(getattr(services, attr), dtype=torch.float32).eval()
    assert model.config.get_text_config().final_logit_softcapping == 30.0
    batch = make_batch(2, 14, 1000, seed=5)
    with RemoteEagle3Target(services.frontend, service) as target:
        supervision = target.generate_batch(**batch)
    assert_supervision_equal(supervision, reference_eagle3(model, batch, [0, 2, 4]))


def test_bfloat16_probs_are_lossy_within_bfloat16_precision(services, tiny_model):
    ids, mask = draft_vocab(256)
    batch = make_batch(2, 20, 1000, seed=90)
    with RemoteEagle3Target(services.frontend, "bf16") as target:
        target.set_vocab_mapping(ids, mask)
        supervision = target.generate_batch(**batch)
    expected = reference_eagle3(tiny_model, batch, [1, 3, 4], ids, mask)
    assert supervision.target_probs.dtype == torch.float32
    assert torch.equal(supervision.aux_hidden_states, expected["aux_hidden_states"])
    assert torch.equal(supervision.position_mask, expected["position_mask"])
    assert torch.equal(supervision.target_probs, expected["target_probs"].to(torch.bfloat16).float())
    relative = ((supervision.target_probs - expected["target_probs"]).abs() / expected["target_probs"]).max().item()
    print(f"bfloat16 probs: max relative error {relative:.3g}")
    assert relative <= 2**-8
