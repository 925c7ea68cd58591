"""What a NeMo recipe holds as ``self.target_model`` when draftfeed's workers hold the target.

The recipes read little of their target model besides handing it to their wrapper: ``config``, the input and output
embeddings, ``lm_head``, and ``to()`` / ``requires_grad_()`` / ``eval()`` / ``named_parameters()`` as on any module.
``DraftfeedTargetModel`` offers exactly that, with no weights but the two embeddings, fetched once from the service's
workers, and the target's config as the recipe's own ``target_model_name_or_path`` gives it. A forward is refused.
"""

from __future__ import annotations

from typing import Any

from torch import nn


class DraftfeedTargetModel(nn.Module):
    """The frozen target of a recipe, served by draftfeed: ``client`` (a ``draftfeed.Remote*Target`` of ``task``),
    ``config`` (the recipe's target config), ``get_input_embeddings()``, ``get_output_embeddings()`` and ``lm_head``
    (a frozen bias-free ``nn.Linear`` on the output embedding's weight). It registers no parameters, so ``to()`` and
    ``requires_grad_()`` change nothing: the embeddings are fetched onto the recipe's device, frozen."""

    def __init__(self, client: Any, task: str, config: Any, recipe: str, url: str) -> None:
        super().__init__()
        self.client = client
        self.task = task
        self.config = config
        self.recipe = recipe  # the recipe class's name, for messages
        self.url = url

    def get_input_embeddings(self) -> nn.Embedding:
        """The target's input embedding, frozen, fetched once."""
        return self.client.get_input_embeddings()

    def get_output_embeddings(self) -> nn.Linear:
        """The target's lm_head as a frozen ``nn.Linear`` without bias (weight [V, H]), fetched once; the client's, held
        outside this module's registry: nothing of the target is a parameter of anything the recipe trains."""
        return self.client.get_lm_head()

    @property
    def lm_head(self) -> nn.Linear:
        return self.get_output_embeddings()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(
            f"{self.recipe}'s target runs on draftfeed's workers ({self.url}): ask its target wrapper's generate_batch() "
            "for supervision; the stand-in target model has no layers to run"
        )

    def close(self) -> None:
        self.client.close()

    def extra_repr(self) -> str:
        return f"task={self.task!r}, url={self.url!r}"


__all__ = ["DraftfeedTargetModel"]
