"""The prose of docs/performance.md: what each scenario measures and how to read it. A number in it is either a
constant of the scenario or read from the run's rows (``Found``); none is typed in."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from draftfeed.bench.harness import Row
from draftfeed.bench.synthetic import DRAFT_VOCAB, HIDDEN


class Found:
    """One scenario's rows, looked up by the start of their case."""

    def __init__(self, rows: list[Row]) -> None:
        self.rows = rows

    def row(self, start: str) -> Row | None:
        return next((row for row in self.rows if row.case.startswith(start)), None)

    def value(self, start: str, digits: int = 2) -> str:
        return self._shown(start, "value", digits)

    def ratio(self, start: str, digits: int = 2) -> str:
        return self._shown(start, "ratio", digits)

    def baseline(self, start: str, digits: int = 2) -> str:
        return self._shown(start, "baseline", digits)

    def _shown(self, start: str, field: str, digits: int) -> str:
        found = self.row(start)
        return "(not measured)" if found is None else f"{getattr(found, field):,.{digits}f}"


@dataclass(frozen=True)
class Section:
    name: str  # the scenario's CLI name
    scenario: str  # Row.scenario of its rows
    title: str
    measures: str
    notes: Callable[[Found], str] | None = None


def _broker(found: Found) -> str:
    routed = "requests routed per second by the broker alone"
    against = "requests routed per second by the broker against"
    return (
        f"The broker routed {found.value(routed, 0)} requests a second, {found.ratio(against)} of a policy-free forwarder of "
        "the same messages between the same raw peers (a welcome for the hello, a dispatch written for each submit, "
        "nothing parsed, recorded or checked), which is the most any Python broker of this protocol routes here. A "
        "routed request is four messages through three processes (submit, dispatch, result, done) where the direct "
        "echo is two through two, all on the same cores, so the echo is a ceiling no broker reaches; the forwarder is "
        "the baseline that says what the broker's policy costs."
    )


def _cluster(found: Found) -> str:
    rate = "requests per second, "
    return (
        f"Where one broker saturates: its cost per request does not grow with the number of peers "
        "(tests/test_broker_scale.py counts the calls each event makes at 100 x 10 and at 10,000 x 1,000 peers and "
        f"finds them equal), so what bounds one broker is its one core, not the size of the cluster. In this run it routed "
        f"{found.value(rate, 0)} requests a second, {found.ratio(rate)} of the ideal, at {found.value('broker CPU per 1,000', 3)} s of CPU per 1,000 requests, "
        f"where the forwarder, which checks nothing, used {found.baseline('broker CPU per 1,000', 3)} s and reached "
        f"{found.baseline('requests per second against', 0)} a second. When the forwarder misses the ideal too, the "
        "limit is one Python process parsing these messages on one core (and the simulator's core), not the broker's "
        "policy. Heartbeats cost per peer and per interval, not per request: a 10,000-rank run on one broker takes a "
        "2-5 s `--heartbeat-interval`. A cluster past one broker's rate runs one broker per group of services (each "
        "service's ranks and workers on one broker; services are independent, so rates add up). The broker keeps "
        "about 230 bytes for each (worker, rank) pair that has reported, so its memory grows until every pair has "
        "reported and is flat after; after every peer says bye it holds nothing of them (the last row)."
    )


def _real_target(found: Found) -> str:
    row = found.row("tiny Llama")
    share = "(not measured)" if row is None else f"{1 - row.ratio:.2f}"
    return (
        f"The pipeline's share of a batch's time is 1 - ratio: {share} here, for a target whose forward takes a few "
        "tenths of a second on a CPU. A GPU forward of a real target is longer and the pipeline's part the same."
    )


def _long_rows(found: Found) -> str:
    from draftfeed.bench.scenarios.long_rows import CHUNK_TOKENS, DRAFT, LONGEST, VOCAB

    whole = LONGEST * VOCAB * 4
    chunk = CHUNK_TOKENS * VOCAB * 4
    return (
        f"Whole, a {LONGEST:,}-token row's float32 logits alone are {LONGEST:,} x {VOCAB:,} x 4 bytes = {whole / 1e9:.1f} GB, "
        f"and the shift copies them once more; chunked by {CHUNK_TOKENS:,} tokens, one chunk's are {chunk / 1e6:.0f} MB. "
        f"What remains of the chunked worker's peak is the process itself (torch, the model) and the answer (the "
        f"{LONGEST:,} x {DRAFT:,} probabilities, {LONGEST * DRAFT * 4 / 1e6:.0f} MB, and the staging it goes through)."
    )


SECTIONS = (
    Section(
        "codec",
        "codec",
        "Packing and unpacking",
        "packing the EAGLE-3 supervision of one batch (8B shapes) into frames and rebuilding tensors from them, against "
        "a memcpy of the same bytes into a prefaulted buffer, and against the one-blob encoding (a header plus every "
        "byte copied into one buffer); and the two checks a worker may run over every answer (the finite check, always "
        "on; XXH3 digests, `--checksum`), each against the same memcpy.",
        lambda _: (
            "Encoding makes memoryviews of the tensors (no copy), so its rate is far above memcpy's; decoding views "
            "the frames in place. The finite check is one `torch.aminmax` a tensor."
        ),
    ),
    Section(
        "data-plane",
        "data plane",
        "Frames, worker to rank",
        "supervision bytes per second from a synthetic worker to a rank, through the broker's dispatch but not through "
        "the broker (one hop), against raw pyzmq zero-copy DEALER -> ROUTER of the same sizes between two processes. Each "
        "size runs with and without `GLIBC_TUNABLES=glibc.malloc.hugetlb=1` in the receiving process; page faults per "
        "message are in each case.",
        lambda _: (
            "A page fault is a page of the receiving process's memory touched for the first time. Whole messages land "
            "in a fresh buffer that libzmq allocates for each, and glibc serves chunks over 32 MB with a new mmap and "
            "unmaps them on free, so every 4 KiB page of each such message faults; an answer in pieces is written into "
            'the one allocation the rank makes for it (docs/data-planes.md, "Large answers"). The receiving process is '
            "the training rank, which the user starts, and glibc reads its tunables once, at start: to give its large "
            "allocations huge pages, either start the ranks with `GLIBC_TUNABLES=glibc.malloc.hugetlb=1` (and "
            "`THP_MEM_ALLOC_ENABLE=1` for torch's own allocations), or call `draftfeed.reexec_with_hugepage_malloc()` "
            "first thing in the training script, which restarts the process in place (same pid, arguments and "
            "environment, so torchrun notices nothing) with both set."
        ),
    ),
    Section(
        "pair-plane",
        "pair plane",
        "The pair group (gloo on CPU)",
        "the same synthetic supervision on a gloo pair group (docs/data-planes.md), against frames through the same "
        "pipeline in the same run, and against raw gloo send/recv of one tensor of the same size between two processes.",
        lambda _: (
            "On CPUs gloo moves bytes through TCP on loopback as ZeroMQ does, with a copy into a gloo buffer on "
            "each side: the pair group on CPU is for tests and CPU-only setups. Its point is NCCL between GPUs on one "
            "machine, device to device, which this machine cannot measure."
        ),
    ),
    Section(
        "nixl",
        "nixl plane",
        "NIXL",
        "the same synthetic supervision on the nixl plane, against frames through the same pipeline in the same run and "
        "against raw NIXL writes of the same bytes between two processes, on one host and between two network "
        "namespaces over UCX tcp (where this process may make namespaces); 3 GB a case.",
        lambda _: (
            "The rank's receive slots are touched once and registered once, so a receive takes a handful of page "
            "faults where frames take one per 4 KiB page (in each case above). Host memory registered with NIXL starts on a "
            "page boundary and tensors sit on 64-byte lines in a slot, because a copy between addresses that differ modulo "
            "64 runs markedly slower here (docs/data-planes.md). Between namespaces UCX's tcp transport is no faster than "
            "libzmq's TCP, so there the baseline and both planes move together with the run's noise."
        ),
    ),
    Section(
        "encryption",
        "encryption",
        "CURVE",
        "supervision and 1-token requests through a `--secure` pipeline (CURVE on every socket) against the same "
        "pipeline in plaintext, in the same run.",
    ),
    Section(
        "broker",
        "broker",
        "The broker's rate",
        "one-byte requests routed through the broker between a raw-pyzmq rank and worker, per second, against a direct "
        "DEALER -> ROUTER echo and against a policy-free forwarder of the same messages; the broker's CPU per routed "
        "request; and a draftfeed rank with 2 synthetic workers end to end, one request at a time for the latencies.",
        _broker,
    ),
    Section(
        "cluster",
        "cluster",
        "One broker for a cluster",
        "simulated ranks and workers (draftfeed/bench/cluster/; 1,000 x 256 at 60 ms a request by default, flags "
        "`--ranks`, `--workers`, `--compute-ms`, `--prefetch`, `--capacity`) speak the protocol to a real broker, then "
        "the same peers to a policy-free forwarder of the same messages, in the same run. The broker's main thread has "
        "one core, the simulator the other. Rate against the ideal (workers / compute time), the broker's dispatch "
        "latency (from when a request could go to its dispatch), its CPU per 1,000 requests and its memory, "
        "`draftfeed status` under the load, and that every request went once and in order.",
        _cluster,
    ),
    Section(
        "overlap",
        "overlap",
        "Prefetch hides the target",
        "a training loop with a fixed step time and a synthetic worker with a shorter fixed compute time: the share of "
        "wall time the loop waits for supervision at each prefetch depth.",
        lambda _: (
            "At depth 0 the loop waits for every answer; from depth 1 the next answer is computed during the "
            "step, and what remains is the rank's own work on each batch (unpacking, the reorder buffer)."
        ),
    ),
    Section(
        "scaling",
        "scaling",
        "More workers",
        "batches per second with 1, 2 and 4 synthetic workers (a fixed compute time standing for a GPU forward) against "
        "one worker's rate times their number.",
    ),
    Section(
        "real-target",
        "real target",
        "A real target",
        "the hf engine on the tiny Llama, end to end one batch at a time, against the same task called in-process.",
        _real_target,
    ),
    Section(
        "tensor-parallel",
        "tensor parallel",
        "Tensor parallel",
        "a worker at `--tensor-parallel 2` (the tiny Llama sharded over two processes, gloo) end to end one batch at a "
        "time, against the same task over the same two-process engine in-process; and the same over two network-"
        "namespace hosts (`--nnodes 2`).",
        lambda _: (
            "On 2 cores the two processes of the target take both cores, so the rank's and the broker's work in "
            "the end-to-end run take their time from the forward."
        ),
    ),
    Section(
        "automodel-sharding",
        "automodel sharding",
        "The automodel engine over two processes",
        "a tiny DeepSeek-V3 (16 experts, hidden 256) under NeMo's own model code sharded over two processes (NeMo's FSDP, "
        "and its expert mesh with `--expert-parallel`) against the same engine in one process: rank 0's parameter bytes "
        "against the whole target's, and a DSpark batch's time.",
        lambda _: (
            "Both ranks compute every batch (the worker's ranks run in step), so two processes hold half the target each "
            "but are not faster: on 2 cores they share the cores and add the gathers. Under FSDP alone NeMo keeps "
            "lm_head whole on every rank, hence a little over half. Run with nemo-automodel importable "
            "(`PYTHONPATH=.nemo-packages draftfeed bench --scenario automodel-sharding`)."
        ),
    ),
    Section(
        "long-rows",
        "long rows",
        "Long rows",
        "tokens per second for one row at S = 2k to 16k end to end against the same row in process (a tiny Llama with a "
        "32,000-token vocabulary, OMP_NUM_THREADS=1), and a worker's peak memory serving the longest row with its "
        "vocab-sized step chunked (`--chunk-tokens`) and whole.",
        _long_rows,
    ),
    Section(
        "frontier-rows",
        "frontier",
        "Frontier rows",
        "DSpark samples of 1, 4 and 16 GB (a 7168-wide target, `FakeFrontierEngine`: no model) from a worker to a rank "
        "at prefetch 0, in pieces of `--transfer-chunk-bytes`: the rate from each sample's header to its last piece "
        "against raw pyzmq moving one message of the same size between two processes, and the rank's and the worker's "
        "peak memory in samples. Sizes this machine's memory cannot hold are left out (said on stderr).",
        lambda _: (
            "The rank allocates each answer once and writes each piece into place, so its peak stays near one "
            "sample; the worker holds its layers and their concatenation. Raw pyzmq moves one message and nothing else."
        ),
    ),
    Section(
        "store",
        "store",
        "The store",
        "bytes per token on disk for each form; replaying a recorded epoch through `iterate()` against reading the same "
        "shards with safetensors, and against computing the epoch with one worker; and the training loop while "
        "recording against the same loop without a store.",
    ),
    Section(
        "weight-updates",
        "updates",
        "Weight updates",
        "the time from `publish_weights` to the first batch served at the new version, for a random-weight Llama of about "
        "1 GB in float32, against restarting the worker from the same weights and against raw pyzmq moving the same bytes; "
        'and a rank\'s longest wait for a batch under `version_policy="latest"` while the weights are published every 4 '
        "batches, against the same loop without updates.",
    ),
    Section(
        "speculators",
        "speculators",
        "speculators' trainer",
        "speculators' own trainer (EAGLE-3, 2 rows a step) on draftfeed against the same trainer on its offline files, "
        "from the same data on the same machine: the time it waits for each step's samples (its own `fetch_ms`) and its "
        "step time, the first step left out. The service runs `FakeFrontierEngine` at the verifier's shape (no model: a "
        "target's forward would share the cores with the trainer, which offline files never do), and the offline files "
        "hold the same values. It runs where speculators is installed: `.venv-vllm/bin/python -m draftfeed bench "
        "--scenario speculators`.",
        lambda _: (
            "The step time includes the trainer's forward and backward, which on 2 cores share the CPU with the "
            "rank's IO thread, the broker and the worker; on a GPU trainer they do not."
        ),
    ),
)

# Bytes per token of each EAGLE-3 form for an 8B target (H = 4096, 32k draft vocab).
AUX = 3 * HIDDEN * 2
FORMS = {
    "probs (float32, default)": AUX + DRAFT_VOCAB * 4 + 1 + 16,
    "probs-bf16 (lossy)": AUX + DRAFT_VOCAB * 2 + 1 + 16,
    "hidden (compact)": AUX + HIDDEN * 2 + 8 + 16,
}
_PROBS = FORMS["probs (float32, default)"]
_FORMS_TABLE = "\n".join(
    f"| {name} | {per_token / 1024:.1f} KiB | {per_token * 2048 / 1e6:.1f} MB | {_PROBS / per_token:.2f}x fewer |"
    for name, per_token in FORMS.items()
)

FOOTER = f"""## Fewer bytes: the forms of EAGLE-3 supervision

`draftfeed launch worker --supervision probs|probs-bf16|hidden`. Per token and per B=1, S=2048 batch, 8B target
(computed from the shapes, not measured):

| form | per token | per batch | against probs |
|---|---|---|---|
{_FORMS_TABLE}

- `probs`: the contract's float32 probabilities; the default, bit-exact.
- `probs-bf16`: the same probabilities rounded to bfloat16 on the worker and widened to float32 on the rank: lossy,
  at most 2^-8 relative error by construction (tests/test_compact.py measures it).
- `hidden`: the worker sends the post-norm final hidden state [B,S,H] and the full-vocab argmax [B,S] instead of the
  probabilities; the rank rebuilds `target_probs` with the draft rows of the target's lm_head (fetched once) and the
  target's logit transform (checked against a real forward at worker start), and `position_mask` from the argmax.
  With the identity mapping the rebuild runs the worker's operations in the same order and is bit-identical; with a
  draft subset the matmul runs over fewer rows and may differ in the last bits on a GPU (docs/contract.md). The rank
  pays one [S,H] x [H,Vd] matmul per batch.
"""
