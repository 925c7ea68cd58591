"""Targets whose decoder layers carry several residual streams (DeepSeek-V4's hyper-connections; issue 47): each task
reads a layer as NeMo AutoModel's own wrapper of that task does (docs/contract.md, "Targets with several residual
streams"), bit for bit at real positions, zeros at padded ones, through a real broker and
worker: DSpark (HFDSparkTargetModel: an intermediate layer's streams folded into their mean, the embedding output and
the post-norm last layer of one stream). EAGLE-3 and DFlash keep a layer's streams as it gives them, as NeMo's
HFEagle3TargetModel and HFDFlashTargetModel do (in process: tests/test_frontier_families.py).

The target: a tiny random-weight DeepSeek-V4 (transformers' DeepseekV4Config; draftfeed.tiny, 6 layers, hidden 64,
2 streams, compressed and sparse attention, hash-routed first layer, 4 experts), loaded through the worker's own path.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from conftest import add_service, make_batch
from reference import difference_at_real, make_packed_batch
from support.nemo import nemo_on_path

from draftfeed import RemoteDSparkTarget
from draftfeed.contract.streams import first_stream, mean_streams

pytestmark = pytest.mark.timeout(240)

LAYERS, HIDDEN, STREAMS = 6, 64, 2
DSPARK_IDS = [-1, 1, 3, 5]  # the embeddings, two intermediate layers, the post-norm last one


@pytest.fixture(scope="module")
def v4_target(tmp_path_factory):
    from draftfeed.tiny import build_tiny_target

    return build_tiny_target(tmp_path_factory.mktemp("v4") / "deepseek-v4", arch="deepseek-v4", num_hidden_layers=LAYERS, hidden_size=HIDDEN)


@pytest.fixture(scope="module")
def v4_model(v4_target):
    # transformers' classes by name: a process that imported NeMo reads deepseek_v4 as NeMo's own config
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    return DeepseekV4ForCausalLM.from_pretrained(v4_target, config=DeepseekV4Config.from_pretrained(v4_target), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def services(cluster, v4_target):
    add_service(cluster, v4_target, "v4-dspark", "--task", "dspark", "--target-layer-ids", ",".join(map(str, DSPARK_IDS)))
    return cluster


@pytest.fixture(scope="module")
def nemo(services) -> SimpleNamespace:
    nemo_on_path()
    from nemo_automodel.components.speculative.dspark.target import HFDSparkTargetModel

    return SimpleNamespace(dspark=HFDSparkTargetModel)


def batches(seed: int) -> list[dict[str, torch.Tensor]]:
    """Two ragged batches."""
    return [make_batch(2, 24, 1000, seed=seed), make_batch(2, 16, 1000, seed=seed + 1)]


def assert_fields_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], real: torch.Tensor) -> None:
    """Each of ``want`` equals ``got``'s field of that name at real positions and ``got`` is zero at padded ones; says
    where and by how much not."""
    problems = [p for name, tensor in want.items() if (p := difference_at_real(name, got[name], tensor, real)) is not None]
    assert not problems, "; ".join(problems)


def nemo_inputs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: batch[k] for k in ("input_ids", "attention_mask", "loss_mask", "position_ids", "seq_lens", "doc_remaining") if k in batch}


def test_the_contract_reads_streams_as_nemo_does():
    layer = torch.randn(2, 3, STREAMS, 4)
    assert torch.equal(mean_streams(layer), layer.mean(dim=2))
    one = torch.randn(2, 3, 4)
    assert mean_streams(one) is one and first_stream(one) is one
    copied = one.unsqueeze(2).expand(-1, -1, STREAMS, -1).contiguous()  # the embedding output, as the model copies it
    assert torch.equal(first_stream(copied), one)


def test_dspark_equals_nemos_wrapper(services, nemo, v4_model):
    wrapper = nemo.dspark(v4_model, DSPARK_IDS)
    with RemoteDSparkTarget(services.frontend, "v4-dspark", prefetch_depth=2) as target:
        for batch, supervision in target.iterate(batches(seed=10)):
            assert supervision.target_hidden_states.shape == (*batch["input_ids"].shape, len(DSPARK_IDS) * HIDDEN)
            want = wrapper.generate_batch(**nemo_inputs(batch))
            got = {"target_hidden_states": supervision.target_hidden_states, "target_last_hidden_states": supervision.target_last_hidden_states}
            assert_fields_equal(got, {name: getattr(want, name) for name in got}, batch["attention_mask"].bool())


def test_packed_rows_are_refused_in_one_line_since_its_compressed_attention_mixes_documents(services):
    """DeepSeek-V4's compressed attention runs over the whole row whatever the block mask says: a document packed after
    another differs from itself alone (by 0.04 on this target), and NeMo's wrapper computes the same mixture. The worker
    finds it out at the first packed batch and fails it in one line, and every packed batch after; unpacked rows go on."""
    from draftfeed import RemoteTargetError

    packed = make_packed_batch([[5, 7], [4, 4, 3]], [2, 3], 1000, seed=3)
    with RemoteDSparkTarget(services.frontend, "v4-dspark", prefetch_depth=1) as target:
        for _ in range(2):
            with pytest.raises(RemoteTargetError, match=r"does not keep packed documents apart .*send unpacked rows for it") as refused:
                target.generate_batch(**packed)
            assert "\n" not in str(refused.value)
        assert target.generate_batch(**make_batch(1, 12, 1000, seed=4)).target_hidden_states.shape[-1] == len(DSPARK_IDS) * HIDDEN
