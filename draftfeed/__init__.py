"""draftfeed: frozen-target supervision for speculative-decoding drafts, served over ZeroMQ."""

from draftfeed.producers.fast_receive import reexec_with_hugepage_malloc
from draftfeed.producers.remote_target import RemoteDSparkTarget, RemoteEagle3Target, RemoteTarget
from draftfeed.schemas.errors import DraftfeedError, MalformedMessage, RemoteTargetError, RemoteTargetTimeout, TargetClosed
from draftfeed.schemas.messages import DSparkTargetInfo, Eagle3TargetInfo
from draftfeed.schemas.supervision import DSparkSupervision, Eagle3Supervision

__version__ = "0.1.0"

__all__ = [
    "DSparkSupervision",
    "DSparkTargetInfo",
    "DraftfeedError",
    "Eagle3Supervision",
    "Eagle3TargetInfo",
    "MalformedMessage",
    "RemoteDSparkTarget",
    "RemoteEagle3Target",
    "RemoteTarget",
    "RemoteTargetError",
    "RemoteTargetTimeout",
    "TargetClosed",
    "reexec_with_hugepage_malloc",
]
