"""Broker messages built for ``BrokerState`` on its own (no sockets), and its outgoing frames read back.

Every builder sends one message from a peer named as its routing id (``"w1"`` arrives as ``b"w1"``) of service
``svc`` and returns what the broker sends in answer, for the readers below.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from draftfeed.broker.state import BrokerState
from draftfeed.dataplane.frames.codec import encode_tensors
from draftfeed.schemas.frames import unpack
from draftfeed.schemas.messages import (
    BACKEND_OUTBOUND,
    FRONTEND_OUTBOUND,
    Dispatch,
    Eagle3TargetInfo,
    ErrorReply,
    Hello,
    Register,
    Submit,
    VersionWanted,
    Welcome,
)

SERVICE = "svc"
# The tiny target of conftest.py, as a worker registers it.
INFO = Eagle3TargetInfo(num_hidden_layers=8, hidden_size=64, vocab_size=1000, aux_layer_ids=[1, 3, 4])


# ---------------------------------------------------------------- to the broker
def register(state: BrokerState, name: str, capacity: int = 1, info=INFO, target_version: int = 0) -> list:
    """Worker ``name`` registers for ``svc`` with room for ``capacity`` requests, serving ``target_version``."""
    register = Register(
        worker=name, service=SERVICE, task=info.task, engine="hf", info=info, capacity=capacity, host="h", pid=1, target_version=target_version
    )
    return state.on_register(name.encode(), register)


def hello(state: BrokerState, name: str = "r", window: int = 2) -> list:
    """Rank ``name`` says hello to ``svc`` with ``window`` requests outstanding at most."""
    return state.on_hello(name.encode(), Hello(rank=name, service=SERVICE, data_endpoint=f"tcp://127.0.0.1:1/{name}", window=window, host="h", pid=1))


def submit(
    state: BrokerState,
    rank: str,
    request_id: int,
    digest: str | None = None,
    tensors: Mapping[str, torch.Tensor] | None = None,
    target_version: VersionWanted | None = None,
) -> list:
    """Rank ``rank`` submits an eagle3 request (token ``request_id + 100``) computed with the vocab mapping ``digest``
    (None: none), carrying ``tensors`` (none: an empty request), taking the target versions ``target_version`` wants."""
    specs, frames = encode_tensors(tensors or {})
    request = Submit(
        request_id=request_id, kind="eagle3", token=request_id + 100, mapping_digest=digest, tensors=specs, target_version=target_version
    )
    return state.on_submit(rank.encode(), request, frames)


# ---------------------------------------------------------------- from the broker
def frontend(out: list) -> list:
    """The messages to ranks, in order."""
    return [unpack(item.frames, FRONTEND_OUTBOUND)[0] for item in out if item.side == "frontend"]


def backend(out: list, worker: str | None = None) -> list:
    """The messages to workers (to ``worker`` only, when given), in order."""
    return [unpack(item.frames, BACKEND_OUTBOUND)[0] for item in out if item.side == "backend" and (worker is None or item.peer == worker.encode())]


def only(messages: list, kind: type) -> list:
    return [m for m in messages if isinstance(m, kind)]


def dispatches(out: list) -> list[tuple[bytes, Dispatch]]:
    """(worker's routing id, dispatch) of each dispatch sent."""
    return [
        (item.peer, message)
        for item in out
        if item.side == "backend"
        for message in [unpack(item.frames, BACKEND_OUTBOUND)[0]]
        if isinstance(message, Dispatch)
    ]


def errors(out: list) -> list[ErrorReply]:
    """The error replies to ranks."""
    return only(frontend(out), ErrorReply)


def welcome(out: list) -> Welcome:
    """The one answer to a hello, which must be a welcome."""
    (reply,) = frontend(out)
    assert isinstance(reply, Welcome), reply
    return reply
