"""Tiny random-weight targets, built locally for the demo and the tests (no download needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

MOE_ARCHS = ("qwen3-moe", "mixtral", "gpt-oss", "deepseek-v3", "glm4-moe", "qwen3-next")
IMAGE_TEXT_ARCHS = ("llama4", "qwen2.5-vl", "qwen3-vl-moe")  # besides gemma3-multimodal, which AutoModelForCausalLM loads
# Families whose decoder layers carry several residual streams (hyper-connections): a layer's output is [B, S, N, H]
HYPER_CONNECTION_ARCHS = ("deepseek-v4",)
# Frontier families of transformers 5.24 (sparse-attention indexers, hybrid linear attention, hyper-connections); the
# image-text ones (FRONTIER_IMAGE_TEXT_ARCHS) load with AutoModelForImageTextToText, the others with AutoModelForCausalLM
FRONTIER_ARCHS = ("deepseek-v32", "glm-moe-dsa", "glm5-next", "minimax-m2", "qwen3.5-moe", "kimi-k2.5", "minimax-m3-vl")
FRONTIER_IMAGE_TEXT_ARCHS = ("glm5-next", "kimi-k2.5", "minimax-m3-vl")


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
    """Save a random-weight target to ``path`` and return the folder.

    ``llama`` and ``qwen3`` are text models; ``gemma3`` a text model with scaled embeddings and logit soft-capping; the
    mixture-of-experts families of ``MOE_ARCHS`` (4 experts, 2 per token; DeepSeek-V3 with its multi-head latent
    attention in the real model's proportions, 16 experts in 8 groups, 4 per token, 3 dense layers first; Qwen3-Next
    with its hybrid linear attention); ``deepseek-v4`` (DeepSeek-V4's hyper-connections, 2 streams, its compressed and
    sparse attention and hash-routed first layer, 4 experts; its config written as DeepSeek's released checkpoints
    write it); ``llama4-text`` Llama 4's text model (Llama4ForCausalLM: 4 experts, 1 per token, in every layer; chunked
    attention over 16 tokens). These load back with ``AutoModelForCausalLM.from_pretrained(path)``, the same way a real
    target does.

    The image-text models (their text config under ``config.text_config``; image, video, vision start and end token
    ids ``vocab_size - 3, - 2, - 5, - 4``, inside the vocabulary): ``gemma3-multimodal`` (Gemma3ForConditionalGeneration,
    which ``AutoModelForCausalLM`` loads too; its image projection drawn at random, not zeros, so images matter);
    ``llama4`` (Llama4ForConditionalGeneration, whose text model is a nested Llama4ForCausalLM, as ``llama4-text``);
    ``qwen2.5-vl`` (Qwen2_5_VLForConditionalGeneration, M-RoPE); ``qwen3-vl-moe`` (Qwen3VLMoeForConditionalGeneration:
    4 experts, 2 per token, interleaved M-RoPE, deepstack features added after layer 0). These load back with
    ``AutoModelForImageTextToText.from_pretrained(path)`` (``AutoModelForCausalLM`` refuses the Qwen ones and loads
    only the text model of ``llama4``).

    The frontier families of ``FRONTIER_ARCHS`` (each helper below says what it keeps of the real model): the causal
    LMs ``deepseek-v32`` (DeepSeek-V3.2, sparse attention with its indexer), ``glm-moe-dsa`` (GLM-5), ``minimax-m2`` and
    ``qwen3.5-moe`` (Qwen3.5-MoE's text model) load back with ``AutoModelForCausalLM``; the image-text models of
    ``FRONTIER_IMAGE_TEXT_ARCHS``, ``glm5-next`` (GLM-5.3, whose layers carry 4 hyper-connection streams: [B, S, 4, H]),
    ``kimi-k2.5`` and ``minimax-m3-vl``, with ``AutoModelForImageTextToText`` (``AutoModelForCausalLM`` refuses them).
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, LlamaConfig, Qwen3Config
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
        config = Gemma3Config(
            text_config=text.to_dict(),
            vision_config=vision.to_dict(),
            mm_tokens_per_image=4,
            boi_token_index=vocab_size - 5,
            eoi_token_index=vocab_size - 4,
            image_token_index=vocab_size - 3,
        )
    elif arch == "llama4-text":
        config = _llama4_text_config(common)
    elif arch in MOE_ARCHS:
        config = _moe_config(arch, common)
    elif arch == "deepseek-v4":
        config = _deepseek_v4_config(common)
    elif arch in IMAGE_TEXT_ARCHS:
        config = _image_text_config(arch, common)
    elif arch in FRONTIER_ARCHS:
        config = _frontier_config(arch, common)
    else:
        choices = ", ".join(
            ("llama", "qwen3", "gemma3", "gemma3-multimodal", "llama4-text", *MOE_ARCHS, *HYPER_CONNECTION_ARCHS, *IMAGE_TEXT_ARCHS, *FRONTIER_ARCHS)
        )
        raise ValueError(f"unknown tiny architecture {arch!r}; choose one of {choices}")
    auto = AutoModelForImageTextToText if arch in (*IMAGE_TEXT_ARCHS, *FRONTIER_IMAGE_TEXT_ARCHS) else AutoModelForCausalLM
    model = auto.from_config(config, dtype=torch.float32)
    if arch == "gemma3-multimodal":  # from_config leaves the image projection at zeros: images would change nothing
        with torch.no_grad():
            model.model.multi_modal_projector.mm_input_projection_weight.normal_(mean=0.0, std=0.02)
    path = Path(path)
    model.save_pretrained(path)
    if arch == "deepseek-v4":
        _as_released_deepseek_v4_config(path)
    return path


SPECIAL_IDS = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)


def _llama4_text_config(common: dict[str, Any]) -> Any:
    """Llama 4's text model: 4 experts of width 2 * hidden, 1 routed per token, in every layer (and a shared expert);
    dense width 2 * hidden; attention chunked over 16 tokens (every 4th layer global, without RoPE)."""
    from transformers import Llama4TextConfig

    return Llama4TextConfig(
        **common,
        **SPECIAL_IDS,
        intermediate_size_mlp=common["hidden_size"] * 2,
        num_local_experts=4,
        num_experts_per_tok=1,
        interleave_moe_layer_step=1,
        attention_chunk_size=16,
    )


def _image_text_config(arch: str, common: dict[str, Any]) -> Any:
    """A tiny image-text config: the text model from ``common``, a 2-layer (Llama 4: 1-layer) vision tower of width 32,
    and the image/video/vision start/end token ids at the top of the vocabulary. M-RoPE sections sum to head_dim / 2."""
    import transformers

    vocab = common["vocab_size"]
    half = common["head_dim"] // 2
    if arch == "llama4":
        vision = dict(
            hidden_size=32,
            intermediate_size=128,  # must be hidden_size / pixel_shuffle_ratio**2
            num_hidden_layers=1,
            num_attention_heads=2,
            image_size=16,
            patch_size=4,
            pixel_shuffle_ratio=0.5,
            vision_output_dim=32,
            projector_input_dim=32,
            projector_output_dim=32,
        )  # 16 patches -> 4 tokens per tile
        return transformers.Llama4Config(
            text_config=_llama4_text_config(common).to_dict(),
            vision_config=vision,
            boi_token_index=vocab - 5,
            eoi_token_index=vocab - 4,
            image_token_index=vocab - 3,
            tie_word_embeddings=False,
        )
    ids = dict(image_token_id=vocab - 3, video_token_id=vocab - 2, vision_start_token_id=vocab - 5, vision_end_token_id=vocab - 4)
    vision = dict(
        depth=2,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        in_channels=3,
        patch_size=4,
        spatial_merge_size=2,
        temporal_patch_size=2,
        out_hidden_size=common["hidden_size"],
    )
    if arch == "qwen2.5-vl":
        side = 3 * half // 8  # temporal, height, width: 16, 24, 24 of 64 in the real models
        rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [half - 2 * side, side, side]}
        text = dict(common, **SPECIAL_IDS, rope_parameters=rope)
        vision.update(window_size=16, fullatt_block_indexes=[1])
        return transformers.Qwen2_5_VLConfig(text_config=text, vision_config=vision, **ids, tie_word_embeddings=False)
    side = 5 * half // 16  # interleaved; 24, 20, 20 of 64 in the real models
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [half - 2 * side, side, side], "mrope_interleaved": True}
    text = dict(
        common,
        **SPECIAL_IDS,
        rope_parameters=rope,
        moe_intermediate_size=common["hidden_size"] // 2,
        num_experts=4,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
    )
    vision.update(num_position_embeddings=16, deepstack_visual_indexes=[0])  # a 4x4 position grid; indexes < depth
    return transformers.Qwen3VLMoeConfig(text_config=text, vision_config=vision, **ids, tie_word_embeddings=False)


def _deepseek_v4_config(common: dict[str, Any]) -> Any:
    """DeepSeek-V4 scaled down, keeping what makes it itself: 2 hyper-connection streams (``hc_mult``), layers that
    alternate heavily compressed and compressed sparse attention (a 16-token window, an indexer picking 8), one key/value
    head, low-rank query and grouped output projections, the first layer's experts routed by hash and the rest by
    score; 4 experts, 2 per token."""
    import transformers

    hidden, layers = common["hidden_size"], common["num_hidden_layers"]
    return transformers.DeepseekV4Config(
        **{k: v for k, v in common.items() if k not in ("intermediate_size", "num_key_value_heads", "head_dim")},
        num_key_value_heads=1,
        head_dim=hidden // 2,
        qk_rope_head_dim=8,
        q_lora_rank=hidden // 2,
        o_lora_rank=hidden // 2,
        o_groups=2,
        hc_mult=2,
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=hidden // 2,
        index_n_heads=2,
        index_head_dim=16,
        index_topk=8,
        sliding_window=16,
        layer_types=[("heavily_compressed_attention", "compressed_sparse_attention")[i % 2] for i in range(layers)],
        mlp_layer_types=["hash_moe", *["moe"] * (layers - 1)],
        default_num_hash_layers=1,
    )


def _as_released_deepseek_v4_config(path: Path) -> None:
    """Write the saved config.json in the layout DeepSeek's released checkpoints use, which every reader of it takes:
    per-layer ``compress_ratios`` (128 heavily compressed, 4 compressed sparse) and ``num_hash_layers`` for the
    attention and MLP layer types transformers writes by its own names (NeMo AutoModel's own DeepSeek-V4 config refuses
    those names)."""
    import json

    ratios = {"heavily_compressed_attention": 128, "compressed_sparse_attention": 4, "sliding_attention": 0}
    file = path / "config.json"
    config = json.loads(file.read_text())
    config["compress_ratios"] = [ratios[kind] for kind in config.pop("layer_types")]
    config["num_hash_layers"] = config.pop("mlp_layer_types").count("hash_moe")
    file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


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
        # The real configuration's proportions, scaled down where the plan shards: as many key/value heads as query
        # heads (multi-head latent attention; with fewer, transformers' attention fails any attention mask, padding
        # included, at one process as at several), q_lora_rank three times kv_lora_rank, rope:nope:value head dims
        # 1:2:2, experts in 8 groups of which 4 are routed to, dense MLPs in the first 3 layers, a shared expert.
        dense = min(3, common["num_hidden_layers"] - 1)
        return transformers.DeepseekV3Config(
            **_mla_moe(common, num_experts_per_tok=4, n_routed_experts=16, n_group=8, topk_group=4, first_k_dense_replace=dense)
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


def _frontier_config(arch: str, common: dict[str, Any]) -> Any:
    """A tiny config of a frontier family of ``FRONTIER_ARCHS`` (each helper says what it keeps of the real model)."""
    builders = {
        "deepseek-v32": _deepseek_v32_config,
        "glm-moe-dsa": _glm_moe_dsa_config,
        "glm5-next": _glm5_next_config,
        "minimax-m2": _minimax_m2_config,
        "qwen3.5-moe": _qwen3_5_moe_config,
        "kimi-k2.5": _kimi_k25_config,
        "minimax-m3-vl": _minimax_m3_vl_config,
    }
    return builders[arch](common)


def _mla(common: dict[str, Any]) -> dict[str, Any]:
    """``common`` without the fields multi-head latent attention sets itself (head dims, key/value heads)."""
    return {k: v for k, v in common.items() if k not in ("head_dim", "num_key_value_heads", "num_attention_heads")}


def _mla_moe(common: dict[str, Any], **fields: Any) -> dict[str, Any]:
    """The DeepSeek-V3 line's fields (``_mla`` of ``common``; ``fields`` replace any): as many key/value heads as query
    heads, 8; q_lora_rank 3 x kv_lora_rank; rope:nope:value head dims 1:2:2; experts of width hidden/2 and a shared
    one."""
    return {
        **_mla(common),
        "num_attention_heads": 8,
        "num_key_value_heads": 8,
        "moe_intermediate_size": common["hidden_size"] // 2,
        "n_shared_experts": 1,
        "q_lora_rank": 48,
        "kv_lora_rank": 16,
        "qk_rope_head_dim": 8,
        "qk_nope_head_dim": 16,
        "v_head_dim": 16,
        **fields,
    }


def _dense_first(layers: int, dense: int = 3) -> dict[str, Any]:
    """Dense MLPs in the first ``dense`` layers (at most all but one), experts after them."""
    dense = min(dense, layers - 1)
    return {"first_k_dense_replace": dense, "mlp_layer_types": ["dense"] * dense + ["sparse"] * (layers - dense)}


INDEXER = {"index_n_heads": 4, "index_head_dim": 16, "index_topk": 8}  # DSA's indexer: 4 heads of width 16 pick 8 tokens


def _deepseek_v32_config(common: dict[str, Any]) -> Any:
    """DeepSeek-V3.2: DeepSeek-V3 (tiny DeepSeek-V3's proportions: 8 heads and key/value heads, q_lora_rank 3 x
    kv_lora_rank, 16 experts in 8 groups of which 4 are routed to, a shared expert, 3 dense layers first) with its
    sparse attention (DSA) in every layer: a lightning indexer of 4 heads of width 16 picking 8 tokens per query (64
    heads of 128 picking 2048 in the real model), so a 12-token row is sparse."""
    import transformers

    return transformers.DeepseekV32Config(
        **_mla_moe(common, num_experts_per_tok=4, n_routed_experts=16, n_group=8, topk_group=4),
        **_dense_first(common["num_hidden_layers"]),
        **INDEXER,
    )


def _glm_moe_dsa_config(common: dict[str, Any]) -> Any:
    """GLM-5 (GlmMoeDsa): multi-head latent attention with DeepSeek sparse attention in every layer (its indexer's RoPE
    interleaved; the released model runs the indexer in every layer, ``indexer_types`` all ``full``), 8 heads and
    key/value heads, q_lora_rank 4 x kv_lora_rank and rope:nope:value head dims 1:3:4 as in the real model; an indexer
    of 4 heads of width 16 picking 8 tokens; 4 experts in one group, 2 per token, a shared expert, 3 dense layers first."""
    import transformers

    layers = common["num_hidden_layers"]
    experts = dict(num_experts_per_tok=2, n_routed_experts=4, n_group=1, topk_group=1)
    return transformers.GlmMoeDsaConfig(
        **_mla_moe(common, **experts, q_lora_rank=64, qk_nope_head_dim=24, v_head_dim=32),
        **_dense_first(layers),
        **INDEXER,
        indexer_types=["full"] * layers,
    )


def _glm5_next_config(common: dict[str, Any]) -> Any:
    """GLM-5.3 (Glm5Next), image-text: its text model keeps 4 hyper-connection streams (a layer's output is
    [B, S, 4, H]), three linear-attention (KDA) layers to each multi-head latent attention layer without RoPE whose
    DSA indexer (4 heads of width 16) picks 8 tokens in pools of 4, 8 heads and key/value heads, 4 experts in one group,
    2 per token, a shared expert, 3 dense layers first; a 1-layer vision tower of width 32. Image, video and their
    start/end token ids at the top of the vocabulary."""
    import transformers

    hidden, layers, vocab = common["hidden_size"], common["num_hidden_layers"], common["vocab_size"]
    text = transformers.Glm5NextTextConfig(
        **_mla_moe(common, num_experts_per_tok=2, n_routed_experts=4, qk_rope_head_dim=0),
        **SPECIAL_IDS,
        mlp_layer_types=_dense_first(layers)["mlp_layer_types"],
        layer_types=["indexed_attention" if i % 4 == 3 else "linear_attention" for i in range(layers)],
        indexer_types=["full"] * layers,
        **INDEXER,
        index_kpool=4,
        linear_head_dim=16,
        linear_num_heads=4,
        hc_mult=4,
    )
    vision = dict(
        depth=1,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        patch_size=4,
        image_size=16,
        spatial_merge_size=2,
        temporal_patch_size=2,
        out_hidden_size=hidden,
        projection_intermediate_size=64,
    )
    return transformers.Glm5NextConfig(
        text_config=text.to_dict(),
        vision_config=vision,
        image_token_id=vocab - 3,
        video_token_id=vocab - 2,
        image_start_token_id=vocab - 5,
        image_end_token_id=vocab - 4,
        video_start_token_id=vocab - 7,
        video_end_token_id=vocab - 6,
        tie_word_embeddings=False,
    )


def _minimax_m2_config(common: dict[str, Any]) -> Any:
    """MiniMax-M2: every layer a mixture of 4 experts of width hidden/2 (its ``intermediate_size``), 2 per token,
    routed by sigmoid scores with a score-correction bias; query and key norms over all heads, RoPE on half of each
    head (64 of 128 in the real model)."""
    import transformers

    return transformers.MiniMaxM2Config(
        **{k: v for k, v in common.items() if k != "intermediate_size"},
        **SPECIAL_IDS,
        intermediate_size=common["hidden_size"] // 2,
        num_local_experts=4,
        num_experts_per_tok=2,
        rope_parameters={"rope_type": "default", "rope_theta": 5000000.0, "partial_rotary_factor": 0.5},
    )


def _qwen3_5_moe_config(common: dict[str, Any]) -> Any:
    """Qwen3.5-MoE's text model (Qwen3_5MoeTextConfig, which AutoModelForCausalLM loads as Qwen3_5MoeForCausalLM):
    three gated-delta-net linear-attention layers to each gated full-attention layer, RoPE on a quarter of each head,
    4 experts of width hidden/2, 2 per token, and a shared expert of the same width."""
    import transformers

    layers = common["num_hidden_layers"]
    return transformers.Qwen3_5MoeTextConfig(
        **{k: v for k, v in common.items() if k != "intermediate_size"},
        **SPECIAL_IDS,
        moe_intermediate_size=common["hidden_size"] // 2,
        shared_expert_intermediate_size=common["hidden_size"] // 2,
        num_experts=4,
        num_experts_per_tok=2,
        layer_types=["full_attention" if i % 4 == 3 else "linear_attention" for i in range(layers)],
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
    )


def _kimi_k25_config(common: dict[str, Any]) -> Any:
    """Kimi-K2.5, image-text: its text model is a DeepSeek-V3 as Kimi-K2's (multi-head latent attention, 8 heads and
    key/value heads, q_lora_rank 3 x kv_lora_rank; experts in one group, 4 here, 2 per token, a shared expert, one dense
    layer first), a 1-layer MoonViT vision tower of width 32 (patches of 4, merged 2 x 2). Image, video and vision
    start/end token ids at the top of the vocabulary."""
    import transformers

    vocab = common["vocab_size"]
    text = transformers.DeepseekV3Config(
        **_mla_moe(common, num_experts_per_tok=2, n_routed_experts=4, n_group=1, topk_group=1, first_k_dense_replace=1),
        **SPECIAL_IDS,
    )
    vision = dict(
        patch_size=4,
        pos_emb_height=8,
        pos_emb_width=8,
        pos_emb_time=2,
        num_attention_heads=2,
        num_hidden_layers=1,
        hidden_size=32,
        intermediate_size=64,
        merge_kernel_size=[2, 2],
    )
    return transformers.Kimi_K25Config(
        text_config=text.to_dict(),
        vision_config=vision,
        projection_hidden_size=32,
        image_token_id=vocab - 3,
        video_token_id=vocab - 2,
        vision_start_token_id=vocab - 5,
        vision_end_token_id=vocab - 4,
        tie_word_embeddings=False,
    )


def _minimax_m3_vl_config(common: dict[str, Any]) -> Any:
    """MiniMax-M3, image-text: its text model keeps MiniMax-M2's attention (query/key norms, RoPE on half of each head)
    with block-sparse attention in every other layer (a lightning indexer of one head per key/value head keeps, per
    query, the 2 best blocks of 4 keys and the block before its own: 16 of 128 in the real model), a dense first layer
    of width 2 x hidden, then 4 experts of width hidden/2, 2 per token, and a shared expert; a 1-layer vision tower of
    width 32. Image and video token ids at the top of the vocabulary."""
    import transformers

    hidden, layers, vocab = common["hidden_size"], common["num_hidden_layers"], common["vocab_size"]
    text = transformers.MiniMaxM3VLTextConfig(
        **{k: v for k, v in common.items() if k != "intermediate_size"},
        **SPECIAL_IDS,
        intermediate_size=hidden // 2,
        dense_intermediate_size=hidden * 2,
        shared_intermediate_size=hidden // 2,
        num_local_experts=4,
        num_experts_per_tok=2,
        rotary_dim=common["head_dim"] // 2,  # as released checkpoints say it; the rotary embedding reads the factor
        rope_parameters={"rope_type": "default", "rope_theta": 5000000.0, "partial_rotary_factor": 0.5},
        mlp_layer_types=["dense", *["sparse"] * (layers - 1)],
        layer_types=[("full_attention", "minimax_m3_sparse")[i % 2] for i in range(layers)],
        index_n_heads=common["num_key_value_heads"],
        index_head_dim=16,
        index_block_size=4,
        index_topk_blocks=2,
        index_local_blocks=1,
    )
    vision = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=16,
        patch_size=4,
        temporal_patch_size=2,
        spatial_merge_size=2,
    )
    return transformers.MiniMaxM3VLConfig(
        text_config=text.to_dict(),
        vision_config=vision,
        image_token_index=vocab - 3,
        video_token_index=vocab - 2,
        projector_hidden_size=hidden,
        tie_word_embeddings=False,
    )


NEMO_ONLY_ARCHS = ("deepseek-v41", "kimi-k3")  # implemented by NeMo AutoModel only (transformers has no such model type)


def build_tiny_nemo_target(
    path: str | Path, *, arch: str = "deepseek-v41", vocab_size: int = 256, seed: int = 0, draft_layers: int = 0, device: str = "cpu"
) -> Path:
    """Save a random-weight target that only NeMo AutoModel implements, by NeMo's own config and model classes, its
    weights under the released checkpoint's names (the model's ``state_dict_adapter.to_hf``), as such a checkpoint is
    laid out; ``--engine automodel`` loads it back.

    ``deepseek-v41`` (DeepSeek-V4.1's text model): 6 layers, hidden 64, 4 hyper-connection streams, its compressed
    sparse attention (compress ratios 0, 2, 2, 1, 1, 1, key-value and indexer source layers, a candidate source), 4
    experts, 2 per token, and one shared; no Engram layers (they need the released tokenizer) and no vision tower.
    ``draft_layers``: its DSpark draft's depth, which the checkpoint states (``num_nextn_predict_layers``) and NeMo's
    DSpark recipe builds its draft from (0: a target no draft can be built for).
    ``kimi-k3`` (Kimi-K3's text model, ``KimiK3ForCausalLM`` as NeMo's DSpark builder loads it): 4 layers, hidden 64,
    three linear-attention (KDA) layers of 4 heads of 16 and a gated multi-head latent attention layer last, 4 latent
    experts (width 32), 2 per token, one shared, a dense first layer; in bfloat16. NeMo builds KDA layers with the fla
    package's kernels only: ``device`` a GPU, with fla installed (benchmarks/gpu.py).
    """
    import torch

    from draftfeed.consumers.engines.automodel import CPU_BACKEND, backend_config

    if arch not in NEMO_ONLY_ARCHS:
        raise ValueError(f"unknown NeMo-only arch {arch!r}; choose one of {', '.join(NEMO_ONLY_ARCHS)}")
    if arch == "kimi-k3":
        config, model = _kimi_k3(vocab_size, seed, torch.device(device))
        return _save_nemo_target(path, config, model)
    from nemo_automodel.components.models.deepseek_v41.config import DeepseekV41Config
    from nemo_automodel.components.models.deepseek_v41.model import DeepseekV41ForCausalLM

    text = {
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "moe_intermediate_size": 32,
        "num_hidden_layers": 6,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 64,
        "qk_rope_head_dim": 16,
        "q_lora_rank": 32,
        "o_lora_rank": 16,
        "o_groups": 2,
        "n_routed_experts": 4,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "sliding_window": 4,
        "compress_ratios": [0, 2, 2, 1, 1, 1] + [0] * draft_layers,  # the draft's layers' too
        "kv_source_layer_ids": [1, 3],
        "index_source_layer_ids": [1, 3, 5],
        "index_n_heads": 2,
        "index_head_dim": 32,
        "index_topk": 4,
        "candidate_source_layer_id": 3,
        "candidate_topk_blocks": 2,
        "candidate_block_size": 2,
        "hc_mult": 4,
        "engram_layer_ids": [],
        "num_nextn_predict_layers": draft_layers,
        "dspark_target_layer_ids": [3, 4, 5],
        "dspark_noise_token_id": vocab_size - 2,
        "max_position_embeddings": 4096,
        "rope_scaling": {"rope_type": "yarn", "factor": 16, "beta_fast": 32, "beta_slow": 1, "original_max_position_embeddings": 256},
        "dtype": "float32",
    }
    config = DeepseekV41Config(text_config=text, vision_config={"num_hidden_layers": 0}, image_token_id=vocab_size - 1, dtype="float32")
    torch.manual_seed(seed)
    model = DeepseekV41ForCausalLM(config, backend=backend_config(CPU_BACKEND))
    model.initialize_weights(buffer_device=torch.device("cpu"), dtype=torch.float32)
    return _save_nemo_target(path, config, model)


def _save_nemo_target(path: str | Path, config: Any, model: Any) -> Path:
    """The config, and the weights under the released checkpoint's names (the model's ``state_dict_adapter.to_hf``)."""
    from safetensors.torch import save_file

    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(folder)
    weights = model.state_dict_adapter.to_hf(model.state_dict())
    save_file({name: tensor.detach().contiguous().cpu() for name, tensor in weights.items()}, str(folder / "model.safetensors"))
    return folder


def _kimi_k3(vocab_size: int, seed: int, device: Any) -> tuple[Any, Any]:
    """Kimi-K3's config (the image-text checkpoint's, its text model tagged KimiK3ForCausalLM, which NeMo's DSpark
    builder loads) and NeMo's text model of it, random weights on ``device``."""
    import torch
    from nemo_automodel.components.models.kimi_k3.config import KimiK3Config
    from nemo_automodel.components.models.kimi_k3.model import KimiK3ForCausalLM

    from draftfeed.consumers.engines.automodel import CPU_BACKEND, backend_config

    text = {
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "q_lora_rank": 32,
        "kv_lora_rank": 16,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
        "moe_intermediate_size": 32,
        "routed_expert_hidden_size": 32,
        "num_experts": 4,
        "num_experts_per_token": 2,
        "num_shared_experts": 1,
        "first_k_dense_replace": 1,
        "max_position_embeddings": 4096,
        "linear_attn_config": {
            "head_dim": 16,
            "num_heads": 4,
            "short_conv_kernel_size": 4,
            "kda_layers": [1, 2, 3],
            "full_attn_layers": [4],
            "use_full_rank_gate": True,
            "gate_lower_bound": -5.0,
        },
        "torch_dtype": "bfloat16",
    }
    config = KimiK3Config(text_config=text, architectures=["KimiK3ForCausalLM"])
    torch.manual_seed(seed)
    with torch.device(device):
        model = KimiK3ForCausalLM(config, backend=backend_config(CPU_BACKEND))
    model.initialize_weights(buffer_device=device, dtype=torch.bfloat16)
    return config, model
