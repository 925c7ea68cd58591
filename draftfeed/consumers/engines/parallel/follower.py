"""A follower of a tensor-parallel worker: ``python -m draftfeed.consumers.engines.parallel.follower SPEC``.

It builds its rank of the engine, says hello, then makes each call the leader makes, in the same order, drops the
results (the leader keeps them) and acknowledges each call with whether it raised: a call that fails the same way on
every rank (a batch the model cannot take) leaves the group in step, and the leader decides whether it did.

From its start it says it is alive to rank 0 once a second, and ends itself when rank 0 falls silent (watch.py): on
another machine than rank 0 nothing else would end it when that machine goes.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import socket
import sys

import torch

from draftfeed.consumers.engines.base import Capture, Engine
from draftfeed.consumers.engines.parallel.commands import CaptureSpec, FollowerChannel, Forward, GoOn, Prepare, Stop, Update, Weight
from draftfeed.consumers.engines.parallel.ranked import build_ranked
from draftfeed.consumers.engines.parallel.spec import FollowerSpec
from draftfeed.consumers.engines.parallel.watch import FollowerWatch
from draftfeed.contract.packing import Documents

log = logging.getLogger("draftfeed.worker")

PR_SET_PDEATHSIG = 1
# After a call that raised here, how long rank 0 has to say every rank raised alike (it answers as soon as it has
# every ack; longer than its own wait for acks).
GO_ON_TIMEOUT_S = 20.0


def die_with(parent_pid: int) -> None:
    """SIGKILL this process when its parent (the worker's process, or its node's agent) ends, however it ends (Linux)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:  # it ended before the line above took effect
        os._exit(1)


def capture_of(spec: CaptureSpec) -> Capture:
    return Capture(layer_ids=tuple(spec.layer_ids), embeddings=spec.embeddings, final_hidden=spec.final_hidden, logits=spec.logits)


def serve(engine: Engine, channel: FollowerChannel) -> None:
    """Make the leader's calls until it says stop, acknowledging each with how it ended. After a call that raised,
    go on only if the leader says every rank raised the same way (``GoOn``) within ``GO_ON_TIMEOUT_S``; else exit."""
    while True:
        command, tensors = channel.receive()
        if isinstance(command, Stop):
            return
        if isinstance(command, GoOn) or command is None:
            continue  # a verdict that came late: the call it answers was already settled
        try:
            call(engine, command, tensors)
        except Exception as exc:  # the leader compares it with its own outcome of the same call
            channel.ack(command.call, exc)
            verdict, _ = channel.receive(timeout_s=GO_ON_TIMEOUT_S)
            if not (isinstance(verdict, GoOn) and verdict.call == command.call):
                log.error("call %d raised %s (%s), and rank 0 did not; this rank is out of step and exits", command.call, type(exc).__name__, exc)
                raise SystemExit(1) from None
        else:
            channel.ack(command.call)


def call(engine: Engine, command: Prepare | Forward | Weight | Update, tensors: dict[str, torch.Tensor]) -> None:
    if isinstance(command, Update):
        engine.update_weights(command.message, command.check_finite, command.timeout_s)  # type: ignore[attr-defined]
    elif isinstance(command, Prepare):
        engine.prepare([capture_of(c) for c in command.captures])
    elif isinstance(command, Weight):
        engine.input_embeddings() if command.which == "input" else engine.output_embeddings()
    elif "seq_lens" in tensors:
        documents = Documents(seq_lens=tensors["seq_lens"], position_ids=tensors["position_ids"])
        engine.forward(tensors["input_ids"], tensors["attention_mask"], capture_of(command.capture), documents=documents)  # type: ignore[call-arg]
    else:
        engine.forward(tensors["input_ids"], tensors["attention_mask"], capture_of(command.capture))


def main(argv: list[str]) -> int:
    spec = FollowerSpec.model_validate_json(argv[1])
    die_with(spec.parent_pid)
    built = spec.target
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C reaches the worker, which stops its followers itself
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # so does a SIGTERM sent to the worker's process group
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s tp-rank-{spec.rank}: %(message)s")
    FollowerWatch(spec.meeting.watch, spec.rank, spec.node_rank, socket.gethostname())
    _quiet_transformers()
    engine = build_ranked(built.engine, built.target, built.dtype, built.options, spec.place(), built.expert_parallel)
    channel = FollowerChannel(spec.meeting.channel, spec.rank)
    channel.hello()
    try:
        serve(engine, channel)
    finally:
        channel.close()
        engine.close()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return 0


def _quiet_transformers() -> None:
    import transformers

    transformers.logging.disable_progress_bar()
    transformers.logging.set_verbosity_error()


if __name__ == "__main__":
    sys.exit(main(sys.argv))
