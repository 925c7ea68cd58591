"""What arrives on a rank's data socket, on every plane, handed to the rank's session as answers.

A worker's answer comes as frames in one message, as frames in pieces (dataplane/frames/rank_chunks.py), or with its
tensors on the pair's own group (dataplane/pair_group/rank.py) or written into a nixl slot (dataplane/nixl/rank.py);
the handshakes of the last two come on the data socket too. ``on_data`` routes each message to its plane's receiver;
whatever a receiver completes goes to the session (``on_answer``: first answer wins), and an answer a receiver lost
is asked for again (``ask_again``), and so is one whose digests (the worker's ``--checksum``: dataplane/digests.py) say
it arrived changed. Called on the rank's IO thread, and on the pair groups' receiving threads.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from draftfeed.dataplane.digests import mismatch
from draftfeed.dataplane.frames.codec import decode_tensors
from draftfeed.dataplane.frames.rank_chunks import ChunkAssemblies
from draftfeed.dataplane.nixl.rank import NixlReceivers
from draftfeed.dataplane.pair_group.rank import PairReceivers
from draftfeed.producers.rank_session import RankSession
from draftfeed.producers.requests import RequestTable
from draftfeed.schemas.frames import pack, unpack
from draftfeed.schemas.messages import DATA_INBOUND, Chunk, NixlOpen, NixlWant, PairClose, PairOpen, Result

log = logging.getLogger("draftfeed.producer")


class Receivers:
    """The rank's receivers of every plane, and where what they receive goes."""

    def __init__(
        self,
        session: RankSession,
        requests: RequestTable,
        device: torch.device | str,
        nixl_pool_bytes: int,
        max_result_bytes: int,
        *,
        ask_again: Callable[[Result, str], None],
        to_worker: Callable[[bytes, list[Any]], None],
    ) -> None:
        """``ask_again``: the request of an answer that was lost on its way goes again, under a new id (through the IO
        thread); ``to_worker``: frames for a worker, on the data socket (through the IO thread)."""
        self.session, self.requests, self.max_result_bytes = session, requests, max_result_bytes
        self._ask_again, self._to_worker = ask_again, to_worker
        self.pairs = PairReceivers(device, self._on_pair_result, ask_again, self._on_pair_closed, session.refuse_answer, max_result_bytes)
        self.nixl = NixlReceivers(
            session.rank_id, device, nixl_pool_bytes, self._on_nixl_result, ask_again, session.refuse_answer, to_worker, max_result_bytes
        )
        self.chunks = ChunkAssemblies(
            device, max_result_bytes, self._awaiting, self._progressed, self._on_pieced_result, session.refuse_answer, ask_again, self._changed
        )

    def on_data(self, frames: list[Any]) -> None:
        """One message from the data socket (``frames[0]`` the worker's identity); raises MalformedMessage."""
        message, tensor_frames = unpack(frames[1:], DATA_INBOUND)
        if isinstance(message, Result):
            self._progressed(message.request_id)  # its answer is on its way (a pair's or nixl's tensors follow the header)
        if isinstance(message, PairOpen):
            self.pairs.open(frames[0].bytes, message)
        elif isinstance(message, PairClose):
            self.pairs.worker_closed(message)
            self.nixl.worker_closed(message)
        elif isinstance(message, Result) and message.plane == "pair":
            self.pairs.receive(message)  # always, even for an answer no longer awaited: the group stays in step
        elif isinstance(message, NixlOpen):
            self.nixl.open(frames[0].bytes, message)
        elif isinstance(message, NixlWant):
            self.nixl.want(frames[0].bytes, message)
        elif isinstance(message, Result) and message.plane == "nixl":
            self.nixl.receive(message)
        elif isinstance(message, Result) and message.chunk_bytes is not None:
            self.chunks.begin(message)
        elif isinstance(message, Chunk):
            self.chunks.piece(message, tensor_frames)
        elif isinstance(message, Result) and message.digests is not None:
            tensors = decode_tensors(message.tensors, tensor_frames, max_message_bytes=self.max_result_bytes)
            if self._intact(message, tensors):
                self.session.on_answer(message, lambda: tensors)
        else:
            self.session.on_answer(message, lambda: decode_tensors(message.tensors, tensor_frames, max_message_bytes=self.max_result_bytes))

    def worker_gone(self, worker: str) -> None:
        """The broker reports the worker gone: what each plane holds of it is released."""
        self.chunks.worker_gone(worker)
        self.pairs.close_worker(worker, "the broker reports the worker gone")
        self.nixl.close_worker(worker, "the broker reports the worker gone")

    def close(self, io_thread_ended: bool) -> None:
        """Close the pair groups; the nixl pairs and partial answers too once the IO thread, which owns them, ended."""
        self.pairs.close()
        if io_thread_ended:
            self.nixl.close()
            self.chunks.close()

    # ------------------------------------------------------------ what the receivers hand over
    def _awaiting(self, request_id: int, token: int) -> int | None:
        """The request (its waiter's identity) an answer to ``request_id`` with ``token`` is for, None if none waits."""
        waiter = self.requests.get(request_id)
        return None if waiter is None or waiter.token != token else id(waiter)

    def _progressed(self, request_id: int) -> None:
        """A piece of the request's answer arrived, or its header: its wait is not over while pieces come (waits.py), and
        the broker is not asked where it is (requests.py, ``stale``)."""
        waiter = self.requests.get(request_id)
        if waiter is not None:
            waiter.future.progressed_at = time.monotonic()

    def _on_pieced_result(self, header: Result, tensors: dict[str, Any], seconds: float) -> None:
        if tensors:  # a whole answer (none: one no longer awaited, which the session drops and counts)
            stats = self.session.stats
            stats.received_in_pieces += 1
            stats.bytes_in_pieces += sum(t.numel() * t.element_size() for t in tensors.values())
            stats.seconds_in_pieces += seconds
        self.session.on_answer(header, lambda: tensors)

    def _on_pair_result(self, header: Result, tensors: dict[str, Any]) -> None:
        if self._intact(header, tensors):
            self.session.stats.received_over_pair += 1
            self.session.on_answer(header, lambda: tensors)

    def _on_nixl_result(self, header: Result, tensors: dict[str, Any]) -> None:
        if self._intact(header, tensors):
            self.session.stats.received_over_nixl += 1
            self.session.on_answer(header, lambda: tensors)

    def _intact(self, header: Result, tensors: dict[str, Any]) -> bool:
        """Whether an answer the worker sent digests with arrived as it was sent (or came without digests)."""
        if header.digests is None or self.requests.check(header.request_id, header.token) != "ok":
            return True  # no digests, or no longer awaited: the session drops it
        changed = mismatch(tensors, header.digests)
        if changed is not None:
            self._changed(header, changed)
        return changed is None

    def _changed(self, header: Result, what: str) -> None:
        """An answer arrived changed: dropped, counted, and its request asked for again."""
        self.session.stats.checksum_mismatches += 1
        log.warning(
            "draftfeed rank %s: worker %s's answer to request %d arrived changed (%s)", self.session.rank_id, header.worker, header.request_id, what
        )
        self._ask_again(header, f"its bytes arrived changed: {what}")

    def _on_pair_closed(self, identity: bytes, message: PairClose) -> None:
        self._to_worker(identity, pack(message))
