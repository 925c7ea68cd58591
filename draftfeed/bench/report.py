"""Rendering a bench run as docs/performance.md with a plot."""

from __future__ import annotations

from pathlib import Path

from draftfeed.bench.harness import Row, format_table
from draftfeed.bench.synthetic import DRAFT_VOCAB, HIDDEN

# Bytes per token of each EAGLE-3 form for an 8B target (H = 4096, 32k draft vocab).
AUX = 3 * HIDDEN * 2
FORMS = {
    "probs (float32, default)": AUX + DRAFT_VOCAB * 4 + 1 + 16,
    "probs-bf16 (lossy)": AUX + DRAFT_VOCAB * 2 + 1 + 16,
    "hidden (compact)": AUX + HIDDEN * 2 + 8 + 16,
}


def plot(rows: list[Row], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    data = [r for r in rows if r.scenario == "data plane"]
    if not data:
        return False
    figure, axis = plt.subplots(figsize=(8, 4))
    labels = [r.case.split(" (")[0].replace(" worker -> rank", "") for r in data]
    positions = range(len(data))
    axis.bar([p - 0.2 for p in positions], [r.baseline for r in data], width=0.4, label="raw pyzmq (same run)")
    axis.bar([p + 0.2 for p in positions], [r.value for r in data], width=0.4, label="draftfeed worker -> rank")
    axis.set_xticks(list(positions), labels, rotation=20, ha="right", fontsize=8)
    axis.set_ylabel("GB/s")
    axis.set_title("Supervision bytes per second over loopback TCP")
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return True


def render(rows: list[Row], quick: bool, command: str, docs: Path, note: str | None = None) -> Path:
    docs.mkdir(parents=True, exist_ok=True)
    image = docs / "performance-data-plane.png"
    has_plot = plot(rows, image)
    probs = FORMS["probs (float32, default)"]
    forms = "\n".join(
        f"| {name} | {per_token / 1024:.1f} KiB | {per_token * 2048 / 1e6:.1f} MB | {probs / per_token:.2f}x fewer |"
        for name, per_token in FORMS.items()
    )
    text = f"""# Performance

Numbers from `{command}`{" (quick mode: smaller payloads and fewer repetitions)" if quick else ""}, on this project's
2-core build machine. Every value is measured beside its baseline in the same run; read the ratios, not the
absolute figures (shared hosts are noisy). Regenerate with `draftfeed bench --report`.{chr(10) + chr(10) + "Note: " + note + "." if note else ""}

```
{format_table(rows)}
```
{"![data plane](performance-data-plane.png)" if has_plot else ""}

## What each scenario measures

- **codec**: packing the EAGLE-3 supervision of one batch (8B shapes) into frames and rebuilding tensors from
  them, against a memcpy of the same bytes into a prefaulted buffer, and against the one-blob encoding (header
  plus every byte copied into one buffer). Encoding makes memoryviews of the tensors (no copy), so its
  "rate" is far above memcpy; decoding views the frames in place.
- **data plane**: supervision bytes per second from a synthetic worker to a rank, through the broker's
  dispatch but not through the broker (one hop), against raw pyzmq zero-copy DEALER -> ROUTER of the same
  sizes between two processes. Each size runs with and without `GLIBC_TUNABLES=glibc.malloc.hugetlb=1` in the
  receiving process; page faults per message are shown.
- **pair plane**: the same synthetic supervision on a gloo pair group (docs/data-planes.md), against frames
  through the same pipeline in the same run, and against raw gloo send/recv of one tensor of the same size
  between two processes.
- **encryption**: supervision and 1-token requests through a `--secure` pipeline (CURVE on every socket)
  against the same pipeline in plaintext, in the same run.
- **cluster**: one broker for a cluster: simulated ranks and workers (draftfeed/bench/cluster/, 1,000 x 256 at
  60 ms a request by default; flags `--ranks`, `--workers`, `--compute-ms`, `--prefetch`, `--capacity`) speaking
  the protocol to a real broker, and to a policy-free forwarder of the same messages with the same peers in the same
  run. The broker's main thread has one core, the simulator's the other. Rate against the ideal (workers / compute
  time), the broker's own dispatch latency (from when a request could go to its dispatch), its CPU per 1,000
  requests and its memory, `draftfeed status` under the load, every request once and in order.
- **broker**: one-byte requests routed through broker and synthetic workers and answered, per second, and
  the latency of one request at a time; the baseline is a direct DEALER -> ROUTER echo.
- **overlap**: a training loop with a fixed step time and a worker with a fixed compute time shorter than it:
  the share of wall time the training loop waits for supervision at each prefetch depth.
- **scaling**: batches per second with 1, 2 and 4 synthetic workers (fixed compute time, standing for a GPU
  forward) against 1 worker's rate times their number.
- **real target**: the hf engine on the tiny Llama, end to end one batch at a time, against the same task
  called in-process: the pipeline's share of the time is 1 - ratio.
- **tensor parallel**: a worker at `--tensor-parallel 2` (the tiny Llama sharded over two processes, gloo) end to end
  one batch at a time, against the same task over the same two-process engine in-process (goal 0.9). On 2 cores
  the two processes of the target take both cores, so the rank's and the broker's work in the end-to-end run
  takes its time from the forward.
- **long rows**: tokens per second at S = 2k to 16k end to end against the same row in process, and a worker's peak
  memory serving a 16k row with its vocab-sized step chunked and whole.
- **frontier rows**: DSpark samples of 1, 4 and 16 GB (a 7168-wide target, FakeFrontierEngine: no model) from a
  worker to a rank at prefetch 0, in pieces of `--transfer-chunk-bytes`: the rate from each sample's header to its
  last piece against raw pyzmq moving one message of the same size between two processes, and the rank's and the
  worker's peak memory in samples (sizes this machine's memory cannot hold are left out, said on stderr).

## Page faults on large receives

libzmq allocates a fresh buffer for every received message; glibc serves chunks over 32 MB with a new mmap
and unmaps them on free, so every 4 KiB page of every large message faults (measured here: 1.58 M faults for 6 GB of 64 MB messages, 5-9 s of kernel time against 0.1 s of user time).
The receiving process is the training rank, which the user starts. glibc reads its tunables once, at
start, so either start the ranks with `GLIBC_TUNABLES=glibc.malloc.hugetlb=1` (and `THP_MEM_ALLOC_ENABLE=1`
for torch's own allocations) in their environment, or call `draftfeed.reexec_with_hugepage_malloc()` first
thing in the training script: the process restarts in place (same pid, arguments and environment, so
torchrun notices nothing) with both set. The data-plane rows above show the difference with and without it.

## Fewer bytes: the forms of EAGLE-3 supervision

`draftfeed launch worker --supervision probs|probs-bf16|hidden`. Per token and per B=1, S=2048 batch, 8B target:

| form | per token | per batch | against probs |
|---|---|---|---|
{forms}

- `probs`: the contract's float32 probabilities; the default, bit-exact.
- `probs-bf16`: the same probabilities rounded to bfloat16 on the worker and widened to float32 on the rank:
  lossy, measured maximum relative error 3.9e-3 (at most 2^-8 by construction; tests/test_compact.py).
- `hidden`: the worker sends the post-norm final hidden state [B,S,H] and the full-vocab argmax [B,S]
  instead of the probabilities; the rank rebuilds `target_probs` with the draft rows of the target's lm_head
  (fetched once) and the target's logit transform (checked against a real forward at worker start), and
  `position_mask` from the argmax. The probabilities alone shrink 16x (125 KB to 8 KB a token); with the aux
  hidden states, which every form carries, the batch shrinks 4.6x. Measured on the tiny targets: bit-identical
  to the probs form with the identity mapping (the same operations in the same order), and maximum absolute
  difference 0 with a 128-of-1000 draft vocabulary on CPU (a GPU's matmul over fewer rows may differ in the
  last bits). The rank pays one [S,H] x [H,Vd] matmul per batch: 1.1 ms on an H200 for S = 2048, Vd = 32000.
"""
    path = docs / "performance.md"
    path.write_text(text)
    return path
