"""The vocab mappings a worker holds, by digest, as the broker sent them.

A mapping is checked when it arrives (its tensors, and that they hash to the digest the broker named); one
that fails the check is held as the error, so every request that names it fails with what was wrong. The
broker says when to forget one (``forget_mapping``); a re-registration forgets them all, as the broker does.
"""

from __future__ import annotations

from typing import Any

import torch

from draftfeed.contract.vocab import VocabMap, mapping_digest, validate_vocab_mapping
from draftfeed.dataplane.frames.codec import decode_tensors
from draftfeed.schemas.errors import BadRequest, MalformedMessage
from draftfeed.schemas.messages import VocabMapping


class MissingMapping(Exception):
    """The request names a vocab mapping this worker does not hold: it goes back to the broker, which sends the
    mapping first next time. Never computed with another mapping, nor with none."""

    def __init__(self, digest: str) -> None:
        super().__init__(f"this worker holds no vocab mapping {digest}")
        self.digest = digest


class WorkerMappings:
    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size, self.device = vocab_size, device
        self._held: dict[str, VocabMap | BadRequest] = {}

    def __len__(self) -> int:
        return len(self._held)

    def load(self, message: VocabMapping, frames: list[Any]) -> None:
        self._held[message.digest] = self._check(message, frames)

    def forget(self, digest: str) -> None:
        self._held.pop(digest, None)

    def clear(self) -> None:
        self._held.clear()

    def get(self, digest: str | None) -> VocabMap | None:
        """The mapping a request names (None: the identity); raises MissingMapping, or BadRequest for a bad one."""
        if digest is None:
            return None
        held = self._held.get(digest)
        if held is None:
            raise MissingMapping(digest)
        if isinstance(held, BadRequest):
            raise held
        return held

    def _check(self, message: VocabMapping, frames: list[Any]) -> VocabMap | BadRequest:
        try:
            tensors = decode_tensors(message.tensors, frames)
            ids, mask = tensors["selected_token_ids"], tensors["selected_token_mask"]
            validate_vocab_mapping(ids, mask, self.vocab_size)
        except (MalformedMessage, KeyError, BadRequest) as exc:
            return BadRequest(f"the vocab mapping is invalid: {exc}")
        if mapping_digest(ids, mask) != message.digest:
            return BadRequest(f"the vocab mapping's tensors do not hash to its digest {message.digest}")
        return VocabMap(ids.to(self.device), mask.to(self.device))
