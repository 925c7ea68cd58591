"""The pair group's transport through gloo on CPU: a real second process, a real TCPStore on loopback."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import WORKER_ENV
from pair_sender import sample_tensors

from draftfeed.dataplane.pair_group.transport import RECEIVER, DataPlaneError, PairGroup, describe, host_store

SENDER_SCRIPT = str(Path(__file__).parent / "pair_sender.py")
pytestmark = pytest.mark.timeout(120)


def start_sender(port: int, mode: str) -> subprocess.Popen:
    import os

    return subprocess.Popen([sys.executable, SENDER_SCRIPT, str(port), mode], env={**os.environ, **WORKER_ENV}, stdout=subprocess.PIPE, text=True)


@pytest.fixture
def senders():
    started: list[subprocess.Popen] = []
    yield started
    for process in started:
        process.kill()
        process.wait(timeout=10)


def test_tensors_arrive_bit_for_bit(senders):
    store = host_store(timeout_s=30)
    senders.append(start_sender(store.port, "send"))
    group = PairGroup(store, RECEIVER, "gloo", timeout_s=30)
    expected = sample_tensors()
    got = group.receive(describe(expected))
    group.close()
    assert list(got) == list(expected)
    for name, tensor in expected.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, name
        assert torch.equal(got[name], tensor), name
    assert senders[0].wait(timeout=30) == 0


def test_a_dead_sender_fails_the_receive_within_its_timeout_and_the_group_is_closed(senders):
    store = host_store(timeout_s=30)
    senders.append(start_sender(store.port, "die"))
    # The timeout covers the build too, which waits for the sender's process to start (seconds on a loaded machine).
    group = PairGroup(store, RECEIVER, "gloo", timeout_s=20)
    started = time.monotonic()
    with pytest.raises(DataPlaneError, match="gloo pair group failed receiving"):
        group.receive(describe(sample_tensors()))
    assert time.monotonic() - started < 20
    assert group.closed
    with pytest.raises(DataPlaneError, match="closed after a failure"):
        group.receive(describe(sample_tensors()))


def test_the_store_listens_on_the_interface_it_was_given_only():
    import socket

    from draftfeed.net import local_address_towards

    store = host_store("127.0.0.1", timeout_s=5)
    socket.create_connection(("127.0.0.1", store.port), timeout=5).close()
    other = local_address_towards("tcp://10.255.255.1:9")
    if other.startswith("127."):
        pytest.skip("this machine has no interface but loopback")
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection((other, store.port), timeout=5).close()


def test_unknown_backend_and_rank_are_refused():
    store = host_store(timeout_s=5)
    with pytest.raises(ValueError, match="not one of gloo, nccl"):
        PairGroup(store, RECEIVER, "mpi")
    with pytest.raises(ValueError, match="ranks 0 .* and 1"):
        PairGroup(store, 2, "gloo")
