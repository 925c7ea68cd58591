"""A worker's settings, without torch: what it serves (WorkerSettings), the target and where it runs
(TargetSettings, what ``load_engine`` takes) and the supervision it computes (TaskSettings, what ``load_task``
takes). Each default and description is stated here once: ``draftfeed launch worker`` makes a flag of every field
(draftfeed/launch/flags.py)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field

from draftfeed.consumers.devices import placement_problem, tensor_parallel_devices
from draftfeed.consumers.nodes import NodePlan, node_plan
from draftfeed.schemas.messages import TASK_FORMS, DataPlaneMode, SupervisionForm, TaskName
from draftfeed.schemas.protocol import DEFAULT_MAX_REQUEST_BYTES, DEFAULT_TRANSFER_CHUNK_BYTES, MAX_TRANSFER_CHUNK_BYTES
from draftfeed.schemas.settings import Settings, setting
from draftfeed.security.curve import PeerKeys

ENGINES = ("hf", "vllm", "sglang", "automodel")  # or package.module:Class
Dtype = Literal["auto", "float32", "bfloat16", "float16"]  # auto: float32 on CPU, bfloat16 on accelerators
DEFAULT_DRAFT_LAYERS = 5  # DSpark and DFlash: layers of the draft, for the default target layer ids
# The tasks that read chosen layers, and the field that names them; the other tasks take no layer ids.
LAYER_FIELDS = {"eagle3": "aux_layer_ids", "dspark": "target_layer_ids", "dflash": "target_layer_ids"}
ACROSS_MACHINES = "across machines (docs/engines.md)"


class TargetSettings(Settings):
    """The target, the engine that runs it and the devices and machines it runs on."""

    GROUP: ClassVar[str] = "the target (TargetSettings)"

    path: str = setting(
        help="the target model: a local folder or hub id of a causal LM or an image-text model, as transformers loads it", flag="--target"
    )
    engine: str = setting(
        ENGINES[0], f"what runs the target: {', '.join(ENGINES)}, or package.module:Class for an engine of your own (docs/engines.md)"
    )
    engine_options: dict[str, Any] = setting(
        default_factory=dict,
        help="an engine setting, repeatable; for vllm any vllm.LLM argument (gpu_memory_utilization=0.8, max_model_len=8192), for sglang "
        "any ServerArgs field",
        flag="--engine-option",
        parse="engine_option",
        metavar="KEY=VALUE",
    )
    device: str = setting("cpu", "torch device for the target, e.g. cuda:0")
    dtype: Dtype = setting("auto", "the target's dtype: auto is float32 on CPU, bfloat16 on GPU")
    target_version: int = setting(
        0, "the version of the target's weights this worker starts with (an RL step: it only grows; updates raise it: docs/versions.md)", metavar="N"
    )
    tensor_parallel: int = setting(
        1,
        "spread the target over N devices, one process each, as one worker (hf and sglang: transformers' or sglang's tensor-parallel plan "
        "over processes this worker starts; automodel: NeMo's FSDP over them; vllm: its tensor_parallel_size); docs/engines.md",
        metavar="N",
    )
    devices: tuple[str, ...] = setting(
        (),
        "with --tensor-parallel N or --device-map auto: the devices, e.g. cuda:4,cuda:5 (default: N devices from --device on); with "
        "--nnodes, this machine's",
        parse="devices",
        metavar="LIST",
    )
    device_map: Literal["auto"] | None = setting(
        None, "hf: spread the target's layers over --devices in this one process (for a model transformers has no tensor-parallel plan for)"
    )
    pipeline_parallel: int = setting(
        1,
        "pipeline stages of the target's layers; no engine captures supervision over stages yet, and each says why in one line (docs/engines.md)",
        metavar="N",
    )
    expert_parallel: bool = setting(
        False,
        "shard a mixture of experts' experts over the --tensor-parallel processes (hf: the model's expert-parallel plan; vllm: "
        "enable_expert_parallel; sglang: ep_size; automodel: NeMo's expert mesh)",
    )
    # A worker over several machines: the same line on each, with its own --node-rank (consumers/nodes.py).
    nnodes: int = setting(
        1,
        "machines the worker's --tensor-parallel processes span, as many on each; run this line on each of them",
        metavar="N",
        group=ACROSS_MACHINES,
    )
    node_rank: int = setting(
        0, "this machine's place among --nnodes: 0 is the worker that serves the broker, the others only run processes", group=ACROSS_MACHINES
    )
    master_addr: str | None = setting(
        None, "with --nnodes: HOST:PORT where node 0 listens for the other nodes (node 0's address)", metavar="HOST:PORT", group=ACROSS_MACHINES
    )
    join_timeout_s: float = setting(
        120.0, "with --nnodes: seconds the nodes wait for each other at start before each says who is missing", group=ACROSS_MACHINES
    )

    def node_plan(self) -> NodePlan | None:
        """This machine's place in a worker over machines (None on one machine); a ValueError names the flag."""
        return node_plan(self.nnodes, self.node_rank, self.master_addr, self.tensor_parallel, len(self.devices))

    def placement_problem(self) -> str | None:
        """Why the engine, degree, device map, stages, experts and machines do not go together, or None."""
        return placement_problem(self.engine, self.tensor_parallel, self.device_map, self.pipeline_parallel, self.expert_parallel, self.nnodes > 1)

    def placed_devices(self) -> list[str]:
        """The devices of this machine's processes, its first the worker's own; a ValueError names the flag."""
        if self.device_map is not None:
            return list(self.devices or [self.device])
        return tensor_parallel_devices(self.device, self.tensor_parallel // max(self.nnodes, 1), self.devices)


class TaskSettings(Settings):
    """Which supervision the worker computes, and how it is sent."""

    GROUP: ClassVar[str] = "the task (TaskSettings)"

    name: TaskName = setting("eagle3", "which supervision to compute", flag="--task")
    aux_layer_ids: list[int] | None = setting(None, "EAGLE-3: 3 distinct decoder layers, e.g. 1,15,28 (default [1, L//2-1, L-4])", parse="layer_ids")
    target_layer_ids: list[int] | None = setting(
        None,
        "DSpark: strictly increasing ids, -1 for the embeddings and L-1 for the final norm, e.g. -1,7,14,21,27 (default: --draft-layers ids "
        "spread over [1, L-1]). DFlash: distinct decoder layers 0..L-1, concatenated in the order given (default: the DFlash recipe's, from "
        "--draft-layers)",
        parse="layer_ids",
    )
    supervision: SupervisionForm | None = setting(
        None,
        "how the task's supervision is sent (default: the task's first form). EAGLE-3: target_probs as float32 probs (the contract's form), "
        "bfloat16 probs (lossy, half the bytes), or the final hidden state and argmax from which ranks rebuild them (hidden, compact). DFlash "
        "with --capture-logits, EAGLE-1/2 and ViSpec: the full-vocab logits, or the final hidden state from which ranks rebuild them (hidden, "
        "compact)",
    )
    capture_logits: bool = setting(False, "DFlash: send the target's full-vocab logits too (JetSpec's distillation needs them)")
    draft_layers: int = setting(DEFAULT_DRAFT_LAYERS, "DSpark and DFlash: layers of the draft, for the default target layer ids")
    # The default keeps the vocab-sized step's float32 logits near 4 GB for a 128k vocab, beside an 8B target on one H200.
    chunk_tokens: int = setting(
        8192,
        "EAGLE-3: batches of more positions compute logits, probabilities and argmax this many positions at a time, bounding that step's "
        "memory (0: never chunk)",
    )

    # ViSpec's image placeholder token: the command reads it from the target's config (its image_token_id).
    image_token_id: int | None = setting(None, flag=None)

    @classmethod
    def of(cls, name: str, layer_ids: list[int] | None = None, **fields: Any) -> TaskSettings:
        """The settings of task ``name`` with ``layer_ids`` as its layer field (EAGLE-3's aux layers, DSpark's and
        DFlash's target layers); a ValueError for layer ids given to a task that takes none."""
        if layer_ids is not None:
            if name not in LAYER_FIELDS:
                raise ValueError(f"task {name} takes no layer ids")
            fields[LAYER_FIELDS[name]] = list(layer_ids)
        return cls(name=name, **fields)  # type: ignore[arg-type]

    @property
    def layer_ids(self) -> list[int] | None:
        """The layer ids of this task's layer field (None: the task's default, or a task without layers)."""
        field = LAYER_FIELDS.get(self.name)
        return getattr(self, field) if field is not None else None

    def problem(self) -> str | None:
        """What is wrong with these settings, in one line that names the flag and what to do; None if nothing."""
        for field in ("aux_layer_ids", "target_layer_ids"):
            if getattr(self, field) is not None and LAYER_FIELDS.get(self.name) != field:
                return f"--{field.replace('_', '-')} does not apply to --task {self.name}"
        if self.chunk_tokens < 0:
            return f"--chunk-tokens {self.chunk_tokens}: give positions per chunk, or 0 to compute every batch whole"
        return task_settings_problem(self.name, self.supervision, self.capture_logits)


def task_settings_problem(task: str, supervision: str | None, capture_logits: bool) -> str | None:
    """What is wrong with a task's form and logits, in one line that names the flag and what to do; None if nothing
    (asked before torch loads, and by the tasks themselves: the forms are the schema's)."""
    if supervision is not None and supervision not in TASK_FORMS[task]:  # type: ignore[index]
        return f"--supervision {supervision}: task {task} is sent as {' or '.join(TASK_FORMS[task])}"  # type: ignore[index]
    if capture_logits and task != "dflash":
        return f"--capture-logits is DFlash's (JetSpec's logits); --task {task} does not take it"
    if task == "dflash" and supervision == "hidden" and not capture_logits:
        return "--supervision hidden: DFlash sends logits only with --capture-logits; add it, or leave --supervision out"
    return None


class WorkerSettings(Settings):
    """What a worker serves and how: its broker and service, its timeouts and limits, its data plane, the target and
    the task."""

    GROUP: ClassVar[str] = "serving (WorkerSettings)"

    broker: str = setting(help="the broker's worker (backend) endpoint, e.g. tcp://HOST:5556", parse="endpoint")
    service: str | None = setting(None, "the service name ranks ask for (default: <target folder>-<task>)")
    name: str | None = setting(None, "the worker's name in logs and status (default HOST-PID-random)")
    capacity: int = setting(2, "requests the broker may hand this worker at once")
    send_timeout_s: float = setting(60.0, "seconds a rank may take to accept supervision before the worker gives up on it")
    update_timeout_s: float = setting(
        60.0, "seconds a worker waits for each part of a weight update published from a trainer's memory before it gives up (docs/versions.md)"
    )
    connect_timeout_s: float = setting(5.0, "seconds to reach a rank's data socket the first time before giving up on that rank")
    register_timeout_s: float = setting(60.0, "seconds to wait for the broker at start")
    drain_timeout_s: float = setting(10.0, "on SIGTERM, seconds delivering the answer in hand may still take before it is given up")
    data_plane: DataPlaneMode = setting(
        "auto",
        "how supervision reaches ranks: auto (NCCL to CUDA ranks on this machine, else NIXL where both sides have it, else frames), frames, "
        "nccl, gloo or nixl (docs/data-planes.md)",
    )
    pair_timeout_s: float = setting(
        30.0, "seconds a pair group or nixl pair may take to open, and each transfer on it, before it is torn down and frames are used"
    )
    nixl_min_bytes: int = setting(
        1 << 20, "answers smaller than this go as frames on a nixl pair too (a slot's round trip costs more than copying them)"
    )
    max_request_bytes: int = setting(DEFAULT_MAX_REQUEST_BYTES, "largest request (and frame) this worker takes from the broker")
    transfer_chunk_bytes: Annotated[int, Field(ge=1 << 12, le=MAX_TRANSFER_CHUNK_BYTES)] = setting(
        DEFAULT_TRANSFER_CHUNK_BYTES,
        "answers larger than this go to a rank in pieces of this many bytes (4 KiB to 1 GiB), frames and pair groups alike: neither side "
        "holds a second copy of a large answer, and a transfer is given up only when it stops moving (docs/data-planes.md)",
    )
    max_seq_len: int | None = setting(
        None, "the longest row this worker takes; longer ones are refused (default: the target's max_position_embeddings)"
    )
    checksum: bool = setting(
        False,
        "send each tensor's XXH3 digest with every answer; the rank checks it and asks again for an answer that arrived "
        "changed (about 0.04 s per GB each side: docs/data-planes.md)",
    )
    skip_finite_check: bool = setting(
        False, "send supervision unchecked for NaN and Inf (the check is one pass over each tensor on its device: docs/contract.md)"
    )
    # CURVE to the broker and to ranks (docs/security.md); the command reads them from --keys, --key and --broker-key.
    keys: PeerKeys | None = setting(None, flag=None)
    target: TargetSettings
    task: TaskSettings = TaskSettings()

    @property
    def service_name(self) -> str:
        """--service, else ``<target folder name>-<task>``."""
        return self.service if self.service is not None else default_service_name(self.target.path, self.task.name)


def default_service_name(target: str, task: str) -> str:
    """``<target folder name>-<task>``, lower-cased, with anything but letters, digits, '.', '_' and '-' replaced."""
    base = Path(target.rstrip("/")).name or "target"
    return re.sub(r"[^a-z0-9._-]+", "-", f"{base}-{task}".lower())
