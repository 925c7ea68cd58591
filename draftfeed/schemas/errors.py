"""Exceptions shared by every side of the pipeline."""

from __future__ import annotations


class DraftfeedError(Exception):
    """Base class of draftfeed's own errors."""


class MalformedMessage(DraftfeedError):
    """A received message does not follow the wire protocol; the text says what is wrong."""


class ProtocolVersionMismatch(MalformedMessage):
    """The peer speaks another draftfeed protocol version."""


class RemoteTargetError(DraftfeedError):
    """A worker or the broker could not serve a request; the text names who and why."""


class NonFiniteSupervision(RemoteTargetError):
    """A batch's supervision held NaN or Inf, so the worker did not send it; the text names the batch, the tensor, the
    first row and position, and the layer. ``tensor``, ``index`` (row and position first), ``value`` and ``layer``
    say the same as fields. A rank made with ``on_nonfinite="skip"`` leaves such batches out of ``iterate()``."""

    def __init__(self, message: str, *, tensor: str, index: tuple[int, ...], value: str, layer: int | None = None) -> None:
        super().__init__(message)
        self.tensor = tensor
        self.index = index
        self.value = value
        self.layer = layer


class RemoteTargetTimeout(RemoteTargetError, TimeoutError):
    """No answer came within the configured time."""


class TargetClosed(DraftfeedError):
    """The remote target was closed while a request was outstanding."""


class BadRequest(DraftfeedError, ValueError):
    """A request cannot be served as sent (its tensors, its vocab mapping); the text tells the rank what to fix."""


class UsageError(DraftfeedError, ValueError):
    """An ordinary mistake in how draftfeed is called or set up (a flag, a key file, an address): the command line
    prints its text as one line and exits with code 2."""


class CannotServe(DraftfeedError):
    """A broker or worker cannot start or go on for a reason that is not a bug (no broker answered, registration
    refused): the command line prints its text as one line and exits with code 1."""
