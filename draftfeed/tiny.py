"""Tiny random-weight targets, built locally for the demo and the tests (no download needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

MOE_ARCHS = ("qwen3-moe", "mixtral", "gpt-oss", "deepseek-v3", "glm4-moe", "qwen3-next")


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
    soft-capping; ``gemma3-multimodal`` an image-text model (its text config under ``config.text_config``); the
    mixture-of-experts families of ``MOE_ARCHS`` (4 experts, 2 per token; DeepSeek-V3 with its multi-head latent
    attention, Qwen3-Next with its hybrid linear attention). Each loads back with
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
    elif arch in MOE_ARCHS:
        config = _moe_config(arch, common)
    else:
        raise ValueError(f"unknown tiny architecture {arch!r}; choose llama, qwen3, gemma3, gemma3-multimodal or one of {', '.join(MOE_ARCHS)}")
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    path = Path(path)
    model.save_pretrained(path)
    return path


def _moe_config(arch: str, common: dict[str, Any]) -> Any:
    """A tiny config of a mixture-of-experts family: 4 experts of width hidden/2, 2 routed per token."""
    import transformers

    hidden = common["hidden_size"]
    experts = dict(num_experts_per_tok=2, moe_intermediate_size=hidden // 2)
    if arch == "qwen3-moe":
        return transformers.Qwen3MoeConfig(**common, **experts, num_experts=4, decoder_sparse_step=1)
    if arch == "mixtral":
        return transformers.MixtralConfig(**{k: v for k, v in common.items() if k != "head_dim"}, num_local_experts=4, num_experts_per_tok=2)
    if arch == "gpt-oss":
        layers = common["num_hidden_layers"]
        return transformers.GptOssConfig(
            **common,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=16,
            layer_types=["sliding_attention", "full_attention"] * (layers // 2),
        )
    if arch == "deepseek-v3":
        return transformers.DeepseekV3Config(
            **{k: v for k, v in common.items() if k != "head_dim"},
            **experts,
            n_routed_experts=4,
            n_shared_experts=1,
            n_group=1,
            topk_group=1,
            first_k_dense_replace=1,
            q_lora_rank=32,
            kv_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=16,
        )
    if arch == "glm4-moe":
        return transformers.Glm4MoeConfig(
            **common, **experts, n_routed_experts=4, n_shared_experts=1, n_group=1, topk_group=1, first_k_dense_replace=1
        )
    layers = common["num_hidden_layers"]
    return transformers.Qwen3NextConfig(
        **common,
        **experts,
        num_experts=4,
        shared_expert_intermediate_size=hidden // 2,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"] * (layers // 4),
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
    )
