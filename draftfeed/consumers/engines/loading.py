"""How the hf engine and TargetHead load a target: the class that takes its config, and its text decoder's parts.

- The config is read by transformers' own class for the checkpoint's architecture: another library imported in the
  same process may register a config class of its own for a model type transformers implements (NeMo AutoModel does,
  for DeepSeek-V4 among others), which transformers' model would then be built from, and fail.
- A config transformers' image-text auto class takes (Qwen2.5-VL, Qwen3-VL, Gemma 3, Llama 4, ...) is loaded with
  ``AutoModelForImageTextToText``: ``AutoModelForCausalLM`` refuses some of them and silently drops the vision
  tower of others (a Llama 4 image-text checkpoint loads as its text model). Any other config with
  ``AutoModelForCausalLM``. A config neither takes is one line naming its model type and the classes tried.
- The text decoder (its layer list and final norm) is found breadth-first from ``get_decoder()`` through
  ``language_model``, ``text_model`` and ``model``: one rule for causal LMs and image-text models alike (Llama 4's
  ``get_decoder()`` returns the model itself; its image-text form nests the decoder two levels down). The vision
  tower's own ``layers`` are never reached: it hangs off other attributes.
- A text-only forward runs the model's own forward, except where the model nests a whole causal LM
  (``language_model`` with its own lm_head, as Llama 4's image-text model does): that one runs it, the same
  computation for text (and transformers 5.24's Llama 4 image-text forward fails at its return).
"""

from __future__ import annotations

from typing import Any

from torch import nn

TRIED = ("AutoModelForImageTextToText", "AutoModelForCausalLM")


def auto_class(config: Any) -> Any:
    """The transformers auto class that loads a target of ``config``; ValueError naming what was tried if none does."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING, MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING

    if type(config) in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING:
        return AutoModelForImageTextToText
    if type(config) in MODEL_FOR_CAUSAL_LM_MAPPING:
        return AutoModelForCausalLM
    return _refuse(config)


def _refuse(config: Any) -> Any:
    raise ValueError(
        f"model type {getattr(config, 'model_type', type(config).__name__)!r} ({', '.join(getattr(config, 'architectures', None) or ['no architectures named'])}) "
        f"is a text decoder for neither {' nor '.join(TRIED)} in this transformers: serve a causal language model or an image-text model"
    )


def transformers_config(target: str) -> Any:
    """``target``'s config as transformers' own class for the architecture it names reads it; ``AutoConfig`` where it
    names none transformers has (whatever another library registered for its model type is then read)."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    raw, _ = transformers.PretrainedConfig.get_config_dict(target)
    for name in raw.get("architectures") or []:
        config_class = getattr(getattr(transformers, name, None), "config_class", None)
        if config_class is not None and getattr(config_class, "model_type", None) == raw.get("model_type"):
            return config_class.from_pretrained(target)
    model_type = raw.get("model_type")
    if model_type is not None and model_type not in CONFIG_MAPPING:
        architectures = ", ".join(raw.get("architectures") or ["no architectures named"])
        raise ValueError(
            f"{target}: model type {model_type!r} ({architectures}) is not implemented by transformers {transformers.__version__}, "
            "whose implementations the hf engine runs: serve it with an engine that implements it (--engine automodel for NeMo "
            "AutoModel's own model types, vllm, sglang)"
        )
    return transformers.AutoConfig.from_pretrained(target)


def load_target(target: str, config: Any = None, **kwargs: Any) -> nn.Module:
    """``from_pretrained`` of the class ``auto_class`` picks, with ``kwargs`` (dtype, placement)."""
    config = config if config is not None else transformers_config(target)
    return auto_class(config).from_pretrained(target, config=config, **kwargs)


def text_decoder(model: nn.Module) -> nn.Module:
    """The text decoder of a causal LM or of an image-text model: the first module with a ``layers`` list."""
    seen: set[int] = set()
    queue: list[Any] = [model.get_decoder() if hasattr(model, "get_decoder") else None, model]
    while queue:
        candidate = queue.pop(0)
        if candidate is None or id(candidate) in seen:
            continue
        seen.add(id(candidate))
        if isinstance(getattr(candidate, "layers", None), nn.ModuleList):
            return candidate
        queue += [getattr(candidate, name, None) for name in ("language_model", "text_model", "model")]
    raise ValueError(f"cannot find the text decoder layers of {type(model).__name__} (searched get_decoder(), language_model, text_model, model)")


def text_forward(model: nn.Module) -> nn.Module:
    """The module whose forward computes a text-only batch: the model, or the whole causal LM it nests."""
    nested = getattr(model, "language_model", None)
    if isinstance(nested, nn.Module) and nested is not model and hasattr(nested, "get_output_embeddings"):
        if nested.get_output_embeddings() is not None:
            return nested
    return model
