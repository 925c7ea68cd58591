"""The supervision contract computed in-process, written from the contract's text (docs), never from the worker's code.

Also the batches the tests send, and the comparison that says where and by how much a result differs.
Run the references under the same thread count as the workers they are compared with (OMP_NUM_THREADS=1):
on some CPUs a matmul's result changes with the number of threads.
"""

from __future__ import annotations

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


def zero_padding(tensor: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """The contract's padded positions: zeros, in every hidden state and in the logits."""
    return tensor.masked_fill(attention_mask.unsqueeze(-1) == 0, 0)


@torch.no_grad()
def reference_eagle3(
    model, batch: dict[str, torch.Tensor], aux_layer_ids: list[int], selected_token_ids=None, selected_token_mask=None
) -> dict[str, torch.Tensor]:
    """The supervision contract computed in-process, written from the contract text (not the worker's code).

    "Output of layer i" is what decoder layer i returns: ``output_hidden_states[i + 1]``, except for the
    last layer, whose entry there has the final norm applied; that one is caught with a hook.
    """
    last = len(model.model.layers) - 1
    caught: dict[str, torch.Tensor] = {}
    handle = model.model.layers[last].register_forward_hook(lambda _m, _i, output: caught.update(last=output))
    try:
        out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False, output_hidden_states=True)
    finally:
        handle.remove()
    mask = batch["attention_mask"]
    layer_output = {i: zero_padding(out.hidden_states[i + 1], mask) for i in range(last)} | {last: zero_padding(caught["last"], mask)}
    logits = zero_padding(out.logits, mask)
    vocab = logits.shape[-1]
    if selected_token_ids is None:
        selected_token_ids = torch.arange(vocab)
        selected_token_mask = torch.ones(vocab, dtype=torch.bool)
    shifted_logits = torch.cat([logits[:, 1:], torch.zeros_like(logits[:, :1])], dim=1)

    def shift(t: torch.Tensor) -> torch.Tensor:
        return torch.cat([t[:, 1:], torch.zeros_like(t[:, :1])], dim=1)

    shifted_loss_mask = shift(batch["loss_mask"])
    return {
        "aux_hidden_states": torch.cat([layer_output[i] for i in aux_layer_ids], dim=-1),
        "target_probs": torch.softmax(shifted_logits.index_select(-1, selected_token_ids).float(), dim=-1),
        "position_mask": (selected_token_mask[shifted_logits.argmax(-1)] & shifted_loss_mask.bool()).unsqueeze(-1),
        "input_ids": shift(batch["input_ids"]),
        "loss_mask": shifted_loss_mask,
        "attention_mask": batch["attention_mask"],
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


def assert_supervision_equal(supervision, expected: dict[str, torch.Tensor]) -> None:
    got = supervision.as_dict()
    assert set(got) == set(expected), f"fields {sorted(got)}, expected {sorted(expected)}"
    problems = [p for name, tensor in expected.items() if (p := difference(name, got[name], tensor)) is not None]
    assert not problems, "; ".join(problems)


@torch.no_grad()
def reference_dspark(model, batch, layer_ids):
    """The contract in-process: -1 is output_hidden_states[0], L-1 the post-norm output_hidden_states[L], i the output of layer i."""
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False, output_hidden_states=True)
    hidden = [zero_padding(h, batch["attention_mask"]) for h in out.hidden_states]
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
    }


def draft_vocab(size: int, vocab_size: int = 1000, seed: int = 9) -> tuple[torch.Tensor, torch.Tensor]:
    """A draft vocabulary of ``size`` target ids (unsorted on purpose) and its mask."""
    ids = torch.randperm(vocab_size, generator=torch.Generator().manual_seed(seed))[:size]
    mask = torch.zeros(vocab_size, dtype=torch.bool)
    mask[ids] = True
    return ids, mask
