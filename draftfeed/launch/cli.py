"""The ``draftfeed`` command line: launch a broker or a worker, run the demo or the bench, read the broker's status.

The flags of ``launch broker`` and ``launch worker`` are made from the fields of their settings (BrokerCommand,
WorkerCommand: draftfeed/launch/options.py; draftfeed/launch/flags.py), and the settings from the parsed flags: each
setting's name, default and help is written once, on its field. Other defaults and choices are read from where they
are kept (RankSettings, the protocol's constants); ``--help`` shows each. A usage error is one line on stderr and exit
code 2 (``UsageError``), never a traceback. The CLI loads neither torch nor pyzmq's auth until a command needs them:
``draftfeed launch broker --help`` stays light. Each command runs in a module of its own (launch/*_command.py).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Sequence
from typing import Any

from draftfeed.bench import SCENARIO_NAMES
from draftfeed.bench.cluster import Load as ClusterLoad
from draftfeed.launch import flags
from draftfeed.launch.options import BrokerCommand, PeerKeyFiles, WorkerCommand
from draftfeed.launch.toml_and_environment import apply_sources, effective
from draftfeed.logs import LOG_FORMATS
from draftfeed.logs import configure as configure_logging
from draftfeed.observe.status_client import LIST_AT_MOST
from draftfeed.producers.settings import RankSettings
from draftfeed.schemas.errors import DraftfeedError, UsageError

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
DEFAULT_LOG_LEVEL = "INFO"
DEFAULT_STATUS_BROKER = "tcp://127.0.0.1:5555"


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
    flags.add_flags(bench, ClusterLoad)

    status = _parser(commands, "status", help="print the broker's services, workers, ranks and queues")
    status.add_argument("--broker", type=flags.endpoint, default=DEFAULT_STATUS_BROKER, help="the broker's rank (frontend) endpoint")
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
    flags.add_flags(status, PeerKeyFiles)

    target = _parser(commands, "target", help="change a service's target while it serves (docs/versions.md)")
    target_commands = target.add_subparsers(dest="target_command", required=True)
    update = _parser(target_commands, "update", help="every worker of a service loads new weights in place and serves them as a new version")
    update.add_argument("--broker", type=flags.endpoint, default=DEFAULT_STATUS_BROKER, help="the broker's rank (frontend) endpoint")
    update.add_argument("--service", required=True, help="the service whose workers load the weights")
    update.add_argument(
        "--weights", required=True, help="a safetensors file, or a folder of them, on the workers' filesystem: any subset of the target's tensors"
    )
    update.add_argument("--version", type=int, required=True, help="the target version they serve from then on (newer than what they serve)")
    update.add_argument(
        "--at-once", type=int, default=None, help="how many workers load at a time, the others serving meanwhile (default: all together)"
    )
    update.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for every worker's answer")
    flags.add_flags(update, PeerKeyFiles)

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

    store = _parser(commands, "store", help="inspect or export a supervision store recorded by ranks (docs/store.md)")
    store_commands = store.add_subparsers(dest="store_command", required=True)
    info = _parser(store_commands, "info", help="batches, tokens, bytes per token, the target and the form")
    info.add_argument("path", help="the store's folder (the store= of the recording ranks)")
    check = _parser(store_commands, "verify", help="check every shard against the index (size, sha256, tensors); exit 1 on a bad one")
    check.add_argument("path", help="the store's folder")
    export = _parser(store_commands, "export", help="write a DFlash store as speculators' offline hidden-state files, one a dataset row")
    export.add_argument("path", help="the store's folder (the store= of the speculators backend's ranks)")
    export.add_argument("--format", required=True, choices=["speculators"], help="the files to write")
    export.add_argument("--data-path", required=True, help="speculators' --data-path: the save_to_disk dataset whose rows were recorded")
    export.add_argument("--out", default=None, help="where hs_{i}.safetensors go (default DATA_PATH/hidden_states, speculators' default)")
    export.add_argument("--skip-missing", action="store_true", help="no file for a row the store lacks, instead of refusing and writing nothing")
    return parser


def add_launch_commands(roles: argparse._SubParsersAction) -> None:
    """``launch broker`` and ``launch worker``: their flags are their settings' fields (BrokerCommand, WorkerCommand),
    beside the logging and configuration flags every command takes."""
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
    flags.add_flags(broker, BrokerCommand)
    worker = _parser(roles, "worker", parents=[common], help="run a frozen target and serve its supervision")
    flags.add_flags(worker, WorkerCommand)
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


def run_demo(args: argparse.Namespace) -> int:
    if args.workers < 1:
        raise UsageError(f"--workers {args.workers}: the demo needs at least one worker to serve its rank")

    def demo() -> int:
        from draftfeed.launch.demo import run_demo

        return run_demo(args)

    from draftfeed.launch.signals import stopping_children

    return stopping_children("demo", demo)


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
    """The command's name (a launch command's role) and what runs it, imported only now."""
    if args.command == "launch":
        if args.role == "broker":
            from draftfeed.launch.broker_command import run_broker

            return args.role, run_broker
        from draftfeed.launch.worker_command import run_worker

        return args.role, run_worker
    if args.command == "demo":
        return "demo", run_demo
    module, function = COMMANDS[args.command]
    return args.command, getattr(importlib.import_module(module), function)


# command -> the module and function that run it
COMMANDS = {
    "keys": ("draftfeed.launch.keys_command", "run_keys"),
    "bench": ("draftfeed.launch.bench_command", "run_bench"),
    "status": ("draftfeed.launch.status_command", "run_status"),
    "target": ("draftfeed.launch.target_command", "run_target"),
    "store": ("draftfeed.launch.store_commands", "run_store"),
}


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
