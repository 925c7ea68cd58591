"""Each task's client on the rank, one module a task over one base (base.py), mirroring consumers/tasks/ on the
worker: a sixth task is one module here, one there, and its section of docs/contract.md."""

from __future__ import annotations

from draftfeed.producers.tasks.base import RemoteTarget
from draftfeed.producers.tasks.dflash import RemoteDFlashTarget
from draftfeed.producers.tasks.dspark import RemoteDSparkTarget
from draftfeed.producers.tasks.eagle import RemoteEagleTarget
from draftfeed.producers.tasks.eagle3 import RemoteEagle3Target
from draftfeed.producers.tasks.vispec import RemoteVispecTarget

__all__ = ["RemoteDFlashTarget", "RemoteDSparkTarget", "RemoteEagle3Target", "RemoteEagleTarget", "RemoteTarget", "RemoteVispecTarget"]
