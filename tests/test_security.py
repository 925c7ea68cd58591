"""CURVE end to end: keys on disk, a --secure broker, workers and ranks with keys, and intruders who get nothing."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import threading
from contextlib import ExitStack
from pathlib import Path

import pytest
import zmq
from conftest import WORKER_ENV, assert_supervision_equal, make_batch, raw_peer, reference_eagle3, wait_until

from draftfeed import RemoteEagle3Target, RemoteTargetError
from draftfeed.observe.status_client import fetch_status
from draftfeed.processes import commands
from draftfeed.schemas.errors import RemoteTargetTimeout
from draftfeed.schemas.frames import pack
from draftfeed.schemas.messages import Hello, Register, Result, StatusQuery
from draftfeed.security.curve import PeerKeys
from draftfeed.security.keys import load_pair, load_public

pytestmark = pytest.mark.timeout(240)
SERVICE = "secure"
VOCAB = 1000


def keys_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "draftfeed", "keys", "generate", *args], capture_output=True, text=True, timeout=60)


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("keys") / "deploy"
    assert keys_cli("--out", str(folder)).returncode == 0
    # A second worker pair on the allow-list, and a whole foreign deployment (keys nobody here trusts).
    assert keys_cli("--out", str(folder), "--name", "worker2", "--role", "worker").returncode == 0
    assert keys_cli("--out", str(folder / "foreign")).returncode == 0
    return folder


@pytest.fixture
def secure(keys):
    started: list[commands.Process] = []
    broker = commands.start_broker(extra=["--secure", "--keys", str(keys)])
    started.append(broker)

    def add_worker(*args: str, **kwargs) -> commands.Process:
        worker = commands.start_worker(broker.ready["backend"], *args, env=WORKER_ENV, **kwargs)
        started.append(worker)
        return worker

    try:
        yield broker, add_worker
    finally:
        for process in reversed(started):
            process.stop(timeout_s=5)


def heard_anything(sock: zmq.Socket, message: list, timeout_ms: int = 1000) -> bool:
    """Send and see whether any answer comes back within the timeout (a refused handshake delivers nothing)."""
    try:
        sock.send_multipart(message, flags=zmq.NOBLOCK)
    except zmq.Again:
        pass  # no connection was ever completed: nothing can be sent, let alone answered
    return bool(sock.poll(timeout_ms))


def intruder(stack: ExitStack, endpoint: str, own: tuple[bytes, bytes] | None = None, server: bytes | None = None) -> zmq.Socket:
    """A raw_peer named intruder: plaintext, or a CURVE client with its own pair and the server key it believes in."""
    curve = None if own is None else (*own, server)
    return stack.enter_context(raw_peer(endpoint, b"intruder", curve=curve))


def test_keys_generate_writes_certificates_and_allow_lists(keys, tmp_path):
    for name in ("broker", "rank", "worker", "worker2"):
        pair = load_pair(keys / f"{name}.key_secret")
        assert load_public(keys / f"{name}.key") == pair.public
        assert stat.S_IMODE(os.stat(keys / f"{name}.key_secret").st_mode) == 0o600
    assert sorted(p.name for p in (keys / "ranks").iterdir()) == ["rank.key"]
    assert sorted(p.name for p in (keys / "workers").iterdir()) == ["worker.key", "worker2.key"]
    again = keys_cli("--out", str(keys))
    assert again.returncode == 2 and "exists" in again.stderr and "never overwritten" in again.stderr
    bad = subprocess.run([sys.executable, "-m", "draftfeed", "launch", "broker", "--keys", str(keys)], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "without --secure" in bad.stderr
    (tmp_path / "mixed").mkdir()
    for name in ("rank.key", "worker.key"):
        (tmp_path / "mixed" / name).write_bytes((keys / name).read_bytes())
    mixed = subprocess.run(
        [
            sys.executable,
            "-m",
            "draftfeed",
            "launch",
            "broker",
            "--secure",
            "--key",
            str(keys / "broker.key_secret"),
            "--rank-keys",
            str(tmp_path / "mixed"),
            "--worker-keys",
            str(keys / "workers"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert mixed.returncode == 2 and "on both the rank and the worker allow-list" in mixed.stderr


def test_encrypted_supervision_equals_the_in_process_computation(secure, keys, tiny_target, tiny_model):
    broker, add_worker = secure
    add_worker(str(tiny_target), "--service", SERVICE, "--secure", "--keys", str(keys), "--name", "w1")
    with RemoteEagle3Target(broker.ready["frontend"], SERVICE, keys=keys) as remote:
        aux = remote.model_info().aux_layer_ids
        batches = [make_batch(2, 24, VOCAB, seed=seed) for seed in range(4)]
        for batch, supervision in remote.iterate(batches):
            assert_supervision_equal(supervision, reference_eagle3(tiny_model, batch, aux))
        # A worker with another key joins mid-run: the broker vouches for it to the rank, whose data socket admits it.
        add_worker(
            str(tiny_target),
            "--service",
            SERVICE,
            "--secure",
            "--key",
            str(keys / "worker2.key_secret"),
            "--broker-key",
            str(keys / "broker.key"),
            "--name",
            "w2",
        )
        seeds = iter(range(100, 200))

        def one_more() -> bool:
            batch = make_batch(2, 24, VOCAB, seed=next(seeds))
            assert_supervision_equal(remote.generate_batch(**batch), reference_eagle3(tiny_model, batch, aux))
            status = fetch_status(broker.ready["frontend"], keys=PeerKeys.from_folder(keys, "rank"))
            return any(w["worker"] == "w2" and w["served"] > 0 for w in status["services"][SERVICE]["workers"])

        wait_until(one_more, timeout_s=60, what="the second worker serving the rank", poll_s=0)
    with pytest.raises(RemoteTargetTimeout):
        fetch_status(broker.ready["frontend"], timeout_s=2)  # no key: no status either


def test_intruders_get_nothing_and_do_not_disturb_a_run(secure, keys, tiny_target, tiny_model):
    broker, add_worker = secure
    add_worker(str(tiny_target), "--service", SERVICE, "--secure", "--keys", str(keys), "--name", "w1")
    foreign = keys / "foreign"
    rank, worker2 = load_pair(keys / "rank.key_secret"), load_pair(keys / "worker2.key_secret")
    stranger = load_pair(foreign / "rank.key_secret")
    broker_key, wrong_broker_key = load_public(keys / "broker.key"), load_public(foreign / "broker.key")
    with RemoteEagle3Target(broker.ready["frontend"], SERVICE, keys=keys) as remote:
        aux = remote.model_info().aux_layer_ids
        errors: list[BaseException] = []
        batches = [make_batch(2, 24, VOCAB, seed=seed) for seed in range(12)]

        def run() -> None:
            try:
                for batch, supervision in remote.iterate(batches):
                    assert_supervision_equal(supervision, reference_eagle3(tiny_model, batch, aux))
            except BaseException as exc:
                errors.append(exc)

        training = threading.Thread(target=run)
        training.start()
        data_endpoint = remote.data_endpoint
        hello = pack(Hello(rank="intruder", service=SERVICE, data_endpoint="tcp://127.0.0.1:9", window=1, host="h", pid=1))
        register = pack(
            Register(worker="intruder", service=SERVICE, task="eagle3", engine="hf", info=remote.model_info(), capacity=1, host="h", pid=1)
        )
        forged = pack(Result(request_id=0, token=0, kind="eagle3", worker="intruder", tensors=[]))
        with ExitStack() as stack:
            attempts = {
                "plaintext at the frontend": (
                    intruder(stack, broker.ready["frontend"]),
                    [*pack(StatusQuery(request_id=1))],
                ),
                "unknown key at the frontend": (
                    intruder(stack, broker.ready["frontend"], (stranger.public, stranger.secret), broker_key),
                    hello,
                ),
                "rank key, wrong broker key": (
                    intruder(stack, broker.ready["frontend"], (rank.public, rank.secret), wrong_broker_key),
                    hello,
                ),
                "plaintext at the backend": (intruder(stack, broker.ready["backend"]), register),
                "unknown key at the backend": (
                    intruder(stack, broker.ready["backend"], (stranger.public, stranger.secret), broker_key),
                    register,
                ),
                "plaintext at the rank's data socket": (intruder(stack, data_endpoint), forged),
                # On the worker allow-list, but not a registered worker of this service: the rank admits only those.
                "unregistered worker key at the rank": (
                    intruder(stack, data_endpoint, (worker2.public, worker2.secret), rank.public),
                    forged,
                ),
            }
            heard = {name: heard_anything(sock, message) for name, (sock, message) in attempts.items()}
        training.join(timeout=120)
        assert not errors, errors
        assert heard == {name: False for name in attempts}
        stats = remote.connection_stats
        assert (stats.foreign_dropped, stats.malformed_dropped) == (0, 0), "nothing from an intruder reached the rank"
        status = fetch_status(broker.ready["frontend"], keys=PeerKeys.from_folder(keys, "rank"))
        assert [w["worker"] for w in status["services"][SERVICE]["workers"]] == ["w1"]
        assert [c["rank"] for c in status["ranks"]] == [remote.rank_id]
        assert status["counters"]["rejected_messages"] == 0, "no intruder message even reached the broker's parser"


def test_insecure_listening_beyond_loopback_is_announced_loudly(caplog):
    exposed = commands.start_broker(host="0.0.0.0")
    local = commands.start_broker()
    try:
        wait_until(lambda: any("INSECURE" in line and "--secure" in line for line in exposed.log_tail), what="the warning")
        assert not any("INSECURE" in line for line in local.log_tail)
        with caplog.at_level("WARNING", logger="draftfeed.producer"):
            frontend = local.ready["frontend"]
            for endpoint in ("tcp://0.0.0.0:*", None):  # no worker serves SERVICE here: the rank says so at once
                with pytest.raises(RemoteTargetError, match="no worker serves service"):
                    RemoteEagle3Target(frontend, SERVICE, data_endpoint=endpoint, connect_timeout=30, wait_for_workers=0)
        warnings = [r.getMessage() for r in caplog.records if "INSECURE" in r.getMessage()]
        assert len(warnings) == 1 and "tcp://0.0.0.0:" in warnings[0] and "DRAFTFEED_KEYS" in warnings[0]
    finally:
        exposed.stop(timeout_s=5)
        local.stop(timeout_s=5)


def test_role_confusion_is_refused_with_a_logged_reason(secure, keys, tiny_target):
    broker, add_worker = secure
    with pytest.raises(RuntimeError, match="--worker-keys"):
        add_worker(
            str(tiny_target),
            "--service",
            SERVICE,
            "--secure",
            "--key",
            str(keys / "rank.key_secret"),
            "--broker-key",
            str(keys / "broker.key"),
            "--register-timeout",
            "3",
            ready_timeout_s=60,
        )
    with pytest.raises(RemoteTargetError, match="--rank-keys"):
        RemoteEagle3Target(
            broker.ready["frontend"], SERVICE, keys=PeerKeys.from_files(keys / "worker.key_secret", keys / "broker.key"), connect_timeout=3
        )
    wait_until(lambda: any("a rank key tried to connect as a worker" in line for line in broker.log_tail), what="the broker's log of the rank key")
    wait_until(lambda: any("a worker key tried to connect as a rank" in line for line in broker.log_tail), what="the broker's log of the worker key")


def test_weights_published_on_a_secure_deployment_are_pulled_encrypted_and_served_exactly(secure, keys, tiny_target, tiny_model):
    """``publish_weights(keys=...)``: the publisher's socket is CURVE and admits the workers the broker told (their
    keys come from the broker); both workers pull and serve the new version, and every batch at it equals the
    in-process target holding exactly those weights. A worker without keys could not have registered here at all."""
    import copy

    import torch

    from draftfeed import publish_weights

    broker, add_worker = secure
    for name, key in (("w1", "worker.key_secret"), ("w2", "worker2.key_secret")):
        add_worker(
            str(tiny_target),
            "--service",
            "secure-updates",
            "--secure",
            "--key",
            str(keys / key),
            "--broker-key",
            str(keys / "broker.key"),
            "--name",
            name,
        )
    stepped = copy.deepcopy(tiny_model)
    step = {name: tensor + 0.05 for name, tensor in stepped.state_dict().items() if ".layers.1." in name}
    stepped.load_state_dict(step, strict=False)
    trainer = PeerKeys.from_folder(keys, "rank")
    with RemoteEagle3Target(broker.ready["frontend"], "secure-updates", keys=keys) as remote:
        wait_until(
            lambda: len(fetch_status(broker.ready["frontend"], keys=trainer)["services"]["secure-updates"]["workers"]) == 2, 30, "both workers"
        )
        report = publish_weights(broker.ready["frontend"], "secure-updates", step, 1, keys=trainer, chunk_bytes=4096, timeout_s=120)
        assert sorted((r.worker, r.ok, r.target_version) for r in report.workers) == [("w1", True, 1), ("w2", True, 1)], report
        aux = remote.model_info().aux_layer_ids
        batches = [make_batch(2, 24, VOCAB, seed=300 + seed) for seed in range(4)]
        for batch, supervision in remote.iterate(batches, min_target_version=1):
            assert supervision.target_version == 1
            assert_supervision_equal(supervision, reference_eagle3(stepped, batch, aux))
        assert not torch.equal(
            reference_eagle3(stepped, batches[0], aux)["aux_hidden_states"], reference_eagle3(tiny_model, batches[0], aux)["aux_hidden_states"]
        )
