"""Packed rows: several documents in one row, as NeMo AutoModel packs them (docs/contract.md, "Packed rows").

``seq_lens`` [B, D] int64 gives each row's document lengths, zero-padded to D documents; each row's lengths sum to
S, with the row's trailing padding folded into its last document. ``position_ids`` [B, S] int64 restart at 0 in
each document. Attention is causal within a document and never crosses one. ``doc_remaining`` [B, S] is the
rank's own: it travels back with the supervision as given, and the worker never sees it.

The rank checks a packed batch before it sends it and the worker checks it again before its target sees it; both
run ``check_packing`` here, so the two sides refuse the same batches with the same words.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from draftfeed.schemas.errors import BadRequest

# The packing arguments, by NeMo's names: what the worker is sent, and what only the rank keeps.
SENT_KEYS = ("position_ids", "seq_lens")
RANK_KEYS = ("doc_remaining",)
PACKING_KEYS = SENT_KEYS + RANK_KEYS


@dataclass(frozen=True)
class Documents:
    """The documents of a packed batch, checked: ``seq_lens`` [B, D] and the ``position_ids`` [B, S] they imply."""

    seq_lens: torch.Tensor
    position_ids: torch.Tensor

    def spans(self, row: int) -> list[tuple[int, int]]:
        """(start, end) of each non-empty document of ``row``, in order."""
        spans, start = [], 0
        for length in self.seq_lens[row].tolist():
            if length > 0:
                spans.append((start, start + length))
                start += length
        return spans

    def segments(self, attention_mask: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
        """Each document's real positions (attention_mask 1) as (row, positions), documents without any left out:
        what an engine that runs each document as a request of its own sends."""
        out = []
        for row in range(attention_mask.shape[0]):
            for start, end in self.spans(row):
                positions = start + torch.nonzero(attention_mask[row, start:end], as_tuple=True)[0]
                if len(positions):
                    out.append((row, positions))
        return out

    def document_ids(self) -> torch.Tensor:
        """[B, S] int64: the index of the document each position belongs to, within its row."""
        batch, seq = self.position_ids.shape
        ids = torch.empty(batch, seq, dtype=torch.int64)
        for row in range(batch):
            lengths = self.seq_lens[row].cpu()
            ids[row] = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
        return ids

    def additive_mask(self, attention_mask: torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """[B, 1, S, S] of ``dtype``: 0 where query i may attend key j (same document, j <= i, key j real), the
        dtype's lowest value elsewhere: the block-causal mask an eager or SDPA attention adds to its scores."""
        doc = self.document_ids().to(device)
        seq = doc.shape[1]
        causal = torch.ones(seq, seq, dtype=torch.bool, device=device).tril()
        allowed = (doc[:, :, None] == doc[:, None, :]) & causal & attention_mask.to(device).bool()[:, None, :]
        mask = torch.zeros(allowed.shape, dtype=dtype, device=device)
        mask.masked_fill_(~allowed, torch.finfo(dtype).min)
        return mask.unsqueeze(1)


def expected_position_ids(seq_lens: torch.Tensor, seq: int) -> torch.Tensor:
    """[B, S]: 0, 1, ... restarting at each document of ``seq_lens`` (each row of which sums to ``seq``)."""
    return torch.stack([torch.cat([torch.arange(n, dtype=torch.int64) for n in lengths if n > 0]) for lengths in seq_lens.cpu().tolist()])


def _plain_positions(position_ids: torch.Tensor, attention_mask: torch.Tensor) -> bool:
    """Whether ``position_ids`` are 0, 1, ... along every row at its real positions (one document a row)."""
    if not isinstance(position_ids, torch.Tensor) or list(position_ids.shape) != list(attention_mask.shape):
        return False
    plain = torch.arange(attention_mask.shape[1]).expand(attention_mask.shape[0], -1)
    return not bool(((position_ids.cpu().long() != plain) & attention_mask.cpu().bool()).any())


def check_packing(
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor | None,
    seq_lens: torch.Tensor | None,
    doc_remaining: torch.Tensor | None = None,
) -> Documents | None:
    """The batch's documents, or None for a batch that is not packed; raises BadRequest saying what is wrong.

    A packed batch names ``seq_lens`` (``position_ids`` alone do not say where documents end: without seq_lens they
    must be the plain 0, 1, ... of unpacked rows). ``position_ids``, when given, must restart at 0 in each document at
    every real position (attention_mask 1); when not given they are derived from ``seq_lens``."""
    if seq_lens is None:
        if position_ids is not None and not _plain_positions(position_ids, attention_mask):
            raise BadRequest(
                "position_ids restart inside a row but no seq_lens came with them: a packed batch names its documents' lengths "
                "in seq_lens [batch, max_docs]"
            )
        if doc_remaining is not None:
            raise BadRequest("doc_remaining without seq_lens: a packed batch names its documents' lengths in seq_lens [batch, max_docs]")
        return None
    batch, seq = attention_mask.shape
    for name, tensor, shape in (
        ("seq_lens", seq_lens, None),
        ("position_ids", position_ids, [batch, seq]),
        ("doc_remaining", doc_remaining, [batch, seq]),
    ):
        if tensor is None:
            continue
        if not isinstance(tensor, torch.Tensor):
            raise BadRequest(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.dtype not in (torch.int64, torch.int32):
            raise BadRequest(f"{name} must be int64, got {tensor.dtype}: convert it with .long()")
        if shape is not None and list(tensor.shape) != shape:
            raise BadRequest(f"{name} has shape {list(tensor.shape)}; input_ids has {[batch, seq]} and {name} must match it")
    if seq_lens.dim() != 2 or seq_lens.shape[0] != batch or seq_lens.shape[1] < 1:
        raise BadRequest(f"seq_lens has shape {list(seq_lens.shape)}; it must be [batch, max_docs] = [{batch}, D] with D >= 1")
    lengths = seq_lens.long().cpu()
    if bool((lengths < 0).any()):
        row, doc = (int(i) for i in torch.nonzero(lengths < 0)[0])
        raise BadRequest(f"seq_lens[{row}, {doc}] is {int(lengths[row, doc])}: a document's length cannot be negative")
    sums = lengths.sum(dim=1)
    if bool((sums != seq).any()):
        row = int(torch.nonzero(sums != seq)[0])
        raise BadRequest(
            f"seq_lens row {row} sums to {int(sums[row])}, not the row's {seq} tokens: each row's lengths must add up to the "
            "sequence length, with the trailing padding counted in the last document"
        )
    expected = expected_position_ids(lengths, seq)
    if position_ids is not None:
        position_ids = position_ids.long().cpu()
        wrong = (position_ids != expected) & attention_mask.cpu().bool()
        if bool(wrong.any()):
            row, pos = (int(i) for i in torch.nonzero(wrong)[0])
            raise BadRequest(
                f"position_ids[{row}, {pos}] is {int(position_ids[row, pos])} but seq_lens {lengths[row].tolist()} put position {pos} at "
                f"{int(expected[row, pos])} of its document: position_ids must restart at 0 in each document"
            )
    # The target gets the derived ids: equal to the given ones at every real position, and defined at padding too.
    return Documents(seq_lens=lengths, position_ids=expected)
