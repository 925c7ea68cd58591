"""Ordinary mistakes get one line that says what is wrong and what to change, fast, and no traceback (issue 15).

Each case runs the real command line (or a real rank) against real broker and worker processes, and checks the
exact message and the exit code: 2 for a usage error, 1 for a process that cannot serve.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from conftest import WORKER_ENV, Cluster, assert_supervision_equal, make_batch, reference_eagle3
from reference import draft_vocab
from support import preload
from support.lines import wait_for_line

from draftfeed import RemoteEagle3Target, RemoteTargetError
from draftfeed.processes import commands

pytestmark = pytest.mark.timeout(180)
SERVICE = "mistakes"


def draftfeed_cli(*args: str, env: dict[str, str] | None = None, timeout_s: float = 120) -> subprocess.CompletedProcess:
    """``python -m draftfeed ARGS`` to its end (forked from the suite's preloader: tests/support/preload.py)."""
    return preload.run_module("draftfeed", args, {**os.environ, **WORKER_ENV, **(env or {})}, timeout_s)


def one_line(result: subprocess.CompletedProcess, code: int, *fragments: str) -> None:
    """The command failed with ``code``, no traceback, and its last line of stderr holds every fragment."""
    assert result.returncode == code, f"exit {result.returncode}:\n{result.stdout}\n{result.stderr}"
    assert "Traceback" not in result.stderr and "Traceback" not in result.stdout, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    for fragment in fragments:
        assert fragment in last, f"{fragment!r} not in {last!r}"


@pytest.fixture(scope="module")
def cluster_with_worker(tiny_target):
    cluster = Cluster()
    try:
        cluster.add_worker(tiny_target, "--service", SERVICE, "--name", "mistakes-0")
        yield cluster
    finally:
        cluster.stop()


def test_a_missing_target_folder_or_an_unreachable_hub_is_one_line():
    one_line(
        draftfeed_cli("launch", "worker", "--broker", "tcp://127.0.0.1:9", "--target", "/no/such/model"), 2, "--target /no/such/model: no such folder"
    )
    # A hub id is checked before torch loads, so these run as plain processes (a preloader for HF_HUB_OFFLINE=1 would
    # import torch and transformers first); each answers in about a second.
    offline = {**os.environ, **WORKER_ENV, "HF_HUB_OFFLINE": "1"}
    worker = [sys.executable, "-m", "draftfeed", "launch", "worker", "--broker", "tcp://127.0.0.1:9", "--target"]
    unreachable = subprocess.run([*worker, "meta-llama/Llama-3.1-8B"], capture_output=True, text=True, timeout=60, env=offline)
    one_line(unreachable, 2, "not a local folder, and the hub could not give it", "pass its local folder")
    malformed = subprocess.run([*worker, "two words/x/y"], capture_output=True, text=True, timeout=60, env=offline)
    one_line(malformed, 2, "--target two words/x/y: neither a local folder nor a hub id", "its hub id as namespace/name")


def test_endpoints_ports_levels_and_devices_are_checked(cluster_with_worker, tiny_target):
    one_line(draftfeed_cli("launch", "broker", "--frontend", "5555"), 2, "'5555' is not a ZeroMQ endpoint: write tcp://*:5555")
    one_line(draftfeed_cli("launch", "broker", "--log-level", "LOUD"), 2, "invalid choice: 'LOUD'")
    taken = cluster_with_worker.frontend
    busy = draftfeed_cli("launch", "broker", "--frontend", taken, "--backend", "tcp://127.0.0.1:*")
    one_line(busy, 2, f"cannot listen on {taken} (--frontend)", "Address already in use", "choose another port")
    for flag, value, words in (("--max-seq-len", "0", "at least 1"), ("--chunk-tokens", "-1", "or 0 to compute every batch whole")):
        result = draftfeed_cli("launch", "worker", "--broker", "tcp://127.0.0.1:9", "--target", str(tiny_target), flag, value)
        one_line(result, 2, f"{flag} {value}:", words)
    update = ("target", "update", "--broker", "tcp://127.0.0.1:9", "--service", "s", "--weights", "/w")
    one_line(draftfeed_cli(*update, "--version", "1", "--at-once", "0"), 2, "at_once 0: input should be greater than or equal to 1")
    one_line(draftfeed_cli(*update, "--version", "-1"), 2, "target_version -1: input should be greater than or equal to 0")
    if not torch.cuda.is_available():
        cuda = draftfeed_cli("launch", "worker", "--broker", "tcp://127.0.0.1:9", "--target", str(tiny_target), "--device", "cuda:0")
        one_line(cuda, 2, "--device cuda:0:", "use --device cpu on this machine")


def test_workers_refused_or_unanswered_and_status_without_a_broker_say_why(cluster_with_worker, tiny_target, tmp_path):
    from draftfeed.tiny import build_tiny_target

    other = build_tiny_target(tmp_path / "other", num_hidden_layers=6, hidden_size=64, vocab_size=1000)
    refused = draftfeed_cli(
        "launch", "worker", "--broker", cluster_with_worker.backend, "--target", str(other), "--service", SERVICE, "--aux-layer-ids", "1,2,3"
    )
    one_line(refused, 1, "the broker refused its registration", f"serves another target than service '{SERVICE}'", "num_hidden_layers")
    unanswered = draftfeed_cli("launch", "worker", "--broker", "tcp://127.0.0.1:9", "--target", str(tiny_target), "--register-timeout", "1")
    one_line(unanswered, 1, "no broker answered at tcp://127.0.0.1:9 within 1 s (--register-timeout)", "its worker port (--backend)")
    one_line(draftfeed_cli("status", "--broker", "tcp://127.0.0.1:9", "--timeout", "1"), 1, "no status from a broker at tcp://127.0.0.1:9 within 1 s")
    for result in (refused, unanswered):
        assert "ContextTerminated" not in result.stderr and "link failed" not in result.stderr, result.stderr


def test_the_wrong_port_is_named_for_ranks_and_workers(cluster_with_worker, tiny_target):
    with pytest.raises(
        RemoteTargetError, match=r"refused this rank: this is the broker's worker port \(\S+\); ranks connect to its rank port \(--frontend"
    ):
        RemoteEagle3Target(cluster_with_worker.backend, SERVICE, connect_timeout=30)
    at_rank_port = draftfeed_cli(
        "launch", "worker", "--broker", cluster_with_worker.frontend, "--target", str(tiny_target), "--register-timeout", "30"
    )
    one_line(at_rank_port, 1, "this is the broker's rank port", "workers connect to its worker port (--backend")


def test_a_rank_giving_up_on_an_unreachable_broker_prints_no_traceback():
    code = "from draftfeed import RemoteEagle3Target\ntry:\n    RemoteEagle3Target('tcp://127.0.0.1:9', 'x', connect_timeout=1)\nexcept Exception as exc:\n    print('ERROR', exc)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env={**os.environ, **WORKER_ENV})
    assert "ERROR no broker answered at tcp://127.0.0.1:9 within 1 s (connect_timeout)" in result.stdout, result.stdout + result.stderr
    assert "Traceback" not in result.stderr and "IO thread failed" not in result.stderr, result.stderr


def test_a_rank_checks_its_arguments_before_it_connects():
    for kwargs, message in (
        ({"prefetch_depth": 1.5}, r"RemoteEagle3Target: prefetch_depth=1\.5: input should be a valid integer"),
        ({"prefetch_depth": -1}, r"prefetch_depth=-1: input should be greater than or equal to 0"),
        ({"request_timeout": 0}, r"request_timeout=0: input should be greater than 0"),
        ({"data_plane": "nccl"}, r"data_plane='nccl' needs a CUDA device= to receive on, and this rank's device is cpu: use data_plane='auto'"),
    ):
        with pytest.raises(ValueError, match=message):
            RemoteEagle3Target("tcp://127.0.0.1:9", SERVICE, connect_timeout=1, **kwargs)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"device='cuda', but torch here is built without CUDA|device='cuda', but no CUDA device"):
            RemoteEagle3Target("tcp://127.0.0.1:9", SERVICE, device="cuda", connect_timeout=1)


def test_a_refusal_is_reported_as_a_refusal(cluster_with_worker):
    with pytest.raises(RemoteTargetError) as raised:
        RemoteEagle3Target(cluster_with_worker.frontend, SERVICE, prefetch_depth=300)
    message = str(raised.value)
    assert "refused this rank" in message and "use prefetch_depth 256 or less" in message and "cannot connect" not in message, message


def test_a_vocab_mapping_may_be_given_as_lists(cluster_with_worker, tiny_model):
    ids, mask = draft_vocab(40)
    batch = make_batch(2, 10, 1000, seed=12)
    with RemoteEagle3Target(cluster_with_worker.frontend, SERVICE) as target:
        target.set_vocab_mapping(ids.tolist(), mask.tolist())
        assert_supervision_equal(target.generate_batch(**batch), reference_eagle3(tiny_model, batch, [1, 3, 4], ids, mask))
        with pytest.raises(
            TypeError, match=r"set_vocab_mapping: selected_token_ids must be a torch\.Tensor \(or a list of torch\.int64 values\), got str"
        ):
            target.set_vocab_mapping("0,1,2", mask)


def test_a_row_longer_than_the_target_takes_is_refused_naming_both_numbers(tmp_path):
    from draftfeed.tiny import build_tiny_target

    short = build_tiny_target(tmp_path / "short", num_hidden_layers=8, hidden_size=64, vocab_size=1000, max_position_embeddings=128)
    cluster = Cluster()
    try:
        cluster.add_worker(short, "--service", "short")
        with RemoteEagle3Target(cluster.frontend, "short") as target:
            with pytest.raises(RemoteTargetError, match=r"has rows of 200 positions; the target of service 'short' takes at most 128"):
                target.generate_batch(**make_batch(1, 200, 1000, seed=1, ragged=False))
            target.generate_batch(**make_batch(1, 128, 1000, seed=1, ragged=False))  # at the limit: served
    finally:
        cluster.stop()


def test_a_forced_data_plane_that_cannot_be_had_fails_at_the_first_batch(tiny_target):
    cluster = Cluster()
    try:
        cluster.add_worker(tiny_target, "--service", "forced", "--data-plane", "nccl")
        with RemoteEagle3Target(cluster.frontend, "forced") as target:
            with pytest.raises(
                RemoteTargetError, match=r"the data plane asked for cannot be had: the worker asked for nccl, but the worker's supervision is on cpu"
            ):
                target.generate_batch(**make_batch(1, 8, 1000, seed=2))
    finally:
        cluster.stop()


def test_status_waits_for_a_ready_worker_of_a_service(tiny_target):
    cluster = Cluster()
    try:
        one_line(draftfeed_cli("status", "--broker", cluster.frontend, "--service", "later"), 1, "service 'later' has no ready worker")
        joining = threading.Thread(target=lambda: cluster.add_worker(tiny_target, "--service", "later"), daemon=True)
        joining.start()
        waited = draftfeed_cli("status", "--broker", cluster.frontend, "--service", "later", "--wait", "60")
        assert waited.returncode == 0, waited.stderr
        assert "service later:" in waited.stdout
        joining.join(60)
        one_line(draftfeed_cli("status", "--wait", "5"), 2, "--wait goes with --service NAME")
    finally:
        cluster.stop()


def test_the_broker_logs_arrivals_departures_and_that_it_is_secure(tiny_target, tmp_path):
    keys = tmp_path / "keys"
    assert draftfeed_cli("keys", "generate", "--out", str(keys)).returncode == 0
    broker = commands.start_broker(extra=["--secure", "--keys", str(keys), "--heartbeat-interval", "0.2"])
    try:
        wait_for_line(broker, r"secure: CURVE on both sockets; 1 rank keys .* 1 worker keys", timeout_s=10)
        worker = commands.start_worker(
            broker.ready["backend"], str(tiny_target), "--service", "s", "--secure", "--keys", str(keys), "--name", "logged", env=WORKER_ENV
        )
        wait_for_line(broker, r"worker logged \(host \S+, pid \d+, engine hf, capacity 2\) registered for service 's'", timeout_s=30)
        with RemoteEagle3Target(broker.ready["frontend"], "s", keys=keys) as target:
            wait_for_line(broker, rf"rank {target.rank_id} \(host \S+, pid \d+\) connected for service 's'", timeout_s=10)
        wait_for_line(broker, rf"forgot rank {target.rank_id} of service 's': it said goodbye", timeout_s=10)
        worker.stop()
        wait_for_line(broker, r"forgot worker logged of service 's': it said goodbye", timeout_s=10)
    finally:
        broker.stop()


def test_secure_mode_mistakes_are_told_apart(tmp_path):
    keys = tmp_path / "keys"
    assert draftfeed_cli("keys", "generate", "--out", str(keys)).returncode == 0
    assert draftfeed_cli("keys", "generate", "--out", str(keys), "--name", "stranger").returncode == 0
    secure = commands.start_broker(extra=["--secure", "--keys", str(keys)])
    plain = commands.start_broker()
    from draftfeed.security.curve import PeerKeys

    def keys_of(secret: str, broker_key: Path = keys / "broker.key") -> PeerKeys:
        return PeerKeys.from_files(keys / secret, broker_key)

    try:
        front = secure.ready["frontend"]
        cases = [
            (
                None,
                front,
                r"is secure \(CURVE\) and this rank has no keys: pass keys=|plaintext handshake: it is most likely secure \(CURVE\); pass keys=",
            ),
            (keys_of("stranger.key_secret"), front, r"refused this rank's key \(status 400\): it is not on the broker's --rank-keys allow-list"),
            (keys_of("worker.key_secret"), front, r"refused this rank's key .*a worker's key is refused here too"),
            (
                keys_of("rank.key_secret", keys / "stranger.key"),
                front,
                r"the CURVE handshake with the broker at \S+ failed: check that the broker\.key",
            ),
            (
                keys_of("rank.key_secret"),
                plain.ready["frontend"],
                r"this rank has CURVE keys but the broker at \S+ is not secure|the broker runs with --secure",
            ),
        ]
        for peer_keys, endpoint, message in cases:
            with pytest.raises(RemoteTargetError, match=message):
                RemoteEagle3Target(endpoint, "s", keys=peer_keys, connect_timeout=30)
        tiny = str(tmp_path / "tiny")
        from draftfeed.tiny import build_tiny_target

        build_tiny_target(tiny)
        no_keys = draftfeed_cli("launch", "worker", "--broker", secure.ready["backend"], "--target", tiny, "--register-timeout", "30")
        one_line(no_keys, 1, "secure (CURVE)", "pass --secure --keys DIR")
    finally:
        secure.stop()
        plain.stop()
