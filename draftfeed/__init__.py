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
    "RemoteTarget": "draftfeed.producers.remote_target",
    "RemoteEagle3Target": "draftfeed.producers.remote_target",
    "RemoteDSparkTarget": "draftfeed.producers.remote_target",
    "Eagle3Supervision": "draftfeed.contract.supervision",
    "DSparkSupervision": "draftfeed.contract.supervision",
    "Eagle3TargetInfo": "draftfeed.schemas.messages",
    "DSparkTargetInfo": "draftfeed.schemas.messages",
    "DraftfeedError": "draftfeed.schemas.errors",
    "MalformedMessage": "draftfeed.schemas.errors",
    "RemoteTargetError": "draftfeed.schemas.errors",
    "RemoteTargetTimeout": "draftfeed.schemas.errors",
    "TargetClosed": "draftfeed.schemas.errors",
    "reexec_with_hugepage_malloc": "draftfeed.producers.fast_receive",
}
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

if TYPE_CHECKING:
    from draftfeed.contract.supervision import DSparkSupervision, Eagle3Supervision
    from draftfeed.producers.fast_receive import reexec_with_hugepage_malloc
    from draftfeed.producers.remote_target import RemoteDSparkTarget, RemoteEagle3Target, RemoteTarget
    from draftfeed.schemas.errors import DraftfeedError, MalformedMessage, RemoteTargetError, RemoteTargetTimeout, TargetClosed
    from draftfeed.schemas.messages import DSparkTargetInfo, Eagle3TargetInfo


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'draftfeed' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_PUBLIC])
