"""Tiny random-weight targets, built locally for the demo and the tests (no download needed)."""

from __future__ import annotations

from pathlib import Path


def build_tiny_target(
    path: str | Path,
    *,
    arch: str = "llama",
    num_hidden_layers: int = 8,
    hidden_size: int = 64,
    vocab_size: int = 1000,
    max_position_embeddings: int = 4096,
    seed: int = 0,
) -> Path:
    """Save a random-weight causal LM to ``path`` and return the folder.

    ``llama`` and ``qwen3`` are text models; ``gemma3`` a text model with scaled embeddings and logit
    soft-capping; ``gemma3-multimodal`` an image-text model (its text config under ``config.text_config``). Each loads back with
    ``AutoModelForCausalLM.from_pretrained(path)``, the same way a real target is.
    """
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden_size // 4,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    if arch in ("llama", "qwen3"):
        config = (LlamaConfig if arch == "llama" else Qwen3Config)(**common)
    elif arch == "gemma3":
        from transformers import Gemma3TextConfig

        config = Gemma3TextConfig(**common, sliding_window=16, final_logit_softcapping=30.0)
    elif arch == "gemma3-multimodal":
        from transformers import Gemma3Config, Gemma3TextConfig, SiglipVisionConfig

        text = Gemma3TextConfig(**common, sliding_window=16, final_logit_softcapping=30.0)
        vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=32, patch_size=8)
        config = Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(), mm_tokens_per_image=4)
    else:
        raise ValueError(f"unknown tiny architecture {arch!r}; choose llama, qwen3, gemma3 or gemma3-multimodal")
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    path = Path(path)
    model.save_pretrained(path)
    return path
