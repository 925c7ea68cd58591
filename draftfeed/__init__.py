"""draftfeed: frozen-target supervision for speculative-decoding drafts, served over ZeroMQ."""

from draftfeed.producers.remote_target import RemoteEagle3Target
from draftfeed.schemas.errors import DraftfeedError, MalformedMessage, RemoteTargetError, RemoteTargetTimeout, TargetClosed
from draftfeed.schemas.messages import Eagle3TargetInfo
from draftfeed.schemas.supervision import Eagle3Supervision

__version__ = "0.1.0"

__all__ = [
    "DraftfeedError",
    "Eagle3Supervision",
    "Eagle3TargetInfo",
    "MalformedMessage",
    "RemoteEagle3Target",
    "RemoteTargetError",
    "RemoteTargetTimeout",
    "TargetClosed",
]
