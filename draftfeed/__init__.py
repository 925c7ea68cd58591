"""draftfeed: frozen-target supervision for speculative-decoding drafts, served over ZeroMQ.

The public names load on first use, so that ``import draftfeed`` (and a broker, which needs none of them)
stays cheap: the rank's classes bring torch with them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> the module that defines it
_PUBLIC = {
    "RemoteTarget": "draftfeed.producers.tasks.base",
    "RemoteEagle3Target": "draftfeed.producers.tasks.eagle3",
    "RemoteDSparkTarget": "draftfeed.producers.tasks.dspark",
    "RemoteDFlashTarget": "draftfeed.producers.tasks.dflash",
    "RemoteEagleTarget": "draftfeed.producers.tasks.eagle",
    "RemoteVispecTarget": "draftfeed.producers.tasks.vispec",
    "Eagle3Supervision": "draftfeed.contract.supervision",
    "DSparkSupervision": "draftfeed.contract.supervision",
    "DFlashSupervision": "draftfeed.contract.supervision",
    "EagleSupervision": "draftfeed.contract.supervision",
    "VispecSupervision": "draftfeed.contract.supervision",
    "Eagle3TargetInfo": "draftfeed.schemas.messages",
    "DSparkTargetInfo": "draftfeed.schemas.messages",
    "DFlashTargetInfo": "draftfeed.schemas.messages",
    "EagleTargetInfo": "draftfeed.schemas.messages",
    "VispecTargetInfo": "draftfeed.schemas.messages",
    "DraftfeedError": "draftfeed.schemas.errors",
    "MalformedMessage": "draftfeed.schemas.errors",
    "NonFiniteSupervision": "draftfeed.schemas.errors",
    "RemoteTargetError": "draftfeed.schemas.errors",
    "RemoteTargetTimeout": "draftfeed.schemas.errors",
    "TargetClosed": "draftfeed.schemas.errors",
    "reexec_with_hugepage_malloc": "draftfeed.dataplane.frames.rank",
    "publish_weights": "draftfeed.target_updates",
    "update_target": "draftfeed.target_updates",
}
__all__ = [
    "DFlashSupervision",
    "DFlashTargetInfo",
    "DSparkSupervision",
    "DSparkTargetInfo",
    "DraftfeedError",
    "Eagle3Supervision",
    "Eagle3TargetInfo",
    "EagleSupervision",
    "EagleTargetInfo",
    "MalformedMessage",
    "NonFiniteSupervision",
    "RemoteDFlashTarget",
    "RemoteDSparkTarget",
    "RemoteEagle3Target",
    "RemoteEagleTarget",
    "RemoteTarget",
    "RemoteTargetError",
    "RemoteTargetTimeout",
    "RemoteVispecTarget",
    "TargetClosed",
    "VispecSupervision",
    "VispecTargetInfo",
    "publish_weights",
    "reexec_with_hugepage_malloc",
    "update_target",
]

if TYPE_CHECKING:
    from draftfeed.contract.supervision import DFlashSupervision, DSparkSupervision, Eagle3Supervision, EagleSupervision, VispecSupervision
    from draftfeed.dataplane.frames.rank import reexec_with_hugepage_malloc
    from draftfeed.producers.tasks import (
        RemoteDFlashTarget,
        RemoteDSparkTarget,
        RemoteEagle3Target,
        RemoteEagleTarget,
        RemoteTarget,
        RemoteVispecTarget,
    )
    from draftfeed.schemas.errors import DraftfeedError, MalformedMessage, NonFiniteSupervision, RemoteTargetError, RemoteTargetTimeout, TargetClosed
    from draftfeed.schemas.messages import DFlashTargetInfo, DSparkTargetInfo, Eagle3TargetInfo, EagleTargetInfo, VispecTargetInfo
    from draftfeed.target_updates import publish_weights, update_target


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'draftfeed' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_PUBLIC])
