"""A fake engine of frontier width: supervision the size a DeepSeek-V3 or Kimi-K2 target gives, made cheaply.

Named fake because it is: no model runs. It answers every capture with hidden states of the target's real width
(H = 7168 by default) whose values follow from the batch alone (``frontier_hidden``), so a rank can check every
byte it receives against the same function, and the bench and the tests move multi-gigabyte samples through the
real broker, worker and rank (``draftfeed launch worker --engine draftfeed.bench.frontier:FakeFrontierEngine``). The
target folder given to the worker is read for nothing; the shape comes from the engine's options
(``--engine-option hidden_size=7168``, ``num_hidden_layers``, ``vocab_size``, ``max_positions``).

Each value is a small integer (below 256: exact in bfloat16), one per (token id, layer) plus one per column, so a
wrong place, a wrong layer or a lost piece shows as a difference.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from draftfeed.consumers.engines.base import EMBEDDINGS, FINAL_HIDDEN, Capture, ForwardOutput, TargetShape
from draftfeed.consumers.engines.joining import JoinedWriter
from draftfeed.schemas.messages import LogitTransform

# DeepSeek-V3's shape (Kimi-K2 has the same hidden size and vocabulary family).
HIDDEN, LAYERS, VOCAB, POSITIONS = 7168, 61, 129_280, 163_840
FINAL = 1_000  # what ``frontier_hidden`` calls the final norm's output


ROW_VALUES = 89  # a position's row is one of these, by its token id and layer: ``row_values``


def frontier_rows(hidden_size: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Every row the fake gives, by row value: [ROW_VALUES, H], row v = v + (column mod 97)."""
    return (torch.arange(ROW_VALUES).unsqueeze(-1) + torch.arange(hidden_size).remainder_(97)).to(dtype)


def row_values(input_ids: torch.Tensor, which: int | torch.Tensor) -> torch.Tensor:
    """Each position's row value for layer ``which`` (an int, or a tensor of layers broadcast against ``input_ids``)."""
    return (input_ids * 31 + which * 7).remainder_(ROW_VALUES)


def frontier_hidden(input_ids: torch.Tensor, which: int, hidden_size: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The fake's hidden state [B, S, H] for layer ``which`` (-1: the embeddings; ``FINAL``: the final norm's output)."""
    return frontier_rows(hidden_size, dtype)[row_values(input_ids, which)]


def frontier_dspark(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, layer_ids: Sequence[int], num_hidden_layers: int, hidden_size: int
) -> dict:
    """What a worker of this engine sends for DSpark, as the contract has it (padded positions zero); for checks."""
    last = num_hidden_layers - 1
    pad = attention_mask.unsqueeze(-1) == 0
    layers = [frontier_hidden(input_ids, FINAL if i == last else i, hidden_size).masked_fill_(pad, 0) for i in layer_ids]
    return {
        "target_hidden_states": torch.cat(layers, dim=-1),
        "target_last_hidden_states": frontier_hidden(input_ids, FINAL, hidden_size).masked_fill_(pad, 0),
    }


class FakeFrontierEngine:
    """The engine interface (consumers/engines/base.py), answering with ``frontier_hidden``; no logits."""

    name = "fake-frontier"
    logit_transform = LogitTransform()
    image_inputs: frozenset[str] = frozenset()
    images_refusal = "the fake frontier engine takes no images"

    def __init__(
        self,
        target: str,
        device: str = "cpu",
        dtype: str = "auto",
        hidden_size: int = HIDDEN,
        num_hidden_layers: int = LAYERS,
        vocab_size: int = VOCAB,
        max_positions: int = POSITIONS,
    ) -> None:
        self.device = torch.device(device)
        self.dtype = torch.bfloat16 if dtype == "auto" else getattr(torch, dtype)
        self.shape = TargetShape(num_hidden_layers=num_hidden_layers, hidden_size=hidden_size, vocab_size=vocab_size, max_positions=max_positions)

    def prepare(self, captures: Sequence[Capture]) -> None:
        if any(capture.logits for capture in captures):
            raise ValueError("the fake frontier engine gives hidden states only: serve --task dspark, or dflash without --capture-logits")

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, capture: Capture) -> ForwardOutput:
        ids = input_ids.to(self.device)

        def hidden(which: int) -> torch.Tensor:
            return frontier_hidden(ids, which, self.shape.hidden_size, self.dtype)

        out = ForwardOutput(
            layer_outputs={i: hidden(i) for i in capture.layer_ids},
            embeddings=hidden(-1) if capture.embeddings else None,
            final_hidden=hidden(FINAL) if capture.final_hidden else None,
        )
        if capture.joined is not None:  # each part written as it is made, as the real engines do: one copy held
            joined = JoinedWriter(capture.joined)
            for part in capture.joined.parts:
                joined.write(part, hidden(-1 if part == EMBEDDINGS else FINAL if part == FINAL_HIDDEN else int(part)))
            out.joined = joined.tensor
        return out

    def input_embeddings(self) -> torch.Tensor:
        raise NotImplementedError("the fake frontier engine has no weights")

    output_embeddings = input_embeddings

    def close(self) -> None:
        pass


# ---------------------------------------------------------------- a rank of it, in a process of its own
def first_difference(received: dict, input_ids: torch.Tensor, layer_ids: Sequence[int], num_hidden_layers: int, hidden_size: int) -> str | None:
    """Where DSpark supervision from this engine differs from ``frontier_dspark`` (every position of a batch whose
    attention mask is all ones), or None when every byte is equal.

    The expected positions are gathered from ``frontier_rows`` into one small reused buffer, a few hundred positions
    at a time, and compared bit for bit: the check costs about what reading the sample does, and little memory (a few
    tens of MB)."""
    step = 256
    last = num_hidden_layers - 1
    table = frontier_rows(hidden_size)
    layouts = {"target_hidden_states": [FINAL if i == last else i for i in layer_ids], "target_last_hidden_states": [FINAL]}
    buffer = torch.empty(step * max(map(len, layouts.values())), hidden_size, dtype=torch.bfloat16)
    for name, which in layouts.items():
        got_all = received[name]
        layers = torch.tensor(which)
        if got_all.shape != (*input_ids.shape, len(which) * hidden_size) or got_all.dtype != torch.bfloat16:
            return f"{name} is {got_all.dtype} {list(got_all.shape)}, not bfloat16 {[*input_ids.shape, len(which) * hidden_size]}"
        for row in range(input_ids.shape[0]):
            for start in range(0, input_ids.shape[1], step):
                values = row_values(input_ids[row, start : start + step].unsqueeze(-1), layers).flatten()
                expected = torch.index_select(table, 0, values, out=buffer[: values.numel()])
                got = got_all[row, start : start + step].reshape(-1, hidden_size)
                if not torch.equal(got.view(torch.int16), expected.view(torch.int16)):
                    flat, column = (got.view(torch.int16) != expected.view(torch.int16)).nonzero()[0].tolist()
                    position, layer = divmod(flat, len(which))
                    return (
                        f"{name} differs at row {row}, position {start + position}, column {layer * hidden_size + column}: "
                        f"{got[flat, column]} != {expected[flat, column]}"
                    )
    return None


def resident_bytes(pid: int | str = "self", field: str = "VmRSS") -> int:
    """A process's resident memory now (VmRSS) or at its peak (VmHWM), from /proc."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/{pid}/status has no {field}")


def rank_main(argv: Sequence[str] | None = None) -> None:
    """``python -m draftfeed.bench.frontier FRONTEND SERVICE TOKENS COUNT DEPTH LAYER_IDS [HIDDEN LAYERS]``: a
    training rank iterating COUNT one-row batches of TOKENS through ``RemoteDSparkTarget`` with DEPTH in flight,
    checking every byte (with ``--data-plane gloo``, ``nccl`` or ``nixl``, small rows first until one came over that
    plane); one JSON line: the sample's bytes, seconds per batch, the peak resident memory above the connected rank's,
    and the first difference (null when exact)."""
    import argparse
    import json
    import time

    from draftfeed import RemoteDSparkTarget

    parser = argparse.ArgumentParser(prog="python -m draftfeed.bench.frontier")
    for name in ("frontend", "service"):
        parser.add_argument(name)
    for name in ("tokens", "count", "depth"):
        parser.add_argument(name, type=int)
    parser.add_argument("layer_ids", type=lambda text: [int(i) for i in text.split(",")])
    parser.add_argument("--hidden-size", type=int, default=HIDDEN)
    parser.add_argument("--num-hidden-layers", type=int, default=LAYERS)
    parser.add_argument("--data-plane", default="auto")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)

    def batch(number: int, tokens: int = args.tokens) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, 1000, (1, tokens), generator=torch.Generator().manual_seed(number))
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids)}

    batches = [batch(number) for number in range(args.count)]
    difference, seconds, nbytes = None, [], 0
    with RemoteDSparkTarget(args.frontend, args.service, prefetch_depth=args.depth, data_plane=args.data_plane) as remote:
        remote.model_info()
        if args.data_plane in ("gloo", "nccl", "nixl"):  # small rows until one comes over the plane: it is open
            deadline = time.monotonic() + 120
            stats = remote.connection_stats
            while stats.received_over_pair + stats.received_over_nixl == 0 and time.monotonic() < deadline:
                remote.generate_batch(**batch(0, tokens=64))
        warm_up = (remote.connection_stats.received_over_pair, remote.connection_stats.received_over_nixl)
        baseline = resident_bytes()
        started = time.perf_counter()
        for sent, supervision in remote.iterate(batches):
            seconds.append(time.perf_counter() - started)
            received = {name: getattr(supervision, name) for name in ("target_hidden_states", "target_last_hidden_states")}
            nbytes = sum(t.numel() * t.element_size() for t in received.values())
            difference = difference or first_difference(received, sent["input_ids"], args.layer_ids, args.num_hidden_layers, args.hidden_size)
            del supervision, received
            started = time.perf_counter()
        peak = resident_bytes(field="VmHWM") - baseline
        stats = remote.connection_stats
        partial = remote.partial_answers()
    result = {
        "bytes": nbytes,
        "seconds": seconds,
        "peak_above_baseline": peak,
        "difference": difference,
        "received_over_pair": stats.received_over_pair - warm_up[0],
        "received_over_nixl": stats.received_over_nixl - warm_up[1],
        "received_in_pieces": stats.received_in_pieces,
        "asked_again": stats.lost_over_pair,
        "resyncs": stats.resyncs,
        "partial_answers_left": partial,
        "transfer_bytes_per_s": stats.bytes_in_pieces / stats.seconds_in_pieces if stats.seconds_in_pieces else None,
    }
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    rank_main()
