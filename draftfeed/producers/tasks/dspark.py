"""DSpark's client on the rank: the hidden states of chosen target layers and the post-norm last hidden state,
as the worker sends them (the rank keeps its own input_ids and loss_mask)."""

from __future__ import annotations

from draftfeed.contract.supervision import DSparkSupervision
from draftfeed.producers.tasks.base import RemoteTarget
from draftfeed.schemas.messages import DSparkTargetInfo


class RemoteDSparkTarget(RemoteTarget[DSparkSupervision, DSparkTargetInfo]):
    """DSpark supervision: the hidden states of chosen target layers and the post-norm last hidden state."""

    TASK = "dspark"
    SUPERVISION = DSparkSupervision
    INFO = DSparkTargetInfo
