"""A weight update published from this process straight into an engine in this process (no broker, no worker): the
publisher's socket and the engine's own pull, as a worker's update runs them."""

from __future__ import annotations

import torch

from draftfeed.dataplane.weights.publisher import WeightsPublisher
from draftfeed.schemas.messages import UpdateWeights


def publish_into(engine, tensors: dict[str, torch.Tensor], update: int, chunk_bytes: int = 4096) -> None:
    """``engine.update_weights`` of ``tensors``, pulled from a publisher of this process (update number ``update``,
    served as target version ``update``)."""
    publisher = WeightsPublisher(tensors, "tcp://127.0.0.1:*", chunk_bytes)
    publisher.start()
    try:
        engine.update_weights(UpdateWeights(update=update, source=publisher.endpoint, target_version=update), check_finite=True, timeout_s=60)
    finally:
        publisher.stop()
