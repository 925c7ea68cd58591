"""Frontier rows: multi-gigabyte samples move in pieces, exact, in bounded memory (docs/data-planes.md, "Large
answers").

The worker runs ``FakeFrontierEngine`` (draftfeed/bench/frontier.py: no model, named as a fake) behind the real
DSpark task, so a 32k row at DeepSeek-V3's width (5 layers of H = 7168 plus the last hidden state, bfloat16: 2.8 GB)
comes through the real broker, worker and rank; the rank (a process of its own, ``python -m draftfeed.bench.frontier``)
checks every byte against the engine's formula and reports its peak memory. What moving in pieces changes is tested
in process below it: the plan, the rank's assembly (pieces in place, partial answers freed) and the broker's one
retry of an answer that stalled.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import FAST_LIVENESS, WORKER_ENV, Cluster, wait_until
from support import preload

from draftfeed import RemoteDSparkTarget
from draftfeed.bench.frontier import HIDDEN, LAYERS, frontier_dspark, resident_bytes
from draftfeed.bench.hosts import Hosts
from draftfeed.dataplane.frames.chunks import Piece, chunk_plan
from draftfeed.dataplane.frames.codec import encode_specs
from draftfeed.dataplane.frames.rank_chunks import ChunkAssemblies
from draftfeed.dataplane.frames.worker_chunks import ChunkedResult
from draftfeed.dataplane.nixl.transport import unavailable
from draftfeed.processes import commands
from draftfeed.schemas.frames import pack, unpack
from draftfeed.schemas.messages import DATA_INBOUND, Result, TensorSpec

pytestmark = pytest.mark.timeout(300)
ENGINE = "draftfeed.bench.frontier:FakeFrontierEngine"
LAYER_IDS = [1, 15, 30, 45, 60]  # DSpark's five target layers on a 61-layer target (60: the last, post-norm)
TOKENS = 32_768
MARGIN = 1 << 30  # what the rank and the worker may hold beyond the samples themselves (pieces in sockets, checks)


def frontier_worker(cluster: Cluster, target, name: str, *flags: str):
    worker = cluster.add_worker(
        target,
        "--engine",
        ENGINE,
        "--task",
        "dspark",
        "--target-layer-ids",
        ",".join(map(str, LAYER_IDS)),
        "--service",
        "frontier",
        "--name",
        name,
        *flags,
    )
    return worker


RANK_ENV = {**os.environ, **WORKER_ENV}  # the rank is forked from the suite's preloader (support/preload.py)


def run_rank(cluster: Cluster, tokens: int, count: int, depth: int, plane: str) -> dict:
    args = [cluster.frontend, "frontier", str(tokens), str(count), str(depth), ",".join(map(str, LAYER_IDS)), "--data-plane", plane]
    done = preload.run_module("draftfeed.bench.frontier", args, RANK_ENV, timeout_s=240)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def frontier(tiny_target):
    cluster = Cluster()
    try:
        # A nixl grant of a 2.8 GB slot waits for its memory to be touched (seconds on a loaded machine): a long pair
        # timeout keeps the worker from giving up on the grant and sending frames instead.
        worker = frontier_worker(cluster, tiny_target, "frontier-0", "--capacity", "1", "--pair-timeout", "120")
        yield cluster, worker
    finally:
        cluster.stop()


@pytest.mark.parametrize(
    "plane, depth, count",
    [
        pytest.param("frames", 1, 2, marks=pytest.mark.long),
        pytest.param("frames", 2, 2, marks=pytest.mark.long),  # 5.6 GB through frames, the suite's longest test: make test-long
        ("nixl", 1, 1),
        pytest.param("gloo", 1, 1, marks=pytest.mark.long),
    ],
)
def test_32k_rows_at_frontier_width_are_exact_in_bounded_memory(frontier, plane, depth, count):
    """Each plane as the rank asks for it (the rank opens a pair group or nixl pair with small rows first)."""
    if plane == "nixl" and unavailable() is not None:
        pytest.skip(f"nixl: {unavailable()}")
    cluster, worker = frontier
    Path(f"/proc/{worker.popen.pid}/clear_refs").write_text("5")  # its peak (VmHWM) from now
    idle = resident_bytes(worker.popen.pid)
    result = run_rank(cluster, TOKENS, count, depth, plane)
    sample = result["bytes"]
    assert sample == TOKENS * HIDDEN * 2 * (len(LAYER_IDS) + 1), sample
    assert result["difference"] is None, result["difference"]
    rank_ratio = result["peak_above_baseline"] / sample
    worker_ratio = (resident_bytes(worker.popen.pid, "VmHWM") - idle) / sample
    over = {"frames": count, "nixl": result["received_over_nixl"], "gloo": result["received_over_pair"]}[plane]
    print(
        f"\n{plane}: {TOKENS}-token row, {sample / 1e9:.2f} GB a sample, prefetch {depth}: rank peak {rank_ratio:.2f} x the sample "
        f"(in flight {depth}, plus the one the loop holds), worker peak {worker_ratio:.2f} x; {over} of {count} over {plane}; "
        f"seconds a batch {[round(seconds, 1) for seconds in result['seconds']]}"
    )
    assert over == count, f"{over} of {count} answers came over {plane}"
    # In flight: depth answers, each allocated once when its header comes, plus the one the loop holds (and the
    # rank's check of it, a few thousand positions at a time: in the margin).
    assert result["peak_above_baseline"] <= (depth + 1) * sample + MARGIN, rank_ratio
    # The worker: one copy, the contract's tensors (each captured layer written into its place as it is computed, never
    # the layers and their concatenation: engines/joining.py), nothing copied for sending.
    assert resident_bytes(worker.popen.pid, "VmHWM") - idle <= sample + MARGIN, worker_ratio
    assert result["resyncs"] == 0 and result["asked_again"] == 0, "the rank lost the broker, or an answer, during the transfers"
    status = cluster.status()
    assert status["counters"]["ranks_expired"] == 0 and status["counters"]["workers_expired"] == 0, status["counters"]
    assert status["requeues"] == {}, status["requeues"]


@pytest.mark.long  # 60 s on 2 cores; the suite keeps the piece-by-piece protocol's faults in-process (below)
def test_a_worker_killed_mid_transfer_costs_its_batch_nothing(fast_cluster, tiny_target):
    """The worker dies with part of a 1.4 GB answer at the rank: the partial answer is freed, the batch comes whole
    from the next worker, exact."""
    tokens = 16_384
    first = frontier_worker(fast_cluster, tiny_target, "dying", "--transfer-chunk-bytes", str(1 << 20))
    ids = torch.randint(0, 1000, (1, tokens), generator=torch.Generator().manual_seed(5))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids)}
    with RemoteDSparkTarget(fast_cluster.frontend, "frontier", prefetch_depth=1) as remote:
        future = remote.generate_batch_async(**batch)
        wait_until(lambda: remote.partial_answers()["bytes"] > 0, poll_s=0.001, what="pieces to arrive")
        first.popen.send_signal(signal.SIGKILL)
        frontier_worker(fast_cluster, tiny_target, "second")
        supervision = remote.wait(future)
        assert remote.partial_answers()["bytes"] == 0, f"a partial answer is left: {remote.partial_answers()}"
        expected = frontier_dspark(ids, batch["attention_mask"], LAYER_IDS, LAYERS, HIDDEN)
        assert torch.equal(supervision.target_hidden_states, expected["target_hidden_states"])
        assert torch.equal(supervision.target_last_hidden_states, expected["target_last_hidden_states"])


# ---------------------------------------------------------------- the pieces, in process
DTYPES = (torch.bfloat16, torch.float32, torch.int64, torch.bool)


def sample_tensors() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {f"t{number}": (torch.randn(3, 37, generator=generator) * 100).to(dtype) for number, dtype in enumerate(DTYPES)} | {
        "empty": torch.empty(0, 5),
        "scalar": torch.tensor(7.5),
    }


class Rank:
    """The rank's side of chunked answers, with the callbacks recorded."""

    def __init__(self, awaited: dict[int, object] | None = None) -> None:
        self.awaited = {0: "request-0"} if awaited is None else awaited
        self.answers: list[tuple[Result, dict]] = []
        self.lost: list[str] = []
        self.changed: list[str] = []
        self.refused: list[str] = []
        self.progress: list[int] = []
        self.assemblies = ChunkAssemblies(
            "cpu",
            1 << 30,
            lambda request_id, token: self.awaited.get(request_id),
            self.progress.append,
            lambda header, tensors, _seconds: self.answers.append((header, tensors)),
            lambda header, why: self.refused.append(why),
            lambda header, why: self.lost.append(why),
            lambda header, why: self.changed.append(why),
        )

    def take(self, frames: list) -> None:
        message, tensor_frames = unpack([bytes(memoryview(f)) for f in frames], DATA_INBOUND)
        if isinstance(message, Result):
            self.assemblies.begin(message)
        else:
            self.assemblies.piece(message, tensor_frames)


def chunked(tensors: dict[str, torch.Tensor], chunk_bytes: int, request_id: int = 0, worker: str = "w") -> ChunkedResult:
    return ChunkedResult(tensors, chunk_bytes, request_id=request_id, token=0, kind="dspark", worker=worker)


def test_the_plan_cuts_each_tensor_alone_and_covers_every_byte():
    specs = [
        TensorSpec(name="a", dtype="bfloat16", shape=[3, 5]),
        TensorSpec(name="e", dtype="int64", shape=[0]),
        TensorSpec(name="b", dtype="bool", shape=[4]),
    ]
    assert chunk_plan(specs, 8) == [Piece(0, 0, 8), Piece(0, 8, 8), Piece(0, 16, 8), Piece(0, 24, 6), Piece(2, 0, 4)]
    assert chunk_plan(specs, 1 << 20) == [Piece(0, 0, 30), Piece(2, 0, 4)]
    with pytest.raises(ValueError, match="complex64"):
        chunk_plan([TensorSpec(name="c", dtype="complex64", shape=[1])], 8)


@pytest.mark.parametrize("chunk_bytes", [1, 7, 64, 1 << 20])
def test_pieces_land_in_place_bit_for_bit(chunk_bytes):
    tensors = sample_tensors()
    answer = chunked(tensors, chunk_bytes)
    rank = Rank()
    rank.take(answer.header)
    for piece in answer.pieces():
        rank.take(piece)
    ((header, received),) = rank.answers
    assert list(received) == list(tensors) and len(rank.progress) == len(answer)
    for name, tensor in tensors.items():
        assert received[name].dtype == tensor.dtype and torch.equal(received[name], tensor), name
    assert len(rank.assemblies) == 0 and rank.assemblies.held_bytes == 0


def test_a_piece_out_of_order_or_of_the_wrong_size_frees_the_answer_and_asks_again():
    tensors = sample_tensors()
    for spoil in ("skip", "short"):
        answer = chunked(tensors, 16)
        rank = Rank()
        rank.take(answer.header)
        pieces = list(answer.pieces())
        rank.take(pieces[0])
        if spoil == "skip":
            rank.take(pieces[2])
        else:
            signature, header, payload = pieces[1]
            rank.take([signature, header, bytes(payload)[:-1]])
        assert rank.lost and "piece" in rank.lost[0] and "was due" in rank.lost[0], rank.lost
        assert rank.assemblies.held_bytes == 0
        for piece in pieces[1:]:  # the rest of the spoiled answer is dropped, piece by piece
            rank.take(piece)
        assert rank.answers == [] and rank.assemblies.pieces_dropped >= len(pieces) - 3


def test_a_new_answer_to_the_same_request_replaces_a_partial_one_and_a_gone_worker_frees_its_own():
    tensors = sample_tensors()
    rank = Rank()
    stalled = chunked(tensors, 16, worker="stalled")
    rank.take(stalled.header)
    rank.take(next(stalled.pieces()))
    held = rank.assemblies.held_bytes
    assert held > 0
    retry = chunked(tensors, 32, worker="retry")
    rank.take(retry.header)
    assert len(rank.assemblies) == 1 and rank.assemblies.held_bytes == held, "the stalled partial answer was freed"
    for piece in retry.pieces():
        rank.take(piece)
    assert len(rank.answers) == 1 and rank.answers[0][0].worker == "retry"
    rank.awaited[0] = "request-0 again"
    rank.take(stalled.header)
    rank.assemblies.worker_gone("stalled")
    assert rank.assemblies.held_bytes == 0


def test_an_answer_no_longer_awaited_allocates_nothing_and_one_over_the_limit_is_refused_before_any_piece():
    tensors = sample_tensors()
    rank = Rank(awaited={})
    late = chunked(tensors, 16)
    rank.take(late.header)
    assert rank.assemblies.held_bytes == 0 and rank.answers and rank.answers[0][1] == {}, "handed over empty: the session drops it"
    for piece in late.pieces():
        rank.take(piece)
    assert rank.assemblies.pieces_dropped == len(late)
    small = Rank()
    small.assemblies.max_result_bytes = 100
    small.take(chunked(tensors, 16).header)
    assert small.assemblies.held_bytes == 0
    assert small.refused and "over this rank's max_result_bytes of 100" in small.refused[0], small.refused


def test_a_device_tensor_is_sent_a_piece_at_a_time(monkeypatch):
    """A tensor not in host memory goes to the host one piece at a time, each when its message is made."""
    copies: list[int] = []
    real_cpu = torch.Tensor.cpu

    def counted_cpu(self, *args, **kwargs):
        copies.append(self.numel())
        return real_cpu(self, *args, **kwargs)

    tensor = torch.arange(1000, dtype=torch.float32)
    answer = chunked({"x": tensor}, 400)
    answer._flat[0] = tensor.view(torch.uint8)  # as a device tensor's flat bytes are held
    monkeypatch.setattr(torch.Tensor, "cpu", counted_cpu)
    rank = Rank()
    rank.take(answer.header)
    for piece in answer.pieces():
        rank.take(piece)
    assert copies == [400] * 10, copies
    assert torch.equal(rank.answers[0][1]["x"], tensor)
    assert [spec.name for spec in encode_specs({"x": tensor})] == ["x"]


@pytest.mark.long  # beside the worker killed mid-transfer: a cut link's partial answer is freed the same way
def test_a_link_cut_mid_transfer_between_hosts_costs_its_batch_nothing(hosts_available, tiny_target):
    """Broker, two workers and the rank on hosts of their own (network namespaces): the first worker's link is cut for
    good with part of a 1.4 GB answer at the rank. The broker finds the worker silent, the rank frees the partial
    answer and asks again, the second worker serves it, exact, and nothing is left of the partial one."""
    tokens = 16_384
    with Hosts(["broker", "w1", "w2", "rank"]) as hosts:
        started: list[commands.Process] = []
        try:
            broker = commands.start_broker(hosts.address("broker"), extra=FAST_LIVENESS, prefix=hosts.command("broker"))
            started.append(broker)

            def worker(name: str) -> commands.Process:
                flags = ["--engine", ENGINE, "--task", "dspark", "--target-layer-ids", ",".join(map(str, LAYER_IDS))]
                flags += ["--service", "frontier", "--name", name, "--transfer-chunk-bytes", str(1 << 20)]
                process = commands.start_worker(broker.ready["backend"], str(tiny_target), *flags, env=WORKER_ENV, prefix=hosts.command(name))
                started.append(process)
                return process

            worker("w1")
            args = [broker.ready["frontend"], "frontier", str(tokens), "1", "1", ",".join(map(str, LAYER_IDS)), "--data-plane", "frames"]
            rank = preload.popen_module("draftfeed.bench.frontier", args, RANK_ENV, prefix=hosts.command("rank"))
            try:

                def received() -> int:
                    read = [*hosts.command("rank"), "cat", "/sys/class/net/eth0/statistics/rx_bytes"]
                    return int(subprocess.run(read, capture_output=True, text=True, timeout=10).stdout)

                wait_until(lambda: received() > 200_000_000, timeout_s=120, poll_s=0.01, what="200 MB of the answer at the rank's host")
                hosts.cut("w1")
                worker("w2")
                done = preload.communicate(rank, timeout_s=180)
            finally:
                if rank.poll() is None:
                    rank.kill()
            assert done.returncode == 0, done.stderr[-3000:]
            result = json.loads(done.stdout.strip().splitlines()[-1])
            assert result["difference"] is None, result["difference"]
            assert result["partial_answers_left"]["bytes"] == 0 and result["partial_answers_left"]["answers"] == 0, result
            assert result["asked_again"] == 1, "the rank asks again for the answer its gone worker left partial"
            print(
                f"\nlink cut mid-transfer: served by w2, {result['bytes'] / 1e9:.2f} GB exact; partial answers left {result['partial_answers_left']}"
            )
        finally:
            for process in started:
                process.stop(timeout_s=5)


def test_an_answer_in_too_many_pieces_is_refused_before_anything_is_allocated():
    rank = Rank()
    specs = [TensorSpec(name="h", dtype="bfloat16", shape=[1, 1 << 20, 64])]  # 128 MiB in pieces of 16 bytes: 8M pieces
    rank.take(pack(Result(tensors=specs, chunk_bytes=16, request_id=0, token=0, kind="dspark", worker="w")))
    assert rank.assemblies.held_bytes == 0
    assert rank.refused and "pieces of 16 bytes" in rank.refused[0] and "--transfer-chunk-bytes" in rank.refused[0], rank.refused
