"""``draftfeed launch worker``: check the flags before torch loads, load the engine and the task, serve until a
signal; on a node other than node 0 of a worker over machines, run that node's processes instead."""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from draftfeed.consumers.settings import WorkerSettings
from draftfeed.launch import flags
from draftfeed.launch.observing import observe
from draftfeed.launch.options import WorkerCommand
from draftfeed.launch.signals import stop_on_signals
from draftfeed.processes.ready import announce_ready
from draftfeed.schemas.errors import CannotServe, UsageError
from draftfeed.schemas.protocol import DEFAULT_WORKER_HTTP_PORT


def run_worker(args: argparse.Namespace) -> int:
    command = checked(flags.from_args(WorkerCommand, args))
    target = command.worker.target
    if target.nnodes > 1 and target.node_rank > 0:
        return _serve_node_observed(command)
    # The flags are checked before torch and transformers load: a mistake there is one line at once. Health answers
    # from now on: not ready while the engine loads.
    serving: list[Any] = []
    observer = observe(
        command.http,
        DEFAULT_WORKER_HTTP_PORT,
        lambda: serving[0].health() if serving else "the worker is loading its engine",
        lambda: serving[0].metrics.registry if serving else None,
        about=lambda: {"tensor_parallel": target.tensor_parallel, "devices": list(target.devices)},
    )
    try:
        return _serve_worker(command.worker, serving, observer.port if observer is not None else None)
    finally:
        if observer is not None:
            observer.close()


def checked(command: WorkerCommand) -> WorkerCommand:
    """The command with its worker's keys read and this machine's devices resolved, or a UsageError that says what
    is wrong with the flags, in one line (no torch loaded yet)."""
    worker, target = command.worker, command.worker.target
    if (problem := worker.task.problem()) is not None:
        raise UsageError(problem)
    if (missing := _missing_folder(target.path) or _unreachable_hub_id(target.path)) is not None:
        raise UsageError(missing)
    keys = command.security.worker_keys()
    if worker.max_seq_len is not None and worker.max_seq_len < 1:
        raise UsageError(f"--max-seq-len {worker.max_seq_len}: give the longest row to take, at least 1 (or leave it out for the target's own limit)")
    try:
        target.node_plan()
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if (problem := target.placement_problem()) is not None:
        raise UsageError(problem)
    if target.devices and target.tensor_parallel == 1 and target.device_map is None:
        raise UsageError(f"--devices {','.join(target.devices)}: add --tensor-parallel {len(target.devices)} (or --device-map auto) to use them")
    try:
        placed = target.placed_devices()
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    resolved = worker.model_copy(update={"keys": keys, "target": target.model_copy(update={"devices": tuple(placed)})})
    return command.model_copy(update={"worker": resolved})


def _serve_worker(settings: WorkerSettings, serving: list[Any], http_port: int | None) -> int:
    import transformers

    from draftfeed.consumers.engines import load_engine
    from draftfeed.consumers.tasks import load_task
    from draftfeed.consumers.tasks.vispec import image_token_id
    from draftfeed.consumers.worker import Worker

    transformers.logging.disable_progress_bar()
    transformers.logging.set_verbosity_error()
    target = settings.target
    _check_device(target.device)
    if settings.data_plane == "nixl":
        from draftfeed.dataplane.nixl.transport import unavailable

        if (problem := unavailable()) is not None:
            raise UsageError(f"--data-plane nixl: {problem}; or use --data-plane auto (NIXL where both sides have it, else frames)")
    try:  # ViSpec's image token, before the engine loads: a text-only target is one line at once
        image_token = image_token_id(transformers.AutoConfig.from_pretrained(target.path)) if settings.task.name == "vispec" else None
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    except OSError as exc:
        raise UsageError(_target_problem(target.path, exc)) from None
    try:
        engine = load_engine(target, plan=node_plan_fingerprint(settings) if target.nnodes > 1 else None)
    except (ValueError, TypeError) as exc:
        raise UsageError(str(exc)) from None
    except OSError as exc:  # transformers could not find or fetch the target
        raise UsageError(_target_problem(target.path, exc)) from None
    try:
        task = load_task(settings.task.model_copy(update={"image_token_id": image_token}), engine)
    except (ValueError, TypeError) as exc:  # a bad layer id, or an engine option the engine's package rejects
        engine.close()
        raise UsageError(str(exc)) from None
    worker = Worker(task, settings)
    serving.append(worker)
    stop_on_signals(worker.stop, "worker")
    try:
        worker.run(on_ready=lambda: announce_ready(role="worker", worker=worker.name, service=worker.service, http_port=http_port))
    finally:
        engine.close()
    if (lost := getattr(engine, "lost", None)) is not None:
        raise CannotServe(f"worker {worker.name}: {lost}; its requests went back to the broker")
    return 0


def node_plan_fingerprint(settings: WorkerSettings) -> dict[str, Any]:
    """What every node of a worker over machines must agree on (consumers/nodes.py)."""
    from draftfeed.consumers.nodes import fingerprint

    target, task = settings.target, settings.task
    task_flags = {
        "task": task.name,
        "aux_layer_ids": task.aux_layer_ids,
        "target_layer_ids": task.target_layer_ids,
        "supervision": task.supervision,
        "expert_parallel": target.expert_parallel,
        "engine_options": dict(target.engine_options),
    }
    return fingerprint(target.path, target.engine, target.dtype, task_flags, target.tensor_parallel, target.nnodes)


def _serve_node_observed(command: WorkerCommand) -> int:
    """A node other than node 0, with /health on --http-port: ready once its processes run (no metrics of its own:
    node 0's are the worker's)."""
    from prometheus_client import CollectorRegistry

    target = command.worker.target
    joined: list[bool] = []
    registry = CollectorRegistry()
    observer = observe(
        command.http,
        DEFAULT_WORKER_HTTP_PORT,
        lambda: None if joined else f"node {target.node_rank} is joining node 0 at {target.master_addr}",
        lambda: registry,
        about=lambda: {"node_rank": target.node_rank, "nnodes": target.nnodes, "devices": list(target.devices)},
    )
    try:
        return _serve_node(command.worker, lambda: joined.append(True))
    finally:
        if observer is not None:
            observer.close()


def _serve_node(settings: WorkerSettings, joined: Callable[[], None]) -> int:
    """A node other than node 0: its share of the worker's processes, no broker (engines/parallel/node.py)."""
    import transformers

    from draftfeed.consumers.engines.parallel.node import serve_node

    transformers.logging.set_verbosity_error()
    target = settings.target
    _check_device(target.device)

    def ready() -> None:
        joined()
        announce_ready(role="node", node_rank=target.node_rank, master_addr=target.master_addr)

    return serve_node(target, node_plan_fingerprint(settings), ready)


def _check_device(device: str) -> None:
    import torch

    try:
        parsed = torch.device(device)
    except RuntimeError as exc:
        raise UsageError(f"--device {device}: {exc}") from None
    if parsed.type == "cuda" and not torch.cuda.is_available():
        why = "torch here is built without CUDA" if torch.version.cuda is None else "no CUDA device is visible to this process"
        raise UsageError(f"--device {device}: {why}; use --device cpu on this machine")


def _looks_local(target: str) -> bool:
    path = Path(target)
    return path.is_absolute() or target.startswith((".", "~")) or path.exists() or os.sep in target.strip(os.sep) and path.parent.exists()


def _missing_folder(target: str) -> str | None:
    """Why ``target``, written as a local folder, cannot be one (it does not exist), or None: found out before torch loads."""
    if _looks_local(target) and not Path(target).expanduser().exists():
        return f"--target {target}: no such folder; pass a folder holding the model (its config.json and weights), or a hub id"
    return None


def _unreachable_hub_id(target: str) -> str | None:
    """Why ``target``, a hub id, cannot be had (the hub, or its cache offline, has no config for it), or None: its
    config.json is fetched (or found in the cache) before torch loads, so that a wrong id or a machine without the
    hub is one line at once rather than after the engine's imports."""
    if _looks_local(target):
        return None
    from huggingface_hub import hf_hub_download

    logging.getLogger("huggingface_hub").setLevel(logging.ERROR)  # its retries say nothing the one error line does not
    try:
        hf_hub_download(target, "config.json")
    except (OSError, ValueError) as exc:  # huggingface_hub's errors are OSErrors; a malformed id is a ValueError
        return _target_problem(target, exc)
    return None


def _target_problem(target: str, exc: OSError | ValueError) -> str:
    """Why a target could not be loaded, in one line: a missing folder, or a hub id the hub could not give."""
    if _looks_local(target):
        return _missing_folder(target) or f"--target {target}: transformers cannot load a model from this folder: {str(exc).splitlines()[0]}"
    first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    if isinstance(exc, ValueError):
        return f"--target {target}: neither a local folder nor a hub id ({first}); pass the model's folder, or its hub id as namespace/name"
    return (
        f"--target {target}: not a local folder, and the hub could not give it ({first}); without network access, download the "
        "model elsewhere and pass its local folder"
    )
