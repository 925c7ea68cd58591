"""The ``draftfeed`` command line: launch a broker or a worker, run the demo or the bench, read the broker's status.

The flags of ``launch broker`` and ``launch worker`` that are settings are made from the settings' fields
(BrokerSettings, WorkerConfig; draftfeed/launch/flags.py), and the settings from the parsed flags: each setting's
name, default and help is written once, on its field. Other defaults and choices are read from where they are kept
(RankSettings, the protocol's constants, the message models' literals); ``--help`` shows each. A usage error is one line on stderr
and exit code 2 (``UsageError``), never a traceback. The CLI loads neither torch nor pyzmq's auth until a
command needs them: ``draftfeed launch broker --help`` stays light.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import signal
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, get_args

from draftfeed.bench import SCENARIO_NAMES
from draftfeed.bench.cluster import Load as ClusterLoad
from draftfeed.broker.settings import BrokerSettings
from draftfeed.consumers.config import DEFAULT_DRAFT_LAYERS, DTYPES, ENGINES, LAYER_FLAGS, WorkerConfig, task_settings_problem
from draftfeed.consumers.devices import placement_problem, tensor_parallel_devices
from draftfeed.consumers.nodes import node_plan
from draftfeed.launch import flags
from draftfeed.launch.config import apply_sources, effective
from draftfeed.launch.ready import announce_ready
from draftfeed.launch.status import LIST_AT_MOST
from draftfeed.launch.store_commands import run_store
from draftfeed.logs import LOG_FORMATS
from draftfeed.logs import configure as configure_logging
from draftfeed.producers.settings import RankSettings
from draftfeed.schemas.errors import CannotServe, DraftfeedError, UsageError
from draftfeed.schemas.messages import SupervisionForm, TaskName
from draftfeed.schemas.protocol import DEFAULT_BACKEND, DEFAULT_BROKER_HTTP_PORT, DEFAULT_FRONTEND, DEFAULT_HTTP_HOST, DEFAULT_WORKER_HTTP_PORT

if TYPE_CHECKING:  # imported where used: the CLI starts without loading pyzmq's auth or torch
    from draftfeed.security.curve import BrokerKeys, PeerKeys

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
DEFAULT_LOG_LEVEL = "INFO"
DEFAULT_STATUS_BROKER = "tcp://127.0.0.1:5555"


_endpoint = flags.endpoint


def _layer_ids(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated layer ids like 1,15,28; got {text!r}") from None


def _engine_option(text: str) -> tuple[str, object]:
    """KEY=VALUE; VALUE is read as JSON when it parses (0.8, 2, true, {...}) and kept as a string otherwise."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip().isidentifier():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE like gpu_memory_utilization=0.8; got {text!r}")
    try:
        return key.strip(), json.loads(value)
    except json.JSONDecodeError:
        return key.strip(), value


def default_service_name(target: str, task: str) -> str:
    """``<target folder name>-<task>``, lower-cased, with anything but letters, digits, '.', '_' and '-' replaced."""
    base = Path(target.rstrip("/")).name or "target"
    return re.sub(r"[^a-z0-9._-]+", "-", f"{base}-{task}".lower())


class _Help(argparse.HelpFormatter):
    """Every option's help ends with its default, where it has one worth showing."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if "%(default)" in text or default in (None, False, [], argparse.SUPPRESS) or not action.option_strings:
            return text
        return f"{text} (default: %(default)s)"


def _parser(parent: Any, name: str, **kwargs: Any) -> argparse.ArgumentParser:
    return parent.add_parser(name, formatter_class=_Help, **kwargs)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="draftfeed", description="Serve frozen-target supervision to draft-model training over ZeroMQ.", formatter_class=_Help
    )
    parser.add_argument("--log-level", default=DEFAULT_LOG_LEVEL, type=str.upper, choices=LOG_LEVELS, help="logging level")
    parser.add_argument(
        "--log-format", default=LOG_FORMATS[0], choices=LOG_FORMATS, help="log lines as text, or one JSON object per line (for log collectors)"
    )
    commands = parser.add_subparsers(dest="command", required=True)

    launch = _parser(commands, "launch", help="start a broker or a worker process")
    add_launch_commands(launch.add_subparsers(dest="role", required=True))

    demo = _parser(commands, "demo", help="run the whole pipeline on a tiny local target and print what it did")
    demo.add_argument("--steps", type=int, default=40, help="training steps to run")
    demo.add_argument("--workers", type=int, default=2, help="worker processes to start")
    demo.add_argument("--batch-size", type=int, default=4, help="rows per batch")
    demo.add_argument("--seq-len", type=int, default=256, help="tokens per row")
    depth = RankSettings.model_fields["prefetch_depth"]
    demo.add_argument("--prefetch-depth", type=int, default=depth.default, help=depth.description)
    demo.add_argument("--workdir", default=None, help="folder for the tiny target (default: a temporary folder)")

    bench = _parser(commands, "bench", help="measure every part of the pipeline against baselines from the same run")
    bench.add_argument("--quick", action="store_true", help="smaller payloads and fewer repetitions: under 2 minutes on 2 cores")
    bench.add_argument("--scenario", action="append", choices=SCENARIO_NAMES, help="run only these (repeatable; default all)")
    bench.add_argument("--json", dest="json_path", default=None, help="write the results as JSON to this path")
    bench.add_argument("--report", action="store_true", help="render docs/performance.md and its plot from this run")
    bench.add_argument("--docs", default="docs", help="where --report writes")
    bench.add_argument("--from-json", default=None, help="measure nothing: render --report from the JSON of an earlier run")
    flags.add_flags(bench.add_argument_group("the cluster scenario"), ClusterLoad)

    status = _parser(commands, "status", help="print the broker's services, workers, ranks and queues")
    status.add_argument("--broker", type=_endpoint, default=DEFAULT_STATUS_BROKER, help="the broker's rank (frontend) endpoint")
    status.add_argument("--json", action="store_true", help="print the whole document as JSON instead of a table")
    status.add_argument(
        "--list", action="store_true", help=f"list every worker and rank (listed anyway when there are at most {LIST_AT_MOST} of each)"
    )
    status.add_argument("--pairs", action="store_true", help="list each worker's data plane to each rank")
    status.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the broker")
    status.add_argument("--service", default=None, help="check this service: exit 1 unless it has a ready worker")
    status.add_argument("--wait", type=float, default=0.0, help="with --service: wait up to this many seconds for a ready worker")
    status.add_argument(
        "--watch",
        type=float,
        nargs="?",
        const=2.0,
        default=None,
        metavar="SECONDS",
        help="print it again every SECONDS (default 2), in place on a terminal, until Ctrl-C",
    )
    _add_peer_key_flags(status, "rank")

    keys = _parser(commands, "keys", help="create CURVE keys for a secure deployment (docs/security.md)")
    key_commands = keys.add_subparsers(dest="keys_command", required=True)
    generate = _parser(key_commands, "generate", help="write key pairs in ZeroMQ's certificate format")
    generate.add_argument("--out", required=True, help="the folder to write to (created if missing; existing keys are never overwritten)")
    generate.add_argument("--name", default=None, help="write one more pair NAME.key / NAME.key_secret instead of the broker, rank and worker set")
    generate.add_argument(
        "--role",
        choices=["rank", "worker"],
        default=None,
        help="with --name: also put NAME.key on OUT/ranks or OUT/workers, the broker's allow-lists",
    )

    store = _parser(commands, "store", help="inspect a supervision store recorded by ranks (docs/store.md)")
    store_commands = store.add_subparsers(dest="store_command", required=True)
    info = _parser(store_commands, "info", help="batches, tokens, bytes per token, the target and the form")
    info.add_argument("path", help="the store's folder (the store= of the recording ranks)")
    check = _parser(store_commands, "verify", help="check every shard against the index (size, sha256, tensors); exit 1 on a bad one")
    check.add_argument("path", help="the store's folder")
    return parser


def _add_peer_key_flags(parser: argparse.ArgumentParser | argparse._ArgumentGroup, role: str) -> None:
    parser.add_argument(
        "--keys",
        default=None,
        help=f"a folder from `draftfeed keys generate`: use its {role}.key_secret and broker.key (default: $DRAFTFEED_KEYS if set)",
    )
    parser.add_argument("--key", default=None, help=f"this {role}'s .key_secret file (overrides --keys)")
    parser.add_argument("--broker-key", default=None, help="the broker's public .key file (overrides --keys)")


def _peer_keys(args: argparse.Namespace, role: str, required: bool) -> PeerKeys | None:
    """The keys a rank or worker connects with, from --keys/--key/--broker-key or $DRAFTFEED_KEYS."""
    import os

    from draftfeed.security.curve import KEYS_ENV, PeerKeys

    folder = args.keys or os.environ.get(KEYS_ENV)
    if args.key or args.broker_key:
        if not (args.key and args.broker_key) and not folder:
            raise UsageError("--key and --broker-key go together (or pass --keys DIR for both)")
        return PeerKeys.from_files(args.key or Path(folder) / f"{role}.key_secret", args.broker_key or Path(folder) / "broker.key")
    if folder:
        return PeerKeys.from_folder(folder, role)
    if required:
        raise UsageError(f"--secure needs keys: --keys DIR (from `draftfeed keys generate`), or --key {role}.key_secret and --broker-key broker.key")
    return None


def add_launch_commands(roles: argparse._SubParsersAction) -> None:
    """``launch broker`` and ``launch worker``. The flags of their settings (BrokerSettings, WorkerConfig) are made
    from the settings' fields (draftfeed/launch/flags.py); the others are what a command does beside them."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--log-level", default=argparse.SUPPRESS, type=str.upper, choices=LOG_LEVELS, help=f"logging level (default {DEFAULT_LOG_LEVEL})"
    )
    common.add_argument(
        "--log-format",
        default=argparse.SUPPRESS,
        choices=LOG_FORMATS,
        help=f"log lines as text, or one JSON object per line (default {LOG_FORMATS[0]})",
    )
    broker = _parser(roles, "broker", parents=[common], help="route requests from training ranks to target workers")
    listen = broker.add_argument_group("where it listens")
    listen.add_argument("--frontend", type=_endpoint, default=DEFAULT_FRONTEND, help="where training ranks connect (tcp://HOST:* picks a free port)")
    listen.add_argument("--backend", type=_endpoint, default=DEFAULT_BACKEND, help="where workers connect")
    listen.add_argument("--name", default=None, help="the broker's name in logs and status (default HOST-PID)")
    flags.add_flags(broker.add_argument_group("settings (BrokerSettings)"), BrokerSettings)
    security = broker.add_argument_group("security (docs/security.md)")
    security.add_argument(
        "--secure",
        action="store_true",
        help="CURVE on both sockets: only rank keys at the frontend, only worker keys at the backend (docs/security.md)",
    )
    security.add_argument("--keys", default=None, help="with --secure: a folder from `draftfeed keys generate` (broker.key_secret, ranks/, workers/)")
    security.add_argument("--key", default=None, help="with --secure: the broker's .key_secret file (overrides --keys)")
    security.add_argument(
        "--rank-keys", default=None, help="with --secure: the folder of rank public keys allowed at the frontend (overrides --keys)"
    )
    security.add_argument(
        "--worker-keys", default=None, help="with --secure: the folder of worker public keys allowed at the backend (overrides --keys)"
    )
    _add_http_flags(broker.add_argument_group("health and metrics"), DEFAULT_BROKER_HTTP_PORT)

    worker = _parser(roles, "worker", parents=[common], help="run a frozen target and serve its supervision")
    placed = flags.add_flags(worker.add_argument_group("where it serves"), WorkerConfig, ["broker", "service", "name"])
    target = worker.add_argument_group("the target")
    target.add_argument(
        "--target", required=True, help="the target model: a local folder or hub id of a causal LM or an image-text model, as transformers loads it"
    )
    target.add_argument(
        "--engine",
        default=ENGINES[0],
        help=f"what runs the target: {', '.join(ENGINES)}, or package.module:Class for an engine of your own (docs/engines.md)",
    )
    target.add_argument(
        "--engine-option",
        type=_engine_option,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an engine setting, repeatable; for vllm any vllm.LLM argument (gpu_memory_utilization=0.8, max_model_len=8192), for sglang any ServerArgs field",
    )
    target.add_argument("--task", default="eagle3", choices=get_args(TaskName), help="which supervision to compute")
    target.add_argument("--device", default="cpu", help="torch device for the target, e.g. cuda:0")
    placed += flags.add_flags(target, WorkerConfig, ["tensor_parallel", "devices", "pipeline_parallel", "expert_parallel"])
    placed += flags.add_flags(
        worker.add_argument_group("across machines (docs/engines.md)"), WorkerConfig, ["nnodes", "node_rank", "master_addr", "join_timeout_s"]
    )
    target.add_argument(
        "--device-map",
        default=None,
        choices=["auto"],
        help="hf: spread the target's layers over --devices in this one process (for a model transformers has no tensor-parallel plan for)",
    )
    target.add_argument("--dtype", default=DTYPES[0], choices=DTYPES, help="the target's dtype: auto is float32 on CPU, bfloat16 on GPU")
    target.add_argument(
        "--aux-layer-ids", type=_layer_ids, default=None, help="EAGLE-3: 3 distinct decoder layers, e.g. 1,15,28 (default [1, L//2-1, L-4])"
    )
    target.add_argument(
        "--target-layer-ids",
        type=_layer_ids,
        default=None,
        help="DSpark: strictly increasing ids, -1 for the embeddings and L-1 for the final norm, e.g. -1,7,14,21,27 (default: --draft-layers ids "
        "spread over [1, L-1]). DFlash: distinct decoder layers 0..L-1, concatenated in the order given (default: the DFlash recipe's, from --draft-layers)",
    )
    target.add_argument(
        "--supervision",
        default=None,
        choices=get_args(SupervisionForm),
        help="how the task's supervision is sent (default: the task's first form). EAGLE-3: target_probs as float32 probs (the contract's form), "
        "bfloat16 probs (lossy, half the bytes), or the final hidden state and argmax from which ranks rebuild them (hidden, compact). "
        "DFlash with --capture-logits, EAGLE-1/2 and ViSpec: the full-vocab logits, or the final hidden state from which ranks rebuild them (hidden, compact)",
    )
    target.add_argument(
        "--capture-logits",
        action="store_true",
        help="DFlash: send the target's full-vocab logits too (JetSpec's distillation needs them)",
    )
    target.add_argument(
        "--draft-layers",
        type=int,
        default=DEFAULT_DRAFT_LAYERS,
        help="DSpark and DFlash: layers of the draft, for the default target layer ids",
    )
    placed += flags.add_flags(target, WorkerConfig, ["max_seq_len", "chunk_tokens"])
    # Every other field of WorkerConfig, a new one included, gets its flag here.
    rest = [flag.field for flag in flags.flags_of(WorkerConfig) if flag not in placed]
    flags.add_flags(worker.add_argument_group("serving (WorkerConfig)"), WorkerConfig, rest)
    security = worker.add_argument_group("security (docs/security.md)")
    security.add_argument("--secure", action="store_true", help="CURVE to the broker and to ranks, with this worker's key (docs/security.md)")
    _add_peer_key_flags(security, "worker")
    _add_http_flags(worker.add_argument_group("health and metrics"), DEFAULT_WORKER_HTTP_PORT)
    for role in (broker, worker):
        _add_config_flags(role)


def _add_config_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("configuration")
    group.add_argument(
        "--config",
        default=None,
        help="a TOML file of settings (flag-name = value); a flag given here wins over DRAFTFEED_<FLAG> variables, "
        "which win over the file (docs/operations.md, Configuration)",
    )
    group.add_argument(
        "--print-config", action="store_true", help="print the settings in force (flags, environment, file, defaults) as TOML and exit"
    )
    parser.set_defaults(settings_parser=parser)


def _add_http_flags(parser: argparse.ArgumentParser | argparse._ArgumentGroup, port: int) -> None:
    parser.add_argument(
        "--http-port",
        type=int,
        default=None,
        help=f"serve GET /health and GET /metrics (Prometheus) on this port (default {port}; taken by another process, the "
        "default is skipped with a warning, a port given here is an error); 0 turns it off",
    )
    parser.add_argument("--http-host", default=DEFAULT_HTTP_HOST, help="the address /health and /metrics listen on")


def _stop_on_signals(stop: Callable[[], None], what: str) -> None:
    """SIGTERM or SIGINT: stop cleanly; a second one: exit at once (a scheduler's grace period is running out)."""
    received: list[int] = []

    def handle(sig: int, _frame: object) -> None:
        if received:
            print(f"draftfeed {what}: {signal.Signals(sig).name} again: exiting now", file=sys.stderr, flush=True)
            os._exit(128 + sig)
        received.append(sig)
        print(f"draftfeed {what}: {signal.Signals(sig).name}: stopping (another one exits at once)", file=sys.stderr, flush=True)
        stop()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, handle)


def _stopping_children(what: str, run: Callable[[], int]) -> int:
    """Run ``run`` (the demo, the bench) so that SIGTERM, SIGINT or SIGHUP at any moment, from before its first child
    starts, stops the processes it started: the first one ends it (the ``finally`` blocks on the way out stop them and
    remove its folder) with exit status 128 + the signal; one that comes while they are being stopped kills them at
    once. Should it be SIGKILLed instead, they die with it all the same (``children.spawn``)."""
    from draftfeed.launch import children

    received: list[int] = []

    def handle(sig: int, _frame: object) -> None:
        first = not received and not children.stopping()
        received.append(sig)
        name = signal.Signals(sig).name
        if first:
            print(f"draftfeed {what}: {name}: stopping the processes it started (another one kills them)", file=sys.stderr, flush=True)
            raise SystemExit(128 + sig)
        print(f"draftfeed {what}: {name} again: killing the processes it started", file=sys.stderr, flush=True)
        children.kill_all()

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, handle)
    try:
        code = run()
    finally:
        children.stop_all()
    return 128 + received[0] if received else code


def run_broker(args: argparse.Namespace) -> int:
    from prometheus_client import CollectorRegistry

    from draftfeed.broker.broker import Broker
    from draftfeed.observe.broker_metrics import BrokerCollector

    settings = flags.from_args(BrokerSettings, args)
    broker = Broker(args.frontend, args.backend, name=args.name, settings=settings, keys=_broker_keys(args))
    frontend, backend = broker.bind()
    registry = CollectorRegistry()
    registry.register(BrokerCollector(broker.fresh_status))
    observer = _observe(args, DEFAULT_BROKER_HTTP_PORT, broker.health, lambda: registry)
    _stop_on_signals(broker.stop, "broker")
    announce_ready(role="broker", frontend=frontend, backend=backend, http_port=observer.port if observer else None)
    _tune_garbage_collection()
    try:
        broker.run()
    finally:
        if observer is not None:
            observer.close()
    return 0


def _tune_garbage_collection() -> None:
    """The broker process holds a record for every peer, request and pair, and allocates a few objects per message:
    with Python's default thresholds its collector ran every 700 allocations, so often that it cost a fifth of the
    broker's CPU at a thousand ranks (docs/performance.md, "One broker for a cluster"). What is loaded at start is
    frozen out of collection, and the youngest generation is collected every 100,000 allocations instead."""
    import gc

    gc.collect()
    gc.freeze()
    gc.set_threshold(100_000, 50, 1000)


def _observe(
    args: argparse.Namespace, default_port: int, health: Callable[[], str | None], registry: Callable[[], Any], about: Callable[[], dict] = dict
) -> Any:
    """The /health and /metrics server of --http-port, None when it is 0 (or the default port is taken)."""
    port = default_port if args.http_port is None else args.http_port
    if port == 0:
        return None
    if not 0 < port < 65536:
        raise UsageError(f"--http-port {port}: give a port from 1 to 65535, or 0 to turn health and metrics off")
    from draftfeed.observe.http import ObserveServer

    try:
        return ObserveServer(args.http_host, port, health, registry, about=about)
    except UsageError as exc:
        if args.http_port is not None:
            raise
        logging.getLogger("draftfeed.observe").warning("health and metrics are off: %s (several on one machine need --http-port each)", exc)
        return None


def _broker_keys(args: argparse.Namespace) -> BrokerKeys | None:
    from draftfeed.security.curve import BrokerKeys

    given = [
        flag
        for flag, value in (("--keys", args.keys), ("--key", args.key), ("--rank-keys", args.rank_keys), ("--worker-keys", args.worker_keys))
        if value
    ]
    if not args.secure:
        if given:
            raise UsageError(f"{', '.join(given)} given without --secure: add --secure to use them")
        return None
    folder = Path(args.keys) if args.keys else None
    paths = {
        "--key": args.key or (folder / "broker.key_secret" if folder else None),
        "--rank-keys": args.rank_keys or (folder / "ranks" if folder else None),
        "--worker-keys": args.worker_keys or (folder / "workers" if folder else None),
    }
    missing = [flag for flag, path in paths.items() if path is None]
    if missing:
        raise UsageError(f"--secure needs {', '.join(missing)} (or --keys DIR from `draftfeed keys generate`)")
    return BrokerKeys.from_files(paths["--key"], paths["--rank-keys"], paths["--worker-keys"])


def run_keys(args: argparse.Namespace) -> int:
    from draftfeed.security.keys import generate, generate_pair

    out = Path(args.out)
    if args.name is None:
        if args.role is not None:
            raise UsageError("--role goes with --name")
        pairs = generate(out)
        print(f"wrote the broker, rank and worker key pairs to {out}:")
        print(f"  broker:   draftfeed launch broker --secure --keys {out}   ({out}/broker.key_secret stays on the broker host)")
        print(f"  workers:  draftfeed launch worker --secure --keys {out} ...   (needs worker.key_secret and broker.key)")
        print(f"  ranks:    RemoteEagle3Target(..., keys='{out}') or DRAFTFEED_KEYS={out}   (needs rank.key_secret and broker.key)")
        for name, pair in pairs.items():
            print(f"  {name} public key {pair.public.decode()}")
    else:
        allow_list = out / f"{args.role}s" if args.role else None
        pair = generate_pair(out, args.name, allow_list)
        where = f", and added its public key to {allow_list}" if allow_list else ""
        print(f"wrote {out}/{args.name}.key and {out}/{args.name}.key_secret{where}; public key {pair.public.decode()}")
    return 0


def run_worker(args: argparse.Namespace) -> int:
    for flag, value in (("--aux-layer-ids", args.aux_layer_ids), ("--target-layer-ids", args.target_layer_ids)):
        if value is not None and LAYER_FLAGS.get(args.task) != flag:
            raise UsageError(f"{flag} does not apply to --task {args.task}")
    if (problem := task_settings_problem(args.task, args.supervision, args.capture_logits)) is not None:
        raise UsageError(problem)
    if not args.secure and (args.keys or args.key or args.broker_key):
        raise UsageError("--keys/--key/--broker-key given without --secure: add --secure to use them")
    keys = _peer_keys(args, "worker", required=True) if args.secure else None
    if args.max_seq_len is not None and args.max_seq_len < 1:
        raise UsageError(f"--max-seq-len {args.max_seq_len}: give the longest row to take, at least 1 (or leave it out for the target's own limit)")
    if args.chunk_tokens < 0:
        raise UsageError(f"--chunk-tokens {args.chunk_tokens}: give positions per chunk, or 0 to compute every batch whole")
    try:
        args.nodes = node_plan(args.nnodes, args.node_rank, args.master_addr, args.tensor_parallel, len(args.devices or ()))
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    problem = placement_problem(
        args.engine, args.tensor_parallel, args.device_map, args.pipeline_parallel, args.expert_parallel, args.nodes is not None
    )
    if problem is not None:
        raise UsageError(problem)
    if args.devices and args.tensor_parallel == 1 and args.device_map is None:
        raise UsageError(f"--devices {','.join(args.devices)}: add --tensor-parallel {len(args.devices)} (or --device-map auto) to use them")
    here = args.tensor_parallel // args.nnodes
    try:
        args.devices = tensor_parallel_devices(args.device, here, args.devices) if args.device_map is None else args.devices or [args.device]
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if args.nodes is not None and args.nodes.node_rank > 0:
        return _serve_node_observed(args)
    # The flags above are checked before torch and transformers load: a mistake there is one line at once. Health
    # answers from now on: not ready while the engine loads.
    serving: list[Any] = []
    observer = _observe(
        args,
        DEFAULT_WORKER_HTTP_PORT,
        lambda: serving[0].health() if serving else "the worker is loading its engine",
        lambda: serving[0].metrics.registry if serving else None,
        about=lambda: {"tensor_parallel": args.tensor_parallel, "devices": args.devices},
    )
    try:
        return _serve_worker(args, keys, serving, observer.port if observer is not None else None)
    finally:
        if observer is not None:
            observer.close()


def _serve_worker(args: argparse.Namespace, keys: Any, serving: list[Any], http_port: int | None) -> int:
    import transformers

    from draftfeed.consumers.engines import load_engine
    from draftfeed.consumers.tasks import load_task
    from draftfeed.consumers.tasks.vispec import image_token_id
    from draftfeed.consumers.worker import Worker

    transformers.logging.disable_progress_bar()
    transformers.logging.set_verbosity_error()
    logging.getLogger("huggingface_hub").setLevel(logging.ERROR)  # its retries say nothing the one error line does not
    _check_device(args.device)
    if args.data_plane == "nixl":
        from draftfeed.dataplane.nixl.transport import unavailable

        if (problem := unavailable()) is not None:
            raise UsageError(f"--data-plane nixl: {problem}; or use --data-plane auto (NIXL where both sides have it, else frames)")
    try:  # ViSpec's image token, before the engine loads: a text-only target is one line at once
        image_token = image_token_id(transformers.AutoConfig.from_pretrained(args.target)) if args.task == "vispec" else None
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    except OSError as exc:
        raise UsageError(_target_problem(args.target, exc)) from None
    try:
        engine = load_engine(
            args.engine,
            args.target,
            args.device,
            args.dtype,
            dict(args.engine_option),
            args.tensor_parallel,
            args.devices,
            args.device_map,
            nodes=args.nodes,
            plan=_node_plan_fingerprint(args) if args.nodes is not None else None,
            pipeline_parallel=args.pipeline_parallel,
            expert_parallel=args.expert_parallel,
            join_timeout_s=args.join_timeout,
        )
    except (ValueError, TypeError) as exc:
        raise UsageError(str(exc)) from None
    except OSError as exc:  # transformers could not find or fetch the target
        raise UsageError(_target_problem(args.target, exc)) from None
    try:
        layer_ids = args.aux_layer_ids if args.task == "eagle3" else args.target_layer_ids
        task = load_task(args.task, engine, layer_ids, args.draft_layers, args.supervision, args.chunk_tokens, args.capture_logits, image_token)
    except (ValueError, TypeError) as exc:  # a bad layer id, or an engine option the engine's package rejects
        engine.close()
        raise UsageError(str(exc)) from None
    service = args.service or default_service_name(args.target, args.task)
    worker = Worker(
        task,
        flags.from_args(WorkerConfig, args, service=service, keys=keys, devices=args.devices),
    )
    serving.append(worker)
    _stop_on_signals(worker.stop, "worker")
    try:
        worker.run(on_ready=lambda: announce_ready(role="worker", worker=worker.name, service=service, http_port=http_port))
    finally:
        engine.close()
    if (lost := getattr(engine, "lost", None)) is not None:
        raise CannotServe(f"worker {worker.name}: {lost}; its requests went back to the broker")
    return 0


def _node_plan_fingerprint(args: argparse.Namespace) -> dict[str, Any]:
    """What every node of a worker over machines must agree on (consumers/nodes.py)."""
    from draftfeed.consumers.nodes import fingerprint

    task_flags = {
        "task": args.task,
        "aux_layer_ids": args.aux_layer_ids,
        "target_layer_ids": args.target_layer_ids,
        "supervision": args.supervision,
        "expert_parallel": args.expert_parallel,
        "engine_options": dict(args.engine_option),
    }
    return fingerprint(args.target, args.engine, args.dtype, task_flags, args.tensor_parallel, args.nnodes)


def _serve_node_observed(args: argparse.Namespace) -> int:
    """A node other than node 0, with /health on --http-port: ready once its processes run (no metrics of its own:
    node 0's are the worker's)."""
    from prometheus_client import CollectorRegistry

    joined: list[bool] = []
    registry = CollectorRegistry()
    observer = _observe(
        args,
        DEFAULT_WORKER_HTTP_PORT,
        lambda: None if joined else f"node {args.node_rank} is joining node 0 at {args.master_addr}",
        lambda: registry,
        about=lambda: {"node_rank": args.node_rank, "nnodes": args.nnodes, "devices": args.devices},
    )
    try:
        return _serve_node(args, lambda: joined.append(True))
    finally:
        if observer is not None:
            observer.close()


def _serve_node(args: argparse.Namespace, joined: Callable[[], None]) -> int:
    """A node other than node 0: its share of the worker's processes, no broker (engines/parallel/node.py)."""
    import transformers

    from draftfeed.consumers.engines.parallel.node import serve_node

    transformers.logging.set_verbosity_error()
    _check_device(args.device)
    plan = _node_plan_fingerprint(args)

    def ready() -> None:
        joined()
        announce_ready(role="node", node_rank=args.node_rank, master_addr=args.master_addr)

    return serve_node(
        args.nodes,
        args.engine,
        args.target,
        args.dtype,
        dict(args.engine_option),
        list(args.devices),
        plan,
        args.expert_parallel,
        args.join_timeout,
        ready,
    )


def _check_device(device: str) -> None:
    import torch

    try:
        parsed = torch.device(device)
    except RuntimeError as exc:
        raise UsageError(f"--device {device}: {exc}") from None
    if parsed.type == "cuda" and not torch.cuda.is_available():
        why = "torch here is built without CUDA" if torch.version.cuda is None else "no CUDA device is visible to this process"
        raise UsageError(f"--device {device}: {why}; use --device cpu on this machine")


def _target_problem(target: str, exc: OSError) -> str:
    """Why a target could not be loaded, in one line: a missing folder, or a hub id the hub could not give."""
    path = Path(target)
    if path.is_absolute() or target.startswith((".", "~")) or path.exists() or os.sep in target.strip(os.sep) and path.parent.exists():
        if not path.expanduser().exists():
            return f"--target {target}: no such folder; pass a folder holding the model (its config.json and weights), or a hub id"
        return f"--target {target}: transformers cannot load a model from this folder: {str(exc).splitlines()[0]}"
    first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return (
        f"--target {target}: not a local folder, and the hub could not give it ({first}); without network access, download the "
        "model elsewhere and pass its local folder"
    )


def run_bench(args: argparse.Namespace) -> int:
    return _stopping_children("bench", lambda: _bench(args))


def _bench(args: argparse.Namespace) -> int:
    import tempfile

    from draftfeed.bench.harness import Row, format_table, run, to_json
    from draftfeed.launch import children

    if args.from_json:
        data = json.loads(Path(args.from_json).read_text())
        rows = [Row(**{k: v for k, v in row.items() if k != "ratio"}) for row in data["rows"]]
        args.quick, note = data["quick"], data.get("note")
    else:
        note = None
        with tempfile.TemporaryDirectory(prefix="draftfeed-bench-") as workdir:
            try:
                rows = run(args.scenario or SCENARIO_NAMES, args.quick, Path(workdir), settings=[flags.from_args(ClusterLoad, args)])
            finally:
                children.stop_all()  # before its folder goes
    command = "draftfeed bench" + (" --quick" if args.quick else "")
    print(format_table(rows))
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(to_json(rows, args.quick), indent=2))
    if args.report:
        from draftfeed.bench.report import render

        print(f"wrote {render(rows, args.quick, command, Path(args.docs), note)}")
    return 0


def run_status(args: argparse.Namespace) -> int:
    """Print the status; with --service, exit 1 unless the service has a ready worker (within --wait seconds)."""
    import time

    from draftfeed.launch.status import fetch_for_people, format_status, ready_workers

    if args.wait and args.service is None:
        raise UsageError("--wait goes with --service NAME: the service to wait for")
    keys = _peer_keys(args, "rank", required=False)
    if args.watch is not None:
        return _watch_status(args, keys)
    deadline = time.monotonic() + args.wait
    while True:
        status = fetch_for_people(args.broker, args.timeout, keys, everything=args.list or args.json, pairs=args.pairs)
        ready = ready_workers(status, args.service) if args.service is not None else None
        if ready is None or ready > 0 or time.monotonic() >= deadline:
            break
        time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
    print(json.dumps(status, indent=2) if args.json else format_status(status))
    if ready == 0:
        print(
            f"draftfeed status: service {args.service!r} has no ready worker at {args.broker}" + (f" after {args.wait:g} s" if args.wait else ""),
            file=sys.stderr,
        )
        return 1
    return 0


def _watch_status(args: argparse.Namespace, keys: Any) -> int:
    """``status --watch``: the status again every interval; on a terminal the screen is redrawn in place, elsewhere
    each one follows the last after a separator line. A broker that stops answering is said, and watched for."""
    import time

    from draftfeed.launch.status import fetch_for_people, format_status

    if args.watch <= 0:
        raise UsageError(f"--watch {args.watch:g}: give the seconds between refreshes, more than 0")
    terminal = sys.stdout.isatty()
    try:
        while True:
            try:
                status = fetch_for_people(args.broker, args.timeout, keys, everything=args.list or args.json, pairs=args.pairs)
                text = json.dumps(status, indent=2) if args.json else format_status(status)
            except DraftfeedError as exc:
                text = f"draftfeed status: {exc}"
            stamp = time.strftime("%H:%M:%S")
            if terminal:
                print(f"\x1b[H\x1b[2J{stamp}  every {args.watch:g} s, Ctrl-C to stop\n{text}", flush=True)
            else:
                print(f"---- {stamp}\n{text}", flush=True)
            time.sleep(args.watch)
    except KeyboardInterrupt:
        return 0


def run_demo(args: argparse.Namespace) -> int:
    if args.workers < 1:
        raise UsageError(f"--workers {args.workers}: the demo needs at least one worker to serve its rank")

    def demo() -> int:
        from draftfeed.launch.demo import run_demo

        return run_demo(args)

    return _stopping_children("demo", demo)


_LAYER_ID_FLAGS = ("--target-layer-ids", "--aux-layer-ids")


def _join_negative_layer_ids(argv: Sequence[str]) -> list[str]:
    """``--target-layer-ids -1,7,14`` reads as a flag to argparse; join it into ``--target-layer-ids=-1,7,14``."""
    out: list[str] = []
    items = list(argv)
    index = 0
    while index < len(items):
        item = items[index]
        if item in _LAYER_ID_FLAGS and index + 1 < len(items) and items[index + 1].startswith("-"):
            out.append(f"{item}={items[index + 1]}")
            index += 2
        else:
            out.append(item)
            index += 1
    return out


def _command(args: argparse.Namespace) -> tuple[str, Callable[[argparse.Namespace], int]]:
    if args.command == "launch":
        return (args.role, run_broker) if args.role == "broker" else (args.role, run_worker)
    commands = {"keys": run_keys, "bench": run_bench, "demo": run_demo, "status": run_status, "store": run_store}
    return args.command, commands[args.command]


def main(argv: Sequence[str] | None = None) -> int:
    argv = _join_negative_layer_ids(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    role = _launch_role(parser, argv)
    if role is not None:
        try:
            apply_sources(role[1], argv)
        except UsageError as exc:
            print(f"draftfeed {role[0]}: {exc}", file=sys.stderr)
            return 2
    args = parser.parse_args(argv)
    if getattr(args, "print_config", False):
        print(effective(args, args.settings_parser), end="")
        return 0
    configure_logging(args.log_level, args.log_format)
    name, run = _command(args)
    try:
        return run(args)
    except UsageError as exc:
        print(f"draftfeed {name}: {exc}", file=sys.stderr)
        return 2
    except DraftfeedError as exc:  # no broker answered, a refused registration: not a bug, so no traceback
        print(f"draftfeed {name}: {exc}", file=sys.stderr)
        return 1


def _launch_role(parser: argparse.ArgumentParser, argv: Sequence[str]) -> tuple[str, argparse.ArgumentParser] | None:
    """The role and parser of ``launch broker`` or ``launch worker`` when ``argv`` runs one (their settings may come
    from a file and the environment), else None. Options of ``draftfeed`` itself may come first (``--log-level X``)."""
    options = {option: action for action in parser._actions for option in action.option_strings}
    index = 0
    while index < len(argv) and argv[index].startswith("-"):
        action = options.get(argv[index].split("=", 1)[0])
        index += 2 if action is not None and action.nargs != 0 and "=" not in argv[index] else 1
    if len(argv) < index + 2 or argv[index] != "launch":
        return None
    role = _subparsers(_subparsers(parser)["launch"]).get(argv[index + 1])
    return (argv[index + 1], role) if role is not None else None


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def launch_main(argv: Sequence[str] | None = None) -> int:
    """``python -m draftfeed.launch broker|worker ...``: the same as ``draftfeed launch ...``."""
    return main(["launch", *(sys.argv[1:] if argv is None else argv)])
