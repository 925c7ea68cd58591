"""The publisher's half: a socket from which workers pull a weight update's manifest and pieces, straight from the
trainer's tensors (a CPU tensor's bytes are sent without a copy; a device tensor's piece is copied to the host, one
piece at a time). It serves every worker that connects, each at its own pace, until stopped."""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping

import torch
import zmq

from draftfeed.dataplane.frames.codec import encode_specs, flat_bytes
from draftfeed.dataplane.weights.plan import plan
from draftfeed.net import bind, close_quietly, recv_routed
from draftfeed.schemas.errors import MalformedMessage
from draftfeed.schemas.frames import pack, unpack
from draftfeed.schemas.messages import MANIFEST_PAGE, WEIGHTS_INBOUND, ErrorReply, WeightsManifest, WeightsPiece

log = logging.getLogger("draftfeed.weights")


class WeightsPublisher(threading.Thread):
    """Serves ``tensors`` on ``endpoint`` (``tcp://HOST:*``: a free port; ``self.endpoint`` is where it listens), in
    pieces of ``chunk_bytes``, to any worker that pulls; each reply echoes the broker's number of the update that the
    pull names (a socket serves one update)."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], endpoint: str, chunk_bytes: int) -> None:
        super().__init__(name="draftfeed-weights-publisher", daemon=True)
        self.tensors = [tensor.detach() if tensor.is_contiguous() else tensor.detach().contiguous() for tensor in tensors.values()]
        self.specs = encode_specs(dict(zip(tensors, self.tensors)))
        self.chunk_bytes = max(8, chunk_bytes - chunk_bytes % 8)  # whole elements in every piece, of any dtype
        self.pieces = plan(self.specs, chunk_bytes)
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self.endpoint = bind(self._socket, endpoint)
        self._stopping = threading.Event()

    def run(self) -> None:
        try:
            while not self._stopping.is_set():
                if self._socket.poll(100):
                    peer, frames = recv_routed(self._socket)
                    self._answer(peer, frames)
        finally:
            close_quietly(self._socket)
            self._context.term()

    def stop(self) -> None:
        self._stopping.set()
        self.join(10)

    def _answer(self, peer: bytes, frames: list) -> None:
        try:
            pull, _ = unpack(frames, WEIGHTS_INBOUND)
            if pull.what == "manifest":
                first = pull.index * MANIFEST_PAGE
                page = self.specs[first : first + MANIFEST_PAGE]
                reply = WeightsManifest(update=pull.update, first=first, total=len(self.specs), chunk_bytes=self.chunk_bytes, tensors=page)
                self._socket.send_multipart([peer, *pack(reply)])
            elif pull.what == "piece":
                piece = self.pieces[pull.index]
                data = flat_bytes(self.tensors[piece.tensor])[piece.offset : piece.offset + piece.nbytes]
                frame = memoryview(data.numpy()) if data.device.type == "cpu" else memoryview(data.cpu().numpy())
                self._socket.send_multipart([peer, *pack(WeightsPiece(update=pull.update, index=pull.index)), frame], copy=False)
        except (MalformedMessage, IndexError) as exc:  # a bad pull costs its sender, never the publisher
            log.warning("draftfeed: weights publisher: a bad pull: %s", exc)
            self._socket.send_multipart([peer, *pack(ErrorReply(message=f"weights publisher: {exc}", code="refused"))])
