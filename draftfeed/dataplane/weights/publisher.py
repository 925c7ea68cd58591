"""The publisher's half: a socket from which workers pull a weight update's manifest and pieces, straight from the
trainer's tensors (a CPU tensor's bytes are sent without a copy; a device tensor's piece is copied to the host, one
piece at a time). It serves every worker that connects, each at its own pace, until stopped.

With ``nixl``, the tensors are also registered with a NIXL agent of the publisher's, and the manifest says where each
lies: a worker that has NIXL reads the pieces itself, one-sided (RDMA between hosts, GPU memory directly where UCX
has GPUDirect), and asks the socket only for the manifest and the agent's metadata; one that has not pulls the
pieces as frames.

With ``pair`` (a backend: nccl for a trainer's GPU tensors), a worker process on the same machine may ask for a pair
group of its own, over which the pieces are sent in order (pair_pieces.py).

With ``keys`` (a secure deployment), the socket is a CURVE server with the trainer's pair, and admits only the workers
the broker told to pull (``admit``, from the broker's ``worker_keys``)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping

import torch
import zmq

from draftfeed.dataplane.choice import gpu_uuid, host_id
from draftfeed.dataplane.frames.codec import encode_specs, flat_bytes
from draftfeed.dataplane.nixl.memory import Region
from draftfeed.dataplane.weights.pair_pieces import PairSends
from draftfeed.dataplane.weights.plan import plan
from draftfeed.net import bind, close_quietly, recv_routed
from draftfeed.schemas.errors import MalformedMessage
from draftfeed.schemas.frames import pack, unpack
from draftfeed.schemas.messages import (
    MANIFEST_PAGE,
    WEIGHTS_INBOUND,
    ErrorReply,
    WeightsManifest,
    WeightsNixl,
    WeightsPiece,
    WeightsRegion,
)
from draftfeed.security.curve import WEIGHTS, RoleGate, make_server, start_authenticator
from draftfeed.security.keys import KeyPair

log = logging.getLogger("draftfeed.weights")


class WeightsPublisher(threading.Thread):
    """Serves ``tensors`` on ``endpoint`` (``tcp://HOST:*``: a free port; ``self.endpoint`` is where it listens), in
    pieces of ``chunk_bytes``, to any worker that pulls; each reply echoes the broker's number of the update that the
    pull names (a socket serves one update)."""

    def __init__(
        self,
        tensors: Mapping[str, torch.Tensor],
        endpoint: str,
        chunk_bytes: int,
        nixl: bool = False,
        keys: KeyPair | None = None,
        pair: str | None = None,
        pair_timeout_s: float = 60.0,
    ) -> None:
        super().__init__(name="draftfeed-weights-publisher", daemon=True)
        self.tensors = [tensor.detach() if tensor.is_contiguous() else tensor.detach().contiguous() for tensor in tensors.values()]
        self.specs = encode_specs(dict(zip(tensors, self.tensors)))
        self.chunk_bytes = max(8, chunk_bytes - chunk_bytes % 8)  # whole elements in every piece, of any dtype
        self.pieces = plan(self.specs, chunk_bytes)
        self._nixl = _NixlOffer(self.tensors) if nixl else None
        self._pair, self._pair_timeout_s, self._pair_sends = pair, pair_timeout_s, []  # a backend offered, the senders
        self._gpu = gpu_uuid(self.tensors[0].device) if pair == "nccl" and self.tensors else None
        self._context = zmq.Context()
        self._admitted: frozenset[bytes] = frozenset()
        self._authenticator = None
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        if keys is not None:  # encrypted: only the workers the broker told to pull are admitted (admit)
            self._authenticator = start_authenticator(self._context, {WEIGHTS: RoleGate("worker", lambda: self._admitted)})
            make_server(self._socket, keys, WEIGHTS)
        self.endpoint = bind(self._socket, endpoint)
        self._stopping = threading.Event()
        # stop() wakes the loop at once through an in-process pair (the caller's end is used only by stop)
        self._wake, self._waker = self._context.socket(zmq.PAIR), self._context.socket(zmq.PAIR)
        wake_at = f"inproc://draftfeed-weights-wake-{id(self)}"
        self._wake.bind(wake_at)
        self._waker.connect(wake_at)
        self._host = self.endpoint.removeprefix("tcp://").rsplit(":", 1)[0].strip("[]")  # where a pair's store listens

    def admit(self, keys: list[str]) -> None:
        """On an encrypted socket, the workers' public keys (Z85) to admit from now on: the broker's ``worker_keys``."""
        self._admitted = frozenset(key.encode() for key in keys)

    def run(self) -> None:
        try:
            poller = zmq.Poller()
            poller.register(self._socket, zmq.POLLIN)
            poller.register(self._wake, zmq.POLLIN)
            while not self._stopping.is_set():
                if self._socket in dict(poller.poll(1000)):
                    peer, frames = recv_routed(self._socket)
                    self._answer(peer, frames)
        finally:
            self._release()

    def stop(self) -> None:
        """End the loop and free the sockets (and the NIXL agent); the thread ends before this returns."""
        self._stopping.set()
        try:
            self._waker.send(b"", flags=zmq.NOBLOCK)
        except zmq.Again:  # the loop saw the flag first and has closed its end: nothing left to wake
            pass
        if self.ident is not None:
            self.join(10)
        else:  # never started
            self._release()
        close_quietly(self._waker)
        self._context.term()

    def _release(self) -> None:
        """The loop's sockets, the authenticator and the NIXL agent (the loop's thread, or stop() when it never ran)."""
        close_quietly(self._socket, self._wake)
        for sends in self._pair_sends:
            sends.close()
        if self._authenticator is not None:
            self._authenticator.stop()
        if self._nixl is not None:
            self._nixl.close()

    def _answer(self, peer: bytes, frames: list) -> None:
        try:
            pull, _ = unpack(frames, WEIGHTS_INBOUND)
            if pull.what == "manifest":
                first = pull.index * MANIFEST_PAGE
                page = self.specs[first : first + MANIFEST_PAGE]
                offer: dict = {} if self._pair is None else {"pair_backend": self._pair, "host_id": host_id(), "pair_gpu": self._gpu}
                if self._nixl is not None:
                    offer |= {"nixl_agent": self._nixl.agent.name, "regions": self._nixl.regions[first : first + MANIFEST_PAGE]}
                reply = WeightsManifest(update=pull.update, first=first, total=len(self.specs), chunk_bytes=self.chunk_bytes, tensors=page, **offer)
                self._socket.send_multipart([peer, *pack(reply)])
            elif pull.what == "nixl":
                if self._nixl is None:
                    raise IndexError("this publisher offers no NIXL: pull the pieces")
                self._socket.send_multipart([peer, *pack(WeightsNixl(update=pull.update, agent=self._nixl.agent.name)), self._nixl.metadata])
            elif pull.what == "pair":
                if self._pair is None:
                    raise IndexError("this publisher offers no pair group: pull the pieces")
                sends = PairSends(self.tensors, self.pieces, self._pair, self._host, pull.update, self._pair_timeout_s)
                self._pair_sends.append(sends)
                sends.start()
                self._socket.send_multipart([peer, *pack(sends.offer)])
            elif pull.what == "piece":
                piece = self.pieces[pull.index]
                data = flat_bytes(self.tensors[piece.tensor])[piece.offset : piece.offset + piece.nbytes]
                frame = memoryview(data.numpy()) if data.device.type == "cpu" else memoryview(data.cpu().numpy())
                self._socket.send_multipart([peer, *pack(WeightsPiece(update=pull.update, index=pull.index)), frame], copy=False)
        except (MalformedMessage, IndexError, OSError) as exc:  # a bad pull (or no store to open) costs its sender only
            log.warning("draftfeed: weights publisher: a bad pull: %s", exc)
            self._socket.send_multipart([peer, *pack(ErrorReply(message=f"weights publisher: {exc}", code="refused"))])


class _NixlOffer:
    """The publisher's NIXL agent with every tensor registered, and where each lies (the manifest's regions)."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        import uuid

        from draftfeed.dataplane.nixl.transport import NixlAgent

        self.agent = NixlAgent(f"draftfeed-weights-{uuid.uuid4().hex[:12]}")
        self.regions: list[WeightsRegion] = []
        try:
            for tensor in tensors:
                device = (tensor.device.index or 0) if tensor.is_cuda else 0
                kind = "VRAM" if tensor.is_cuda else "DRAM"
                region = Region(tensor.data_ptr(), tensor.numel() * tensor.element_size(), device, kind)
                if region.nbytes:  # an empty tensor has no piece to read
                    self.agent.register(region)
                self.regions.append(WeightsRegion(address=region.address, device=device, kind=kind))
            self.metadata = self.agent.metadata()
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        self.agent.close()  # deregisters every tensor
