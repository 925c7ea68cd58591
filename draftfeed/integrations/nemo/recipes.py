"""NeMo AutoModel's DFlash, EAGLE-1/2, ViSpec and DSpark recipes, and P-EAGLE (peagle.py), on draftfeed, their code
unchanged.

These recipes have no remote backend: each loads its frozen target itself (DFlash in ``_build_target_model``, the
others inline in ``setup()``) and wraps it in one of NeMo's target wrappers. ``patch()`` adds three things, each inert
unless a recipe's config asks for draftfeed (``recipe_args.target_model_backend: remote`` and
``recipe_args.remote_urls: ["draftfeed://HOST:PORT/SERVICE"]``, the keys of the EAGLE-3 recipe):

1. each recipe class's ``setup`` is wrapped: the config is checked first (one ValueError for a wrong URL or a setting
   draftfeed cannot honour), and while the recipe's own ``setup`` runs, the recipe's draftfeed target is in force;
2. ``NeMoAutoModelForCausalLM.from_pretrained`` and transformers' ``AutoModelForImageTextToText.from_pretrained``,
   asked for that recipe's ``target_model_name_or_path`` while its target is in force, return a
   ``DraftfeedTargetModel`` (a client of the service, no weights) instead of loading the model;
3. NeMo's four target wrappers, built around a ``DraftfeedTargetModel``, give draftfeed's wrapper of the same task
   (``wrappers.py``) instead of themselves; around any other model they are NeMo's own;
4. the DSpark recipe's builders of its frontier targets (DeepSeek-V4, GLM-5.2, Kimi-K3), asked for its target while
   it is in force, read the target's config as NeMo's own builder does and return the stand-in, no process group and
   no weights (``FRONTIER_BUILDERS``), and so does DeepSeek-V4.1's target options' ``build`` (DeepSeek-V4.1 and Kimi-K3
   are served by workers of ``--engine automodel``, Kimi-K3 on GPUs only); the image-text MiniMax-M3 path is refused
   in one line.

After the recipe's ``setup`` returns, its ``target_wrapper`` must be draftfeed's, or the run stops there.
"""

from __future__ import annotations

import contextvars
import functools
import importlib
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

from draftfeed.integrations.nemo import peagle
from draftfeed.integrations.nemo.standin import DraftfeedTargetModel
from draftfeed.integrations.nemo.wrappers import (
    DraftfeedDFlashTarget,
    DraftfeedDSparkTarget,
    DraftfeedEagleTarget,
    DraftfeedVispecTarget,
    DraftfeedWrapper,
)
from draftfeed.integrations.url import SCHEME, DraftfeedUrl, is_draftfeed_url, listed_urls, one_url
from draftfeed.schemas.messages import CLIENTS

log = logging.getLogger("draftfeed.nemo")

RECIPES = "nemo_automodel.recipes.llm"
# (module, class, the task its target is served as). A subclass inherits its parent's setup (DFlash2, Domino and
# JetSpec call TrainDFlashRecipe's, EAGLE-2 is TrainEagle1Recipe's); the ViSpec stages write their own.
RECIPE_TASKS = (
    ("train_dflash", "TrainDFlashRecipe", "dflash"),
    ("train_eagle1", "TrainEagle1Recipe", "eagle"),
    ("train_vispec", "TrainVispecStage1Recipe", "eagle"),
    ("train_vispec", "TrainVispecRecipe", "vispec"),
    ("train_dspark", "TrainDSparkRecipe", "dspark"),
    ("train_eagle3", "TrainEagle3Recipe", "dflash"),  # P-EAGLE only, on the recipe's colocated path (peagle.py)
)
# Recipes draftfeed serves for some of their configs only, on another of their paths: the module that says which
# configs, and what the recipe's own setup runs within (peagle.served_path).
PARTLY_SERVED = {"TrainEagle3Recipe": peagle}
SPECULATIVE = "nemo_automodel.components.speculative"
WRAPPERS = (
    (f"{SPECULATIVE}.dflash.target", "HFDFlashTargetModel", DraftfeedDFlashTarget),
    (f"{SPECULATIVE}.eagle.target_v12", "HFEagleTargetModel", DraftfeedEagleTarget),
    (f"{SPECULATIVE}.eagle.vispec_target", "HFVispecTargetModel", DraftfeedVispecTarget),
    (f"{SPECULATIVE}.dspark.target", "HFDSparkTargetModel", DraftfeedDSparkTarget),
    (f"{SPECULATIVE}.eagle.target", "HFEagle3TargetModel", peagle.DraftfeedPeagleTarget),
)
LOADERS = (
    ("nemo_automodel._transformers", "NeMoAutoModelForCausalLM"),
    ("nemo_automodel._transformers", "NeMoAutoModelForImageTextToText"),  # DSpark's MiniMax-M3 (text batches)
    ("transformers", "AutoModelForImageTextToText"),
)
# The DSpark recipe's own builders of its frontier targets that transformers implements too (so draftfeed's workers
# serve them), by their names in train_dspark; ``_frontier_config`` reads each one's config as the builder does.
FRONTIER_BUILDERS = ("build_deepseek_v4_target", "build_glm_5_2_target", "build_kimi_k3_target")
# DeepSeek-V4.1's target options (its ``build`` gives the stand-in while the recipe's draftfeed target is in force; a
# worker of --engine automodel serves it).
V41_TARGET = ("nemo_automodel.components.models.deepseek_v41.config", "DeepseekV41DSparkTargetConfig")
# Axes of the `distributed:` section that shard the target: draftfeed's workers hold it, so none applies.
TARGET_AXES = ("tp_size", "cp_size", "pp_size", "ep_size")
DEFAULT_TIMEOUT = 120.0  # recipe_args.remote_timeout's default, as the EAGLE-3 recipe has it
_MARK = "_draftfeed_patched"
_ACTIVE: contextvars.ContextVar[RecipeTarget | None] = contextvars.ContextVar("draftfeed_recipe_target", default=None)


@dataclass
class RecipeTarget:
    """One recipe's draftfeed target while its ``setup`` runs: the URL, and the stand-in once loaded."""

    recipe: Any
    name: str  # the recipe class's name, for messages
    task: str
    url: DraftfeedUrl
    target_path: str
    models: list[DraftfeedTargetModel] = field(default_factory=list)

    @classmethod
    def of(cls, recipe: Any, task: str) -> RecipeTarget | None:
        """The recipe's draftfeed target if its config asks for one (None: NeMo's own target), or one ValueError
        saying what in the config to change."""
        name = type(recipe).__name__
        args = recipe.cfg.recipe_args
        if args.get("target_model_backend", None) != "remote":
            return None
        urls = args.get("remote_urls", None)
        listed = listed_urls(urls)
        if not listed:
            raise ValueError(
                f"{name}: recipe_args.target_model_backend is remote but remote_urls is empty: give one {SCHEME}://HOST:PORT/SERVICE URL"
            )
        others = [str(url) for url in listed if not is_draftfeed_url(url)]
        if others:
            raise ValueError(
                f"{name} has no remote backend of its own: recipe_args.remote_urls must be {SCHEME}://HOST:PORT/SERVICE URLs "
                f"(got {', '.join(others)}); use_draftfeed() serves this recipe's target from draftfeed"
            )
        url = one_url(listed, timeout=float(args.get("remote_timeout", DEFAULT_TIMEOUT)))
        for axis in TARGET_AXES:
            size = recipe.cfg.get(f"distributed.{axis}", 1) or 1
            if int(size) > 1:
                raise ValueError(
                    f"{name}: distributed.{axis}={size} shards the target, which draftfeed's workers hold ({url.text}): "
                    f"set it to 1 (the draft still trains data-parallel over all ranks)"
                )
        check = TASK_CHECKS.get(task)
        if check is not None:
            check(recipe, name, args)
        return cls(recipe=recipe, name=name, task=task, url=url, target_path=str(args.target_model_name_or_path))

    def loads(self, path: Any) -> bool:
        return str(path) == self.target_path

    def stand_in(self, path: Any, kwargs: dict[str, Any]) -> DraftfeedTargetModel:
        """The target model the recipe gets instead of loading ``path``: a client of the URL's service, on the
        recipe's device, with the config at ``path``."""
        if self.models:
            return self.models[0]
        from transformers import AutoConfig

        import draftfeed

        config = kwargs.get("config") or AutoConfig.from_pretrained(path, trust_remote_code=bool(kwargs.get("trust_remote_code", False)))
        client_type = getattr(draftfeed, CLIENTS[self.task])
        arguments = self.url.target_arguments()
        device = getattr(self.recipe, "device", None)
        if device is not None:
            arguments["device"] = device
        client = client_type(self.url.broker, self.url.service, **arguments)
        model = DraftfeedTargetModel(client, self.task, config, self.name, self.url.text)
        self.models.append(model)
        log.info("draftfeed: %s takes its target from %s (task %s); %s is read for its config only", self.name, self.url.text, self.task, path)
        return model

    def check_built(self, recipe: Any) -> None:
        wrapper = getattr(recipe, "target_wrapper", None)
        if not isinstance(wrapper, DraftfeedWrapper):
            raise RuntimeError(
                f"{self.name} built its target wrapper as {type(wrapper).__name__} without draftfeed, though its config names "
                f"{self.url.text}: this recipe (or its override of setup) loads its target in a way use_draftfeed() does not serve"
            )

    def close(self) -> None:
        for model in self.models:
            model.close()


def _dspark_checks(recipe: Any, name: str, args: Any) -> None:
    """An offline cache reads no target; the image-text MiniMax-M3 path is not served (yet)."""
    if args.get("cached_target_path", None):
        raise ValueError(f"{name}: recipe_args.cached_target_path reads precomputed supervision; a draftfeed target computes it: give one of the two")
    if args.get("multimodal", False):
        raise ValueError(
            f"{name}: recipe_args.multimodal (MiniMax M3 VL with images) is not served by draftfeed: train on text batches "
            "(multimodal: false) against a draftfeed target, or with the recipe's own target"
        )


def _frontier_config(builder: str, target_path: str, recipe_cfg: Any, trust_remote_code: bool) -> Any:
    """The target's config as the DSpark recipe's own ``builder`` reads it (its reduced depth included, which the
    service's target info then refuses), without loading anything else."""
    build = importlib.import_module(f"{RECIPES}._dspark_target_build")
    if builder == "build_deepseek_v4_target":
        revision = build.NeMoAutoConfig.resolve_revision(target_path)
        config = build.NeMoAutoConfig.from_pretrained(target_path, revision=revision, name_or_path=target_path, num_nextn_predict_layers=0)
    elif builder == "build_kimi_k3_target":  # the text model of the image-text checkpoint, as KimiK3ForCausalLM
        revision = build.NeMoAutoConfig.resolve_revision(target_path)
        config = build.NeMoAutoConfig.from_pretrained(target_path, revision=revision, trust_remote_code=trust_remote_code)
        config = getattr(config, "text_config", config)
        config.architectures, config.name_or_path = ["KimiK3ForCausalLM"], target_path
    else:
        from transformers import AutoConfig, PretrainedConfig

        config = AutoConfig.from_pretrained(target_path, trust_remote_code=trust_remote_code)
        raw, _ = PretrainedConfig.get_config_dict(target_path, trust_remote_code=trust_remote_code)
        build.repair_glm_5_2_qk_rope_head_dim(config, raw)
    reduced = build.resolve_reduced_target_layers(config.num_hidden_layers, recipe_cfg.get("target_num_hidden_layers", None))
    if reduced is not None:
        config.num_hidden_layers = reduced
    return config


TASK_CHECKS: dict[str, Callable[[Any, str, Any], None]] = {"dspark": _dspark_checks}


@contextmanager
def draftfeed_target(recipe: Any, task: str) -> Iterator[RecipeTarget | None]:
    """The recipe's draftfeed target in force for what runs inside (None, and nothing in force, when its config
    does not ask for one). The wrapped ``setup`` runs the recipe's own within it; tests run a recipe's
    target-building methods within it."""
    if _ACTIVE.get() is not None:  # a wrapped setup calling its parent's wrapped setup
        yield _ACTIVE.get()
        return
    target = RecipeTarget.of(recipe, task)
    if target is None:
        yield None
        return
    token = _ACTIVE.set(target)
    try:
        yield target
    except BaseException:
        target.close()
        raise
    finally:
        _ACTIVE.reset(token)


def _wrap_setup(recipe_class: type, task: str) -> None:
    original = recipe_class.__dict__["setup"]
    if getattr(original, _MARK, False):
        return
    partly = PARTLY_SERVED.get(recipe_class.__name__)

    @functools.wraps(original)
    def setup(self: Any, *args: Any, **kwargs: Any) -> Any:
        path = partly.served_path(self) if partly is not None else nullcontext()
        if path is None:  # a config of the recipe's own
            return original(self, *args, **kwargs)
        nested = _ACTIVE.get() is not None
        with draftfeed_target(self, task) as target, path:
            result = original(self, *args, **kwargs)
            if target is not None and not nested:
                target.check_built(self)
        return result

    setattr(setup, _MARK, True)
    recipe_class.setup = setup


def _patch_loader(loader: type) -> None:
    current = loader.__dict__.get("from_pretrained")
    if getattr(current, _MARK, False):
        return
    original = loader.from_pretrained.__func__  # the classmethod's function, wherever it is defined

    def from_pretrained(cls: type, path: Any, *args: Any, **kwargs: Any) -> Any:
        target = _ACTIVE.get()
        if target is not None and target.loads(path):
            return target.stand_in(path, kwargs)
        return original(cls, path, *args, **kwargs)

    from_pretrained.__doc__ = original.__doc__
    dispatch = classmethod(from_pretrained)
    setattr(dispatch, _MARK, True)
    loader.from_pretrained = dispatch


def _patch_builder(module: Any, builder: str) -> None:
    """The recipe module's ``builder`` (called by its global name) returns draftfeed's stand-in for the recipe's target
    while its draftfeed target is in force: (the config, the stand-in, no distributed setup), which the recipe keeps
    for its target only."""
    original = getattr(module, builder)
    if getattr(original, _MARK, False):
        return

    @functools.wraps(original)
    def build(*args: Any, **kwargs: Any) -> Any:
        target = _ACTIVE.get()
        path = kwargs.get("target_path")
        if target is None or not target.loads(path):
            return original(*args, **kwargs)
        config = _frontier_config(builder, str(path), kwargs["recipe_cfg"], bool(kwargs.get("trust_remote_code", False)))
        return config, target.stand_in(path, {"config": config}), None

    setattr(build, _MARK, True)
    setattr(module, builder, build)


def _patch_v41_target(module: Any) -> None:
    """DeepSeek-V4.1's target options (the DSpark recipe builds its target by their ``build``) give draftfeed's stand-in
    for the recipe's target while its draftfeed target is in force: the config as NeMo's ``build`` reads it, no
    weights, no process group. NeMo's own refusal of a reduced depth stands."""
    options = getattr(module, V41_TARGET[1])
    original = options.__dict__["build"]
    if getattr(original, _MARK, False):
        return

    @functools.wraps(original)
    def build(self: Any, *args: Any, **kwargs: Any) -> Any:
        target = _ACTIVE.get()
        if target is None or not target.loads(self.target_path):
            return original(self, *args, **kwargs)
        if self.target_num_hidden_layers is not None:
            raise ValueError(
                "DeepSeek V4.1 DSpark does not support target_num_hidden_layers (NeMo's own rule: the released target "
                "feature contract needs the whole depth); leave it out"
            )
        config = module.DeepseekV41Config.from_pretrained(self.target_path, name_or_path=self.target_path, vision_config={"num_hidden_layers": 0})
        return target.stand_in(self.target_path, {"config": config})

    setattr(build, _MARK, True)
    options.build = build


def _patch_wrapper(wrapper: type, ours: type[DraftfeedWrapper]) -> None:
    current = wrapper.__dict__.get("__new__")
    if getattr(current, _MARK, False):
        return

    def __new__(cls: type, *args: Any, **kwargs: Any) -> Any:
        model = args[0] if args else kwargs.get("model")
        if isinstance(model, DraftfeedTargetModel):
            return ours(*args, **kwargs)  # not an instance of cls: Python does not run cls.__init__ on it
        return object.__new__(cls)

    dispatch = staticmethod(__new__)
    setattr(dispatch, _MARK, True)
    wrapper.__new__ = dispatch


def patch() -> None:
    """Serve the recipes' targets from draftfeed where their config says so (module docstring). Idempotent."""
    for module_name, attribute in LOADERS:
        _patch_loader(getattr(importlib.import_module(module_name), attribute))
    for module_name, attribute, ours in WRAPPERS:
        _patch_wrapper(getattr(importlib.import_module(module_name), attribute), ours)
    for module_name, class_name, task in RECIPE_TASKS:
        _wrap_setup(getattr(importlib.import_module(f"{RECIPES}.{module_name}"), class_name), task)
    dspark = importlib.import_module(f"{RECIPES}.train_dspark")
    for builder in FRONTIER_BUILDERS:
        _patch_builder(dspark, builder)
    _patch_v41_target(importlib.import_module(V41_TARGET[0]))


__all__ = ["RECIPE_TASKS", "RecipeTarget", "draftfeed_target", "patch"]
