"""A worker's settings and the choices its flags take, without torch (the CLI reads its defaults from here)."""

from __future__ import annotations

from dataclasses import dataclass

from draftfeed.schemas.protocol import DEFAULT_MAX_REQUEST_BYTES
from draftfeed.security.curve import PeerKeys

ENGINES = ("hf", "vllm", "sglang")  # or package.module:Class
DTYPES = ("auto", "float32", "bfloat16", "float16")  # auto: float32 on CPU, bfloat16 on accelerators
DEFAULT_DRAFT_LAYERS = 5  # DSpark: layers of the draft, for the default target layer ids


@dataclass
class WorkerConfig:
    """A worker's settings; each default is stated here once."""

    broker: str
    service: str
    capacity: int = 2  # requests the broker may hand this worker at once
    name: str | None = None  # default HOST-PID-random
    send_timeout_s: float = 60.0  # how long a rank may take to accept supervision before the worker gives up on it
    connect_timeout_s: float = 5.0  # how long to reach a rank's data socket the first time
    register_timeout_s: float = 60.0  # how long to wait for the broker at start
    drain_timeout_s: float = 10.0  # on SIGTERM, how long delivering the answer in hand may still take before it is given up
    data_plane: str = "auto"  # auto | frames | nccl | gloo | nixl (docs/data-planes.md)
    pair_timeout_s: float = 30.0  # a pair group's rendezvous and each transfer on it (nixl: the open, each grant and each write)
    nixl_min_bytes: int = 1 << 20  # a smaller answer goes as frames on a nixl pair too: its grant's round trip costs more than the copy
    keys: PeerKeys | None = None  # CURVE to the broker and to ranks (docs/security.md)
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES  # the largest frame and request this worker takes from the broker
    max_seq_len: int | None = None  # the longest row it takes; None: the target's max_position_embeddings
    # EAGLE-3: a batch of more positions computes its vocab-sized step this many positions at a time (0: never). The
    # default keeps that step's float32 logits near 4 GB for a 128k vocab, beside an 8B target on one H200.
    chunk_tokens: int = 8192
    # The devices its target runs on, one process each (--tensor-parallel, --devices); said to the broker and in /health.
    tensor_parallel: int = 1
    devices: tuple[str, ...] = ()
