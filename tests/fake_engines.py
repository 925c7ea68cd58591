"""Engines for fault tests, loaded by real worker processes with ``--engine fake_engines:NAME``.

Each is the real hf engine with one fault added where the real fault cannot be produced on demand here
(a GPU running out of memory, a forward slow enough to kill a worker in the middle of it).
"""

from __future__ import annotations

import os
import time

import torch

from draftfeed.consumers.engines.hf import HFEngine

# Token id at input_ids[0, 0] that makes FakeFlakyEngine fail.
OOM_MARKER = 7
CRASH_MARKER = 8


class FakeSlowEngine(HFEngine):
    """The hf engine, taking at least FAKE_FORWARD_S seconds (default 0.3) per forward: a big target's pace."""

    name = "fake-slow"

    def forward(self, input_ids, attention_mask, layer_ids):
        started = time.monotonic()
        out = super().forward(input_ids, attention_mask, layer_ids)
        time.sleep(max(0.0, float(os.environ.get("FAKE_FORWARD_S", "0.3")) - (time.monotonic() - started)))
        return out


class FakeFlakyEngine(HFEngine):
    """The hf engine, out of memory on batches that start with OOM_MARKER, crashing on CRASH_MARKER."""

    name = "fake-flaky"

    def forward(self, input_ids, attention_mask, layer_ids):
        first = int(input_ids[0, 0])
        if first == OOM_MARKER:
            raise torch.OutOfMemoryError("fake: CUDA out of memory. Tried to allocate 20.00 GiB")
        if first == CRASH_MARKER:
            raise ValueError("fake: the engine crashed on this batch")
        return super().forward(input_ids, attention_mask, layer_ids)


POISON_MARKER = 9


class FakeCrashingEngine(FakeSlowEngine):
    """FakeSlowEngine whose process dies in the middle of a forward of a batch that starts with POISON_MARKER, as
    a native crash in a kernel would take a real worker down (no Python exception, no goodbye)."""

    name = "fake-crashing"

    def forward(self, input_ids, attention_mask, layer_ids):
        if int(input_ids[0, 0]) == POISON_MARKER:
            time.sleep(0.3)  # some way into the forward
            os._exit(3)
        return super().forward(input_ids, attention_mask, layer_ids)


# Token ids at input_ids[0, 0] that make FakeNonFiniteEngine's output not finite, and where it puts the bad value:
# (row, position, column) of the output of the second layer it captures (NaN), of the last one (Inf).
NAN_MARKER, NAN_AT = 10, (0, 2, 5)
INF_MARKER, INF_AT = 12, (1, 3, 6)


class FakeNonFiniteEngine(HFEngine):
    """The hf engine, with NaN in one element of a batch that starts with NAN_MARKER and +Inf in one of a batch that
    starts with INF_MARKER: a target overflowing its dtype, or a bad shard, on one batch."""

    name = "fake-nonfinite"

    def forward(self, input_ids, attention_mask, capture, documents=None, images=None):
        out = super().forward(input_ids, attention_mask, capture, documents, images)
        first = int(input_ids[0, 0])
        parts, hidden = capture.joined.parts, self.shape.hidden_size  # every task joins its layers (engines/joining.py)
        layers = sorted(capture.joined.layer_ids())

        def spoil(layer: int, at: tuple[int, int, int], value: float) -> None:
            row, position, column = at
            out.joined[row, position, parts.index(layer) * hidden + column] = value

        if first == NAN_MARKER:
            spoil(layers[1], NAN_AT, float("nan"))
        elif first == INF_MARKER:
            spoil(layers[-1], INF_AT, float("inf"))
        return out
