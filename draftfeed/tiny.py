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
    seed: int = 0,
) -> Path:
    """Save a random-weight causal LM (``llama`` or ``qwen3``) to ``path`` and return the folder.

    Loaded back with ``AutoModelForCausalLM.from_pretrained(path)``, the same way a real target is.
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
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    configs = {"llama": LlamaConfig, "qwen3": Qwen3Config}
    if arch not in configs:
        raise ValueError(f"unknown tiny architecture {arch!r}; choose one of {', '.join(configs)}")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(configs[arch](**common), dtype=torch.float32)
    path = Path(path)
    model.save_pretrained(path)
    return path
