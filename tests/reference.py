"""The supervision contract computed in-process, written from the contract's text (docs), never from the worker's code.

Also the batches the tests send, and the comparison that says where and by how much a result differs.
Run the references under the same thread count as the workers they are compared with (OMP_NUM_THREADS=1):
on some CPUs a matmul's result changes with the number of threads.
"""

from __future__ import annotations

import threading

import torch


def make_batch(batch_size: int, seq_len: int, vocab_size: int, seed: int, ragged: bool = True) -> dict[str, torch.Tensor]:
    """A right-padded token batch; row lengths vary when ragged."""
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, vocab_size, (batch_size, seq_len), generator=generator)
    if ragged:
        lengths = torch.randint(max(1, seq_len // 3), seq_len + 1, (batch_size,), generator=generator)
        lengths[0] = seq_len
    else:
        lengths = torch.full((batch_size,), seq_len)
    attention_mask = (torch.arange(seq_len)[None, :] < lengths[:, None]).long()
    loss_mask = attention_mask.clone()
    loss_mask[:, : seq_len // 4] = 0  # a prompt that is not supervised
    return {"input_ids": input_ids * attention_mask, "attention_mask": attention_mask, "loss_mask": loss_mask}


def make_packed_batch(docs: list[list[int]], pad: list[int], vocab_size: int, seed: int) -> dict[str, torch.Tensor]:
    """Rows of several documents (``docs[row]`` their lengths) then ``pad[row]`` padding tokens, packed as NeMo packs
    them: seq_lens zero-padded to the most documents a row has, the padding counted in the last document,
    position_ids restarting at 0 in each document (and going on through the padding), doc_remaining the tokens left
    in each position's document after it."""
    generator = torch.Generator().manual_seed(seed)
    seq = sum(docs[0]) + pad[0]
    width = max(len(d) for d in docs)
    input_ids = torch.randint(0, vocab_size, (len(docs), seq), generator=generator)
    attention_mask = torch.zeros(len(docs), seq, dtype=torch.int64)
    seq_lens = torch.zeros(len(docs), width, dtype=torch.int64)
    position_ids = torch.zeros(len(docs), seq, dtype=torch.int64)
    doc_remaining = torch.zeros(len(docs), seq, dtype=torch.int64)
    for row, (lengths, padding) in enumerate(zip(docs, pad)):
        assert sum(lengths) + padding == seq
        attention_mask[row, : seq - padding] = 1
        folded = [*lengths[:-1], lengths[-1] + padding]
        seq_lens[row, : len(folded)] = torch.tensor(folded)
        start = 0
        for length in folded:
            position_ids[row, start : start + length] = torch.arange(length)
            doc_remaining[row, start : start + length] = torch.arange(length - 1, -1, -1)
            start += length
    loss_mask = attention_mask.clone()
    loss_mask[:, :2] = 0
    return {
        "input_ids": input_ids * attention_mask,
        "attention_mask": attention_mask,
        "loss_mask": loss_mask,
        "position_ids": position_ids,
        "seq_lens": seq_lens,
        "doc_remaining": doc_remaining,
    }


def block_causal_mask(batch: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """[B, 1, S, S] additive: query i sees key j when both are in the same document, j <= i and j is a real token;
    the lowest value of ``dtype`` elsewhere."""
    seq_lens, attention_mask = batch["seq_lens"], batch["attention_mask"]
    batch_size, seq = attention_mask.shape
    mask = torch.full((batch_size, 1, seq, seq), torch.finfo(dtype).min, dtype=dtype)
    for row in range(batch_size):
        start = 0
        for length in seq_lens[row].tolist():
            for i in range(start, start + length):
                for j in range(start, i + 1):
                    if attention_mask[row, j]:
                        mask[row, 0, i, j] = 0
            start += length
    return mask


# An image-text target's inputs, as docs/contract.md ("Image-text targets") names them: passed to its forward as given.
IMAGE_INPUTS = (
    "pixel_values",
    "image_grid_thw",
    "pixel_values_videos",
    "video_grid_thw",
    "second_per_grid_ts",
    "mm_token_type_ids",
    "token_type_ids",
    "image_sizes",
)


def model_inputs(model, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What the model is called with in-process: a packed batch gets its block-causal mask and position ids; an
    image-text batch its image inputs."""
    if "seq_lens" not in batch:
        images = {name: batch[name] for name in IMAGE_INPUTS if name in batch}
        return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"], **images}
    return {"input_ids": batch["input_ids"], "attention_mask": block_causal_mask(batch, model.dtype), "position_ids": batch["position_ids"]}


def packing_fields(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What the supervision of a packed batch carries back as given."""
    return {key: batch[key] for key in ("position_ids", "seq_lens", "doc_remaining") if key in batch}


def zero_padding(tensor: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """The contract's padded positions: zeros, in every hidden state and in the logits."""
    return tensor.masked_fill(attention_mask.unsqueeze(-1) == 0, 0)


def shift_left(tensor: torch.Tensor) -> torch.Tensor:
    """The contract's shift: position t takes what was at t + 1 (along dim 1); the last position is zero."""
    return torch.cat([tensor[:, 1:], torch.zeros_like(tensor[:, :1])], dim=1)


# Where each family's transformers class keeps its text decoder's layers (transformers 5.2x), read off the classes
# rather than found the way the worker finds them: causal LMs, image-text models, and Llama 4's image-text model,
# which nests a whole causal LM.
DECODER_PATHS = ("model.layers", "model.language_model.layers", "language_model.model.layers")


def decoder_layers(model) -> torch.nn.ModuleList:
    """The decoder layers of a causal LM's or an image-text model's text decoder."""
    for path in DECODER_PATHS:
        found = model
        for name in path.split("."):
            found = getattr(found, name, None)
        if isinstance(found, torch.nn.ModuleList):
            return found
    raise AssertionError(f"no decoder layers at {', '.join(DECODER_PATHS)} of {type(model).__name__}")


def text_model(model):
    """What runs a text-only batch in-process: the model, but Llama 4's image-text model runs its nested causal LM
    (transformers 5.24's forward of the whole fails at its return; for text it is the same computation)."""
    return model.language_model if type(model).__name__ == "Llama4ForConditionalGeneration" else model


@torch.no_grad()
def reference_eagle3(
    model, batch: dict[str, torch.Tensor], aux_layer_ids: list[int], selected_token_ids=None, selected_token_mask=None
) -> dict[str, torch.Tensor]:
    """The supervision contract computed in-process, written from the contract text (not the worker's code).

    "Output of layer i" is what decoder layer i returns, caught with a forward hook on that layer (for the last
    layer that is before the final norm); the logits are the model's own, with its scaling or soft-capping.
    """
    layers = decoder_layers(model)
    caught: dict[int, torch.Tensor] = {}
    caller = threading.get_ident()  # the same model may run in other threads meanwhile (test_dspark's side-by-side test)

    def catch(index: int):
        def hook(_module, _inputs, output) -> None:
            if threading.get_ident() == caller:
                caught[index] = output[0] if isinstance(output, tuple) else output

        return hook

    handles = [layers[i].register_forward_hook(catch(i)) for i in aux_layer_ids]
    try:
        logits = text_model(model)(**model_inputs(model, batch), use_cache=False).logits
    finally:
        for handle in handles:
            handle.remove()
    mask = batch["attention_mask"]
    vocab = logits.shape[-1]
    if selected_token_ids is None:
        selected_token_ids = torch.arange(vocab)
        selected_token_mask = torch.ones(vocab, dtype=torch.bool)
    shifted_logits = shift_left(zero_padding(logits, mask))
    shifted_loss_mask = shift_left(batch["loss_mask"])
    return {
        "aux_hidden_states": torch.cat([zero_padding(caught[i], mask) for i in aux_layer_ids], dim=-1),
        "target_probs": torch.softmax(shifted_logits.index_select(-1, selected_token_ids).float(), dim=-1),
        "position_mask": (selected_token_mask[shifted_logits.argmax(-1)] & shifted_loss_mask.bool()).unsqueeze(-1),
        "input_ids": shift_left(batch["input_ids"]),
        "loss_mask": shifted_loss_mask,
        "attention_mask": mask,
        **packing_fields(batch),
    }


def difference(name: str, got: torch.Tensor, expected: torch.Tensor) -> str | None:
    """None when ``got`` equals ``expected`` bit for bit; otherwise where and by how much they differ, so that a
    regression (many positions, large) is told from a configuration mismatch (a few last bits)."""
    if got.dtype != expected.dtype or got.shape != expected.shape:
        return f"{name}: got {got.dtype} {list(got.shape)}, expected {expected.dtype} {list(expected.shape)}"
    if torch.equal(got, expected):
        return None
    unequal = got != expected
    first = tuple(int(i) for i in unequal.nonzero()[0])
    text = f"{name} differs from the in-process computation at {int(unequal.sum())} of {got.numel()} elements; first at {list(first)}: got {got[first].item()!r}, expected {expected[first].item()!r}"
    if got.is_floating_point():
        gap = (got.double() - expected.double()).abs()
        worst = tuple(int(i) for i in (gap == gap.max()).nonzero()[0])
        text += f"; largest |difference| {gap.max().item():.3g} at {list(worst)}"
    return text


def difference_at_real(name: str, got: torch.Tensor, expected: torch.Tensor, real: torch.Tensor) -> str | None:
    """``difference`` against ``expected`` with the contract's zeros where ``real`` [B, S] is 0 (padded positions): None
    when ``got`` equals ``expected`` at every real position and is zero at every padded one."""
    keep = real.bool().view(*real.shape, *[1] * (expected.dim() - 2))
    return difference(name, got, expected.masked_fill(~keep, 0))


def assert_supervision_equal(supervision, expected: dict[str, torch.Tensor]) -> None:
    got = supervision.as_dict()
    assert set(got) == set(expected), f"fields {sorted(got)}, expected {sorted(expected)}"
    problems = [p for name, tensor in expected.items() if (p := difference(name, got[name], tensor)) is not None]
    assert not problems, "; ".join(problems)


def one_stream(hidden: torch.Tensor, embeddings: bool) -> torch.Tensor:
    """A layer of several residual streams [B, S, streams, H] (DeepSeek-V4's hyper-connections) as DSpark reads it
    (docs/contract.md): the embedding output's copies by their first, any other layer by their mean; [B, S, H] as is."""
    if hidden.dim() == 3:
        return hidden
    return hidden[:, :, 0] if embeddings else hidden.mean(dim=2)


@torch.no_grad()
def reference_dspark(model, batch, layer_ids):
    """The contract in-process: -1 is output_hidden_states[0], L-1 the post-norm output_hidden_states[L], i the output of
    layer i (each of several streams read as one: ``one_stream``)."""
    out = text_model(model)(**model_inputs(model, batch), use_cache=False, output_hidden_states=True)
    hidden = [zero_padding(one_stream(h, index == 0), batch["attention_mask"]) for index, h in enumerate(out.hidden_states)]
    last = len(hidden) - 2

    def layer(i: int) -> torch.Tensor:
        if i == -1:
            return hidden[0]
        if i == last:
            return hidden[-1]
        return hidden[i + 1]

    return {
        "target_hidden_states": torch.cat([layer(i) for i in layer_ids], dim=-1),
        "target_last_hidden_states": hidden[-1],
        "input_ids": batch["input_ids"],
        "loss_mask": batch["loss_mask"],
        "attention_mask": batch["attention_mask"],
        **packing_fields(batch),
    }


def draft_vocab(size: int, vocab_size: int = 1000, seed: int = 9) -> tuple[torch.Tensor, torch.Tensor]:
    """A draft vocabulary of ``size`` target ids (unsorted on purpose) and its mask."""
    ids = torch.randperm(vocab_size, generator=torch.Generator().manual_seed(seed))[:size]
    mask = torch.zeros(vocab_size, dtype=torch.bool)
    mask[ids] = True
    return ids, mask
