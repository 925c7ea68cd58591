"""A worker's settings and the choices its flags take, without torch. Each default and description is stated here
once: ``draftfeed launch worker`` makes a flag of every field (draftfeed/launch/flags.py), its ``--help`` from
``metadata["help"]``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import get_args

from draftfeed.schemas.messages import TASK_FORMS, DataPlaneMode
from draftfeed.schemas.protocol import DEFAULT_MAX_REQUEST_BYTES
from draftfeed.security.curve import PeerKeys

ENGINES = ("hf", "vllm", "sglang")  # or package.module:Class
DTYPES = ("auto", "float32", "bfloat16", "float16")  # auto: float32 on CPU, bfloat16 on accelerators
DEFAULT_DRAFT_LAYERS = 5  # DSpark and DFlash: layers of the draft, for the default target layer ids
# The tasks that read chosen layers, and the flag that names them; the other tasks take no layer ids.
LAYER_FLAGS = {"eagle3": "--aux-layer-ids", "dspark": "--target-layer-ids", "dflash": "--target-layer-ids"}


def task_settings_problem(task: str, supervision: str | None, capture_logits: bool) -> str | None:
    """What is wrong with a worker's task settings, in one line that names the flag and what to do; None if nothing.
    The CLI asks before torch loads, ``load_task`` for any caller (without torch either: the forms are the schema's)."""
    if supervision is not None and supervision not in TASK_FORMS[task]:  # type: ignore[index]
        return f"--supervision {supervision}: task {task} is sent as {' or '.join(TASK_FORMS[task])}"  # type: ignore[index]
    if capture_logits and task != "dflash":
        return f"--capture-logits is DFlash's (JetSpec's logits); --task {task} does not take it"
    if task == "dflash" and supervision == "hidden" and not capture_logits:
        return "--supervision hidden: DFlash sends logits only with --capture-logits; add it, or leave --supervision out"
    return None


@dataclass
class WorkerConfig:
    """A worker's settings; each default is stated here once."""

    broker: str = field(metadata={"help": "the broker's worker (backend) endpoint, e.g. tcp://HOST:5556", "parse": "endpoint"})
    service: str = field(metadata={"help": "the service name ranks ask for (default: <target folder>-<task>)", "required": False})
    capacity: int = field(default=2, metadata={"help": "requests the broker may hand this worker at once"})
    name: str | None = field(default=None, metadata={"help": "the worker's name in logs and status (default HOST-PID-random)"})
    send_timeout_s: float = field(default=60.0, metadata={"help": "seconds a rank may take to accept supervision before the worker gives up on it"})
    connect_timeout_s: float = field(
        default=5.0, metadata={"help": "seconds to reach a rank's data socket the first time before giving up on that rank"}
    )
    register_timeout_s: float = field(default=60.0, metadata={"help": "seconds to wait for the broker at start"})
    drain_timeout_s: float = field(
        default=10.0, metadata={"help": "on SIGTERM, seconds delivering the answer in hand may still take before it is given up"}
    )
    data_plane: str = field(
        default="auto",
        metadata={
            "help": "how supervision reaches ranks: auto (NCCL to CUDA ranks on this machine, else NIXL where both sides have it, "
            "else frames), frames, nccl, gloo or nixl (docs/data-planes.md)",
            "choices": get_args(DataPlaneMode),
        },
    )
    pair_timeout_s: float = field(
        default=30.0,
        metadata={"help": "seconds a pair group or nixl pair may take to open, and each transfer on it, before it is torn down and frames are used"},
    )
    nixl_min_bytes: int = field(
        default=1 << 20,
        metadata={"help": "answers smaller than this go as frames on a nixl pair too (a slot's round trip costs more than copying them)"},
    )
    # CURVE to the broker and to ranks (docs/security.md); the CLI reads them from --keys, --key and --broker-key.
    keys: PeerKeys | None = field(default=None, metadata={"flag": None})
    max_request_bytes: int = field(
        default=DEFAULT_MAX_REQUEST_BYTES, metadata={"help": "largest request (and frame) this worker takes from the broker"}
    )
    max_seq_len: int | None = field(
        default=None,
        metadata={"help": "the longest row this worker takes; longer ones are refused (default: the target's max_position_embeddings)"},
    )
    # The default keeps the vocab-sized step's float32 logits near 4 GB for a 128k vocab, beside an 8B target on one H200.
    chunk_tokens: int = field(
        default=8192,
        metadata={
            "help": "EAGLE-3: batches of more positions compute logits, probabilities and argmax this many positions at a time, "
            "bounding that step's memory (0: never chunk)"
        },
    )
    # The devices its target runs on, one process each; said to the broker and in /health.
    tensor_parallel: int = field(
        default=1,
        metadata={
            "help": "spread the target over N devices, one process each, as one worker (hf and sglang: transformers' or sglang's "
            "tensor-parallel plan over processes this worker starts; vllm: its tensor_parallel_size); docs/engines.md",
            "metavar": "N",
        },
    )
    devices: tuple[str, ...] = field(
        default=(),
        metadata={
            "help": "with --tensor-parallel N or --device-map auto: the devices, e.g. cuda:4,cuda:5 (default: N devices from --device on); "
            "with --nnodes, this machine's",
            "parse": "devices",
            "metavar": "LIST",
        },
    )
    # A worker over several machines: the same line on each, with its own --node-rank (consumers/nodes.py).
    nnodes: int = field(
        default=1,
        metadata={"help": "machines the worker's --tensor-parallel processes span, as many on each; run this line on each of them", "metavar": "N"},
    )
    node_rank: int = field(
        default=0,
        metadata={"help": "this machine's place among --nnodes: 0 is the worker that serves the broker, the others only run processes"},
    )
    master_addr: str | None = field(
        default=None,
        metadata={"help": "with --nnodes: HOST:PORT where node 0 listens for the other nodes (node 0's address)", "metavar": "HOST:PORT"},
    )
    join_timeout_s: float = field(
        default=120.0, metadata={"help": "with --nnodes: seconds the nodes wait for each other at start before each says who is missing"}
    )
    pipeline_parallel: int = field(
        default=1,
        metadata={
            "help": "pipeline stages of the target's layers; no engine captures supervision over stages yet, and each says why in one line "
            "(docs/engines.md)",
            "metavar": "N",
        },
    )
    expert_parallel: bool = field(
        default=False,
        metadata={
            "help": "shard a mixture of experts' experts over the --tensor-parallel processes (hf: the model's expert-parallel plan; "
            "vllm: enable_expert_parallel; sglang: ep_size)"
        },
    )
