"""DSpark supervision through the same pipeline, and the target checks at setup for both tasks."""

from __future__ import annotations

import threading

import pytest
import torch
from conftest import WORKER_ENV, add_service, assert_supervision_equal, make_batch, raw_peer, reference_dspark, reference_eagle3

from draftfeed import DSparkTargetInfo, Eagle3TargetInfo, RemoteDSparkTarget, RemoteEagle3Target
from draftfeed.consumers.tasks.dspark import check_target_layer_ids, default_target_layer_ids
from draftfeed.dataplane.frames.codec import pack_tensors
from draftfeed.processes import commands
from draftfeed.schemas.frames import pack, unpack
from draftfeed.schemas.messages import FRONTEND_OUTBOUND, ErrorReply, Hello, Submit

pytestmark = pytest.mark.timeout(240)

DEFAULT = "ds-default"  # ids [1, 3, 4, 6, 7] on the 8-layer target
EDGES = "ds-edges"  # ids -1 (embeddings) and 7 (the final norm)
EAGLE = "eagle"
EDGE_IDS = [-1, 0, 3, 7]


@pytest.fixture(scope="module")
def services(cluster, tiny_target):
    add_service(cluster, tiny_target, DEFAULT, "--task", "dspark")
    add_service(cluster, tiny_target, EDGES, "--task", "dspark", "--target-layer-ids", ",".join(map(str, EDGE_IDS)))
    return add_service(cluster, tiny_target, EAGLE, "--task", "eagle3")


def test_default_ids_spread_over_the_depth():
    assert default_target_layer_ids(6) == [1, 2, 3, 4, 5]
    assert default_target_layer_ids(8) == [1, 3, 4, 6, 7]
    assert default_target_layer_ids(28) == [1, 8, 14, 21, 27]
    assert default_target_layer_ids(32, draft_layers=3) == [1, 16, 31]


@pytest.mark.parametrize(
    "ids, match",
    [
        ([1, 1, 2], "id 1 does not come after 1"),
        ([3, 2], "id 2 does not come after 3"),
        ([-2, 1], "id -2 is out of range for a 8-layer target"),
        ([1, 8], "id 8 is out of range"),
        ([], "at least one layer"),
    ],
)
def test_invalid_ids_say_which_and_why(ids, match):
    with pytest.raises(ValueError, match=match):
        check_target_layer_ids(ids, 8, default=False)


@pytest.mark.parametrize("service, ids", [(DEFAULT, [1, 3, 4, 6, 7]), (EDGES, EDGE_IDS)], ids=["default-ids", "embeddings-and-final-norm"])
def test_dspark_matches_in_process(services, tiny_model, service, ids):
    batches = [make_batch(3, 21, 1000, seed=50 + i) for i in range(3)] + [make_batch(1, 9, 1000, seed=60, ragged=False)]
    with RemoteDSparkTarget(services.frontend, service, prefetch_depth=2) as target:
        info = target.model_info()
        assert isinstance(info, DSparkTargetInfo) and info.target_layer_ids == ids
        for batch, supervision in target.iterate(batches):
            assert supervision.target_hidden_states.shape == (*batch["input_ids"].shape, len(ids) * 64)
            assert_supervision_equal(supervision, reference_dspark(tiny_model, batch, ids))


def test_embedding_endpoints_return_the_exact_weights(services, tiny_model):
    with RemoteDSparkTarget(services.frontend, DEFAULT) as target:
        assert torch.equal(target.get_input_embeddings().weight, tiny_model.get_input_embeddings().weight)
        assert torch.equal(target.get_output_embeddings().weight, tiny_model.get_output_embeddings().weight)
        assert target.get_output_embeddings() is target.get_output_embeddings()


def test_eagle3_and_dspark_services_side_by_side(services, tiny_model):
    outcome: dict[str, list] = {}
    errors: list[BaseException] = []

    def run(name: str, cls, service: str, check) -> None:
        try:
            batches = [make_batch(2, 17, 1000, seed=hash(name) % 1000 + i) for i in range(8)]
            with cls(services.frontend, service, prefetch_depth=3) as target:
                outcome[name] = [(check(b), s) for b, s in target.iterate(batches)]
        except BaseException as exc:
            errors.append(exc)

    threads = [
        threading.Thread(target=run, args=("eagle", RemoteEagle3Target, EAGLE, lambda b: reference_eagle3(tiny_model, b, [1, 3, 4]))),
        threading.Thread(target=run, args=("dspark", RemoteDSparkTarget, DEFAULT, lambda b: reference_dspark(tiny_model, b, [1, 3, 4, 6, 7]))),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(200)
    assert not errors, errors
    for name in ("eagle", "dspark"):
        assert len(outcome[name]) == 8
        for expected, supervision in outcome[name]:
            assert_supervision_equal(supervision, expected)


def test_a_rank_of_the_wrong_task_is_told_so(services):
    with RemoteEagle3Target(services.frontend, DEFAULT, request_timeout=30) as target:
        with pytest.raises(ValueError, match="service 'ds-default' serves dspark supervision; RemoteEagle3Target needs eagle3 supervision"):
            target.model_info()
        with pytest.raises(ValueError, match="serves dspark supervision"):
            target.generate_batch(**make_batch(1, 4, 1000, seed=0))
    # A peer that skips the check is refused by the broker.
    with raw_peer(services.frontend, b"skips-checks") as sock:
        sock.send_multipart(pack(Hello(rank="skips-checks", service=DEFAULT, data_endpoint="tcp://127.0.0.1:9", window=1, host="h", pid=1)))
        sock.send_multipart(pack_tensors(Submit, make_batch(1, 4, 1000, seed=0), request_id=1, kind="eagle3"), copy=False)
        replies = []
        while sock.poll(10_000):
            replies.append(unpack(sock.recv_multipart(), FRONTEND_OUTBOUND)[0])
            if isinstance(replies[-1], ErrorReply):
                break
        assert isinstance(replies[-1], ErrorReply) and replies[-1].request_id == 1
        assert "serves dspark supervision, not eagle3" in replies[-1].message


FIELDS = {"num_hidden_layers": 6, "hidden_size": 32, "vocab_size": 900, "target_layer_ids": [1, 2, 3, 4, 5]}


@pytest.mark.parametrize("field", list(FIELDS))
def test_check_target_info_names_each_mismatched_field(services, field):
    with RemoteDSparkTarget(services.frontend, DEFAULT) as target:
        good = DSparkTargetInfo(num_hidden_layers=8, hidden_size=64, vocab_size=1000, target_layer_ids=[1, 3, 4, 6, 7])
        target.check_target_info(good)
        with pytest.raises(ValueError) as caught:
            target.check_target_info(good.model_copy(update={field: FIELDS[field]}))
    message = str(caught.value)
    assert f"service '{DEFAULT}' (workers {DEFAULT}-0)" in message
    assert f"{field}: expected {FIELDS[field]!r}, served" in message
    assert message.count(": expected") == 1  # only that field


def test_eagle3_check_target_info(services):
    with RemoteEagle3Target(services.frontend, EAGLE) as target:
        target.check_target_info(Eagle3TargetInfo(num_hidden_layers=8, hidden_size=64, vocab_size=1000, aux_layer_ids=[1, 3, 4]))
        with pytest.raises(ValueError, match=r"aux_layer_ids: expected \[0, 3, 4\], served \[1, 3, 4\]"):
            target.check_target_info(Eagle3TargetInfo(num_hidden_layers=8, hidden_size=64, vocab_size=1000, aux_layer_ids=[0, 3, 4]))


def test_from_text_config_reads_the_text_config_of_a_multimodal_target(tmp_path):
    from transformers import AutoConfig

    from draftfeed.tiny import build_tiny_target

    path = build_tiny_target(tmp_path / "mm", arch="gemma3-multimodal", num_hidden_layers=6)
    info = DSparkTargetInfo.from_text_config(AutoConfig.from_pretrained(path), [1, 2, 3, 4, 5])
    assert (info.num_hidden_layers, info.hidden_size, info.vocab_size) == (6, 64, 1000)
    eagle = Eagle3TargetInfo.from_text_config(AutoConfig.from_pretrained(path).text_config, [0, 2, 4])
    assert eagle.num_hidden_layers == 6 and eagle.aux_layer_ids == [0, 2, 4]


def test_multimodal_target_serves_exact_dspark_supervision(cluster, tmp_path):
    from transformers import AutoModelForCausalLM

    from draftfeed.tiny import build_tiny_target

    path = build_tiny_target(tmp_path / "gemma3", arch="gemma3-multimodal", num_hidden_layers=6)
    cluster.add_worker(path, "--task", "dspark", "--service", "gemma3-ds", "--target-layer-ids", "-1,2,5")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    batch = make_batch(2, 12, 1000, seed=3)
    with RemoteDSparkTarget(cluster.frontend, "gemma3-ds") as target:
        assert_supervision_equal(target.generate_batch(**batch), reference_dspark(model, batch, [-1, 2, 5]))


@pytest.mark.parametrize(
    "field, arch_args, worker_args",
    [
        ("num_hidden_layers", {"num_hidden_layers": 10}, ["--target-layer-ids", "1,3,4,6,7"]),
        ("hidden_size", {"hidden_size": 32}, []),
        ("vocab_size", {"vocab_size": 900}, []),
        ("target_layer_ids", {}, ["--target-layer-ids", "1,2,3"]),
    ],
)
def test_a_later_worker_of_another_target_is_refused(services, tmp_path, tiny_target, field, arch_args, worker_args):
    from draftfeed.tiny import build_tiny_target

    with RemoteDSparkTarget(services.frontend, DEFAULT) as target:
        target.check_target_info(DSparkTargetInfo(num_hidden_layers=8, hidden_size=64, vocab_size=1000, target_layer_ids=[1, 3, 4, 6, 7]))
        other = build_tiny_target(tmp_path / "other", **arch_args) if arch_args else tiny_target
        with pytest.raises(
            RuntimeError, match=rf"refused registration: worker \S+ on \S+ serves another target than service '{DEFAULT}': {field}: worker has"
        ):
            commands.start_worker(services.backend, str(other), "--task", "dspark", "--service", DEFAULT, *worker_args, env=WORKER_ENV)
        status = target.status()
    assert [w["worker"] for w in status["services"][DEFAULT]["workers"]] == [f"{DEFAULT}-0"]
    assert status["counters"]["workers_refused"] >= 1
