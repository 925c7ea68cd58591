"""What the leader tells its followers, and the socket it tells them on.

Frames are draftfeed's own (``[SIGNATURE, header JSON, *tensor frames]``, schemas/frames.py), over a ZeroMQ
ROUTER the leader binds on an ``ipc://`` path of a folder of its own (reachable from a network namespace too), or on
``tcp://`` of node 0's address when the worker spans machines, and one DEALER per follower. A follower says ``hello`` once its engine is built, then answers each call with an ``ack`` that
says whether the call raised, and what: the leader learns whether every rank ended the call the same way, and when
they all raised, tells them to ``go_on``.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Callable, Mapping
from typing import Annotated, Any, Literal

import torch
import zmq
from pydantic import Field

from draftfeed.dataplane.frames.codec import decode_tensors, encode_tensors
from draftfeed.schemas.errors import CannotServe
from draftfeed.schemas.frames import pack, unpack
from draftfeed.schemas.messages import Accepts, Strict, TensorSpec, UpdateWeights


class CaptureSpec(Strict):
    """``engines.base.Capture`` as JSON."""

    layer_ids: list[int] = []
    embeddings: bool = False
    final_hidden: bool = False
    logits: bool = False


class Hello(Strict):
    type: Literal["hello"] = "hello"
    rank: Annotated[int, Field(ge=1)]


class Ack(Strict):
    """A follower made call ``call``; ``error`` is the exception's type and text when it raised."""

    type: Literal["ack"] = "ack"
    rank: Annotated[int, Field(ge=1)]
    call: Annotated[int, Field(ge=0)]
    error_type: str | None = None
    error: str | None = None


class Prepare(Strict):
    type: Literal["prepare"] = "prepare"
    call: Annotated[int, Field(ge=0)]
    captures: list[CaptureSpec]


class Forward(Strict):
    """``engine.forward`` with these tensors: input_ids, attention_mask and, for a packed batch, seq_lens and position_ids."""

    type: Literal["forward"] = "forward"
    call: Annotated[int, Field(ge=0)]
    capture: CaptureSpec
    tensors: list[TensorSpec]


class Weight(Strict):
    type: Literal["weight"] = "weight"
    call: Annotated[int, Field(ge=0)]
    which: Literal["input", "output"]


class Update(Strict):
    """``engine.update_weights`` on every rank: each reads the update and keeps its own shard (weight_updates.py)."""

    type: Literal["update"] = "update"
    call: Annotated[int, Field(ge=0)]
    message: UpdateWeights
    check_finite: bool
    timeout_s: Annotated[float, Field(gt=0)]  # the longest wait for one part of a pulled update (--update-timeout)


class Stop(Strict):
    type: Literal["stop"] = "stop"


class GoOn(Strict):
    """Every rank raised the same way in call ``call``: the group is in step, the followers go on. A follower that
    raised and does not hear this soon is out of step with the leader (which may be waiting in a collective for it),
    so it exits, and the worker stops."""

    type: Literal["go_on"] = "go_on"
    call: Annotated[int, Field(ge=0)]


Command = Prepare | Forward | Weight | Update | Stop | GoOn
TO_FOLLOWERS = Accepts(Annotated[Command, Field(discriminator="type")])
TO_LEADER = Accepts(Annotated[Hello | Ack, Field(discriminator="type")])
UNBOUNDED = 1 << 62


def local_endpoint(folder: str, name: str) -> str:
    """An ``ipc://`` endpoint in ``folder``, for the sockets of a worker on one machine."""
    return f"ipc://{folder}/{name}"


class LeaderChannel:
    """The leader's end: waits for every follower's hello, then sends each command to all of them. ``bind``: where
    to listen (``tcp://HOST:*`` across machines); by default an ``ipc://`` path of its own."""

    def __init__(self, bind: str | None = None) -> None:
        self._folder = tempfile.mkdtemp(prefix="draftfeed-tp-")
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.bind(bind or local_endpoint(self._folder, "commands"))
        self.endpoint = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self.folder = self._folder  # for the worker's other local sockets (its watch)
        self._followers: list[bytes] = []

    def await_followers(self, count: int, timeout_s: float, failed: Callable[[], str | None]) -> None:
        """Wait for ``count`` hellos; ``failed()`` says why waiting is pointless (a follower died while loading)."""
        deadline = time.monotonic() + timeout_s
        while len(self._followers) < count:
            if (why := failed()) is not None:
                raise CannotServe(why)
            if time.monotonic() > deadline:
                raise CannotServe(
                    f"{count - len(self._followers)} of the worker's {count} tensor-parallel processes did not load the target within "
                    f"{timeout_s:.0f} s; their log lines above say why"
                )
            if self._socket.poll(200):
                identity, *frames = self._socket.recv_multipart()
                message, _ = unpack(frames, TO_LEADER)
                if isinstance(message, Hello):
                    self._followers.append(identity)

    def await_acks(self, call: int, timeout_s: float, failed: Callable[[], str | None]) -> list[Ack] | None:
        """Every follower's ack of ``call``; None if they do not all come within ``timeout_s`` or ``failed()`` says
        why waiting is pointless."""
        acks: dict[int, Ack] = {}
        deadline = time.monotonic() + timeout_s
        while len(acks) < len(self._followers):
            if failed() is not None or time.monotonic() > deadline:
                return None
            if self._socket.poll(100):
                _identity, *frames = self._socket.recv_multipart()
                message, _ = unpack(frames, TO_LEADER)
                if isinstance(message, Ack) and message.call == call:
                    acks[message.rank] = message
        return list(acks.values())

    def send(self, command: Prepare | Forward | Weight | Stop | GoOn, tensors: Mapping[str, torch.Tensor] | None = None) -> None:
        buffers: list[Any] = []
        if tensors is not None:
            specs, buffers = encode_tensors({name: t.detach().cpu() for name, t in tensors.items()})
            command = command.model_copy(update={"tensors": specs})
        frames = pack(command, buffers)
        for identity in self._followers:
            self._socket.send_multipart([identity, *frames], copy=False)

    def close(self) -> None:
        self._socket.close(0)
        self._context.term()
        shutil.rmtree(self._folder, ignore_errors=True)


class FollowerChannel:
    """A follower's end."""

    def __init__(self, endpoint: str, rank: int) -> None:
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.connect(endpoint)
        self.rank = rank

    def hello(self) -> None:
        self._socket.send_multipart(pack(Hello(rank=self.rank)))

    def ack(self, call: int, error: BaseException | None = None) -> None:
        failed = {} if error is None else {"error_type": type(error).__name__, "error": str(error)[:2000]}
        self._socket.send_multipart(pack(Ack(rank=self.rank, call=call, **failed)))

    def receive(self, timeout_s: float | None = None) -> tuple[Prepare | Forward | Weight | Stop | GoOn | None, dict[str, torch.Tensor]]:
        """The next command and its tensors; (None, {}) if none came within ``timeout_s``."""
        if timeout_s is not None and not self._socket.poll(int(timeout_s * 1000)):
            return None, {}
        command, frames = unpack(self._socket.recv_multipart(copy=False), TO_FOLLOWERS)
        # The leader checked the request against its limits already; here a frame is as large as the request it carries.
        tensors = (
            decode_tensors(command.tensors, frames, max_tensor_bytes=UNBOUNDED, max_message_bytes=UNBOUNDED) if isinstance(command, Forward) else {}
        )
        return command, tensors

    def close(self) -> None:
        self._socket.close(0)
        self._context.term()
