"""NeMo AutoModel's draft recipes on draftfeed, their code unchanged (docs/nemo.md).

``use_draftfeed()`` is the one call: after it, a recipe whose config has ``recipe_args.target_model_backend: remote``
and ``remote_urls: ["draftfeed://HOST:PORT/SERVICE?OPTION=VALUE"]`` takes its frozen target's supervision from that
service's workers and loads no target weights:

- ``train_eagle3`` through its own remote backend (``eagle3.py``: ``DraftfeedEagle3TargetModel``);
- ``train_dflash``, ``train_dflash2``, ``train_domino``, ``train_jetspec`` (task ``dflash``), ``train_eagle1``,
  ``train_eagle2`` and ViSpec's first stage (task ``eagle``), ViSpec's second stage (task ``vispec``) and
  ``train_dspark`` (task ``dspark``) through their target wrappers (``recipes.py``, ``wrappers.py``, ``standin.py``).

Importing this package does not import NeMo: ``use_draftfeed()`` does, and the adapters' constructors.
"""

from __future__ import annotations

from draftfeed.integrations.nemo.eagle3 import DraftfeedEagle3TargetModel, PendingSupervision
from draftfeed.integrations.nemo.standin import DraftfeedTargetModel
from draftfeed.integrations.nemo.wrappers import (
    DraftfeedDFlashTarget,
    DraftfeedDSparkTarget,
    DraftfeedEagleTarget,
    DraftfeedVispecTarget,
    DraftfeedWrapper,
)
from draftfeed.integrations.url import DraftfeedUrl, is_draftfeed_url


def use_draftfeed() -> None:
    """Make NeMo AutoModel's recipes take their target from draftfeed where their config names a draftfeed:// URL
    (``recipe_args.target_model_backend: remote``, ``recipe_args.remote_urls``), and leave every other config to
    NeMo. Call it once, before the recipe's ``setup()``; calling it again changes nothing."""
    from draftfeed.integrations.nemo import eagle3, recipes

    eagle3.patch()
    recipes.patch()


__all__ = [
    "DraftfeedDFlashTarget",
    "DraftfeedDSparkTarget",
    "DraftfeedEagle3TargetModel",
    "DraftfeedEagleTarget",
    "DraftfeedTargetModel",
    "DraftfeedUrl",
    "DraftfeedVispecTarget",
    "DraftfeedWrapper",
    "PendingSupervision",
    "is_draftfeed_url",
    "use_draftfeed",
]
