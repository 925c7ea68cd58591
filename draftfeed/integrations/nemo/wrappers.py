"""NeMo's target wrappers, served by draftfeed: what a recipe gets where it builds ``HFDFlashTargetModel``,
``HFEagleTargetModel``, ``HFVispecTargetModel`` or ``HFDSparkTargetModel`` around a ``DraftfeedTargetModel``.

Each takes the wrapper's own arguments, checks them against what the service's workers serve (the target's sizes,
the layer ids, JetSpec's logits, ViSpec's image token) and answers ``generate_batch`` with NeMo's own batch dataclass,
filled from the draftfeed client's supervision (whose fields carry the batch's names). ``target`` is the client.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, ClassVar

from torch import nn

from draftfeed.integrations.nemo.standin import DraftfeedTargetModel
from draftfeed.producers.outgoing import takes_arguments_of
from draftfeed.producers.tasks.base import RemoteTarget


class DraftfeedWrapper:
    """What the four wrappers share: the stand-in model, the client, NeMo's batch type, ``get_input_embeddings()``."""

    TASK: ClassVar[str]
    NEMO: ClassVar[str]  # the NeMo wrapper this one stands for

    def __init__(self, model: DraftfeedTargetModel, batch_type: type, expected: Any) -> None:
        if model.task != self.TASK:
            raise ValueError(
                f"{model.recipe} builds NeMo's {self.NEMO}, which needs a service of task {self.TASK!r}, but draftfeed "
                f"serves this recipe's target as task {model.task!r} ({model.url})"
            )
        self.model = model
        self.target = model.client
        self._batch_type = batch_type
        self._fields = tuple(field.name for field in dataclasses.fields(batch_type))
        try:
            self.target.check_target_info(expected)
        except ValueError as exc:
            raise ValueError(f"{model.recipe}: {exc}: {self._remedy()}") from None

    def _remedy(self) -> str:
        """What a refusal of the service's target tells the user to do (the layer ids are set before it is asked)."""
        return "start the service's workers for this recipe's target and settings, or change recipe_args"

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.get_input_embeddings()

    @takes_arguments_of(RemoteTarget.generate_batch_async)
    def generate_batch(self, *args: Any, **kwargs: Any) -> Any:
        """NeMo's batch of this wrapper's task, with the packing arguments of a packed batch and the image inputs of an
        image-text one, as NeMo's wrappers take them (the client's ``generate_batch``: ViSpec refuses packed rows)."""
        return self._to_nemo(self.target.generate_batch(*args, **kwargs))

    def _to_nemo(self, supervision: Any) -> Any:
        given = supervision.as_dict()
        return self._batch_type(**{name: given[name] for name in self._fields if name in given})

    def close(self) -> None:
        self.target.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(url={self.model.url!r})"


class DraftfeedDFlashTarget(DraftfeedWrapper):
    """NeMo's ``HFDFlashTargetModel`` (DFlash, DFlash2, Domino; JetSpec with ``capture_logits=True``) on a ``dflash``
    service: ``generate_batch`` gives ``DFlashTargetBatch``. The service's ``--target-layer-ids`` must be the recipe's
    ``target_layer_ids`` and its ``--capture-logits`` the wrapper's ``capture_logits``."""

    TASK = "dflash"
    NEMO = "HFDFlashTargetModel"

    def __init__(self, model: DraftfeedTargetModel, target_layer_ids: Sequence[int], capture_logits: bool = False, cp_mesh: Any = None) -> None:
        from nemo_automodel.components.speculative.dflash.target import DFlashTargetBatch

        from draftfeed.schemas.messages import DFlashTargetInfo

        self.target_layer_ids = [int(i) for i in target_layer_ids]
        self.capture_logits = bool(capture_logits)
        self.cp_mesh = cp_mesh  # the recipe's; the workers run the whole sequence
        expected = DFlashTargetInfo.from_text_config(model.config, self.target_layer_ids, capture_logits=self.capture_logits)
        super().__init__(model, DFlashTargetBatch, expected)

    def get_output_embeddings(self) -> nn.Linear:
        return self.model.get_output_embeddings()


class DraftfeedEagleTarget(DraftfeedWrapper):
    """NeMo's ``HFEagleTargetModel`` (EAGLE-1, EAGLE-2, ViSpec's text-only first stage) on an ``eagle`` service:
    ``generate_batch`` gives ``EagleTargetBatch``; ``get_lm_head()`` the target's lm_head."""

    TASK = "eagle"
    NEMO = "HFEagleTargetModel"

    def __init__(self, model: DraftfeedTargetModel) -> None:
        from nemo_automodel.components.speculative.eagle.target_v12 import EagleTargetBatch

        from draftfeed.schemas.messages import EagleTargetInfo

        super().__init__(model, EagleTargetBatch, EagleTargetInfo.from_text_config(model.config))

    def get_lm_head(self) -> nn.Linear:
        return self.model.get_output_embeddings()


class DraftfeedVispecTarget(DraftfeedWrapper):
    """NeMo's ``HFVispecTargetModel`` (ViSpec's second stage) on a ``vispec`` service: ``generate_batch`` takes the
    processor's image tensors by name and gives ``VispecTargetBatch``; the service's image token must be the
    recipe's ``image_token_id``."""

    TASK = "vispec"
    NEMO = "HFVispecTargetModel"

    def __init__(self, model: DraftfeedTargetModel, *, image_token_id: int) -> None:
        from nemo_automodel.components.speculative.eagle.vispec_target import VispecTargetBatch

        from draftfeed.schemas.messages import VispecTargetInfo

        self.image_token_id = int(image_token_id)
        super().__init__(model, VispecTargetBatch, VispecTargetInfo.from_text_config(model.config, image_token_id=self.image_token_id))

    def get_lm_head(self) -> nn.Linear:
        return self.model.get_output_embeddings()


class DraftfeedDSparkTarget(DraftfeedWrapper):
    """NeMo's ``HFDSparkTargetModel`` on a ``dspark`` service: ``generate_batch`` gives ``DSparkTargetBatch``; the
    service's ``--target-layer-ids`` must be the recipe's."""

    TASK = "dspark"
    NEMO = "HFDSparkTargetModel"

    def __init__(self, model: DraftfeedTargetModel, target_layer_ids: Sequence[int], cp_mesh: Any = None) -> None:
        from nemo_automodel.components.speculative.dspark.target import DSparkTargetBatch

        from draftfeed.schemas.messages import DSparkTargetInfo

        self.target_layer_ids = [int(i) for i in target_layer_ids]
        self.cp_mesh = cp_mesh
        super().__init__(model, DSparkTargetBatch, DSparkTargetInfo.from_text_config(model.config, self.target_layer_ids))

    def get_output_embeddings(self) -> nn.Linear:
        return self.model.get_output_embeddings()


__all__ = ["DraftfeedDFlashTarget", "DraftfeedDSparkTarget", "DraftfeedEagleTarget", "DraftfeedVispecTarget", "DraftfeedWrapper"]
