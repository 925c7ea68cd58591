"""The command line: every command explains itself, both entry points work, names are derived sensibly."""

from __future__ import annotations

import os
import subprocess

import pytest
from conftest import WORKER_ENV
from support import preload

from draftfeed.consumers.settings import default_service_name
from draftfeed.launch.cli import build_parser

pytestmark = pytest.mark.timeout(120)


def run(*args: str) -> subprocess.CompletedProcess:
    """``python -m MODULE ARGS`` to its end, forked from the suite's preloader (tests/support/preload.py) of the
    workers' environment (one preloader for both)."""
    assert args[0] == "-m", args
    return preload.run_module(args[1], args[2:], {**os.environ, **WORKER_ENV}, timeout_s=60)


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["-m", "draftfeed", "--help"], ["launch", "demo", "status"]),
        (["-m", "draftfeed", "launch", "broker", "--help"], ["--frontend", "--backend", "tcp://*:5555"]),
        (["-m", "draftfeed.launch", "broker", "--help"], ["--frontend", "--backend"]),
        (
            ["-m", "draftfeed.launch", "worker", "--help"],
            [
                "--engine",
                "--task",
                "--target",
                "--service",
                "--device",
                "--dtype",
                "--aux-layer-ids",
                "--capacity",
                "--max-seq-len",
                "--chunk-tokens",
            ],
        ),
        (["-m", "draftfeed", "demo", "--help"], ["--steps", "--workers", "--prefetch-depth"]),
        (["-m", "draftfeed", "status", "--help"], ["--broker", "--json"]),
    ],
)
def test_help_explains_every_flag(argv, expected):
    result = run(*argv)
    assert result.returncode == 0, result.stderr
    for word in expected:
        assert word in result.stdout


def test_every_flag_has_help_text():
    parser = build_parser()
    stack = [parser]
    while stack:
        current = stack.pop()
        for action in current._actions:
            if action.choices and isinstance(action.choices, dict):
                stack.extend(action.choices.values())
            elif action.dest != "help":
                assert action.help, f"{current.prog} {action.option_strings or action.dest} has no help"


def test_default_service_name():
    assert default_service_name("/models/Llama-3.1-8B-Instruct/", "eagle3") == "llama-3.1-8b-instruct-eagle3"
    assert default_service_name("meta-llama/Llama 3", "eagle3") == "llama-3-eagle3"


def test_worker_without_a_broker_fails_clearly(tiny_target):
    result = run("-m", "draftfeed.launch", "worker", "--broker", "tcp://127.0.0.1:1", "--target", str(tiny_target), "--register-timeout", "1")
    assert result.returncode != 0
    assert "no broker answered at tcp://127.0.0.1:1" in result.stderr


def test_engine_options_are_checked_before_the_worker_starts(tiny_target):
    base = ("-m", "draftfeed.launch", "worker", "--broker", "tcp://127.0.0.1:1", "--target", str(tiny_target))
    result = run(*base, "--engine-option", "max_model_len=64")
    assert result.returncode == 2 and "the hf engine takes no options" in result.stderr
    result = run(*base, "--engine-option", "not an option")
    assert result.returncode == 2 and "expected KEY=VALUE" in result.stderr
    result = run(*base, "--engine", "sglang")
    assert result.returncode == 2 and "sglang" in result.stderr and "own virtual environment" in result.stderr


def test_status_of_a_running_broker(cluster):
    result = run("-m", "draftfeed", "status", "--broker", cluster.frontend, "--json")
    assert result.returncode == 0, result.stderr
    assert '"services"' in result.stdout
    table = run("-m", "draftfeed", "status", "--broker", cluster.frontend)
    assert table.stdout.startswith("broker ")


def test_help_shows_every_default_with_its_source():
    from draftfeed.broker.settings import BrokerSettings
    from draftfeed.consumers.settings import WorkerSettings

    worker = run("-m", "draftfeed.launch", "worker", "--help").stdout
    for text in (
        "--dtype {auto,float32,bfloat16,float16}",
        f"(default: {WorkerSettings.model_fields['capacity'].default})",
        "(default: auto)",
        "(default: the task's first form)",
    ):
        assert text in " ".join(worker.split()), text
    broker = " ".join(run("-m", "draftfeed.launch", "broker", "--help").stdout.split())
    defaults = BrokerSettings()
    assert f"(default: {defaults.max_queued_per_rank})" in broker and f"(default: {defaults.heartbeat_interval_s})" in broker
    status = " ".join(run("-m", "draftfeed", "status", "--help").stdout.split())
    assert "(default: tcp://127.0.0.1:5555)" in status and "(default: 10.0)" in status


def launch_parser(role: str):
    from draftfeed.launch.cli import _subparsers

    return _subparsers(_subparsers(build_parser())["launch"])[role]


def settings_fields(model) -> dict:
    """Every field of a settings model with a flag, nested settings' included: name -> FieldInfo."""
    from draftfeed.launch.flags import option_of
    from draftfeed.schemas.settings import Settings

    out = {}
    for name, info in model.model_fields.items():
        if isinstance(info.annotation, type) and issubclass(info.annotation, Settings):
            out.update(settings_fields(info.annotation))
        elif option_of(name, info) is not None:
            out[name] = info
    return out


@pytest.mark.parametrize("role", ["broker", "worker"])
def test_every_setting_is_a_flag_described_by_its_field(role):
    """Each field of BrokerCommand / WorkerCommand (BrokerSettings, WorkerSettings, TargetSettings, TaskSettings and
    the command's own) is a flag of its launch command whose help is the field's description and whose default is
    the field's: a new field cannot be forgotten, nor its help written twice."""
    from draftfeed.launch.flags import flags_of
    from draftfeed.launch.options import BrokerCommand, WorkerCommand

    settings = BrokerCommand if role == "broker" else WorkerCommand
    actions = {option: action for action in launch_parser(role)._actions for option in action.option_strings}
    flags = {flag.field: flag for flag in flags_of(settings)}
    fields = settings_fields(settings)
    assert set(flags) == set(fields)
    helped = "".join(run("-m", "draftfeed.launch", role, "--help").stdout.split())  # argparse wraps lines at hyphens too
    for name, info in fields.items():
        action = actions[flags[name].option]
        assert action.help == info.description, name
        assert action.option_strings[0] in helped and "".join(info.description.split()) in helped, name
        if not info.is_required() and info.get_default(call_default_factory=True) not in ((), {}):
            assert action.default == info.default, name


def test_settings_are_made_from_the_parsed_flags_by_their_fields():
    from draftfeed.broker.settings import BrokerSettings
    from draftfeed.consumers.settings import TargetSettings, TaskSettings, WorkerSettings
    from draftfeed.launch.flags import from_args
    from draftfeed.launch.options import WorkerCommand

    parser = build_parser()
    args = parser.parse_args(["launch", "broker"])
    assert from_args(BrokerSettings, args) == BrokerSettings()
    argv = ["--max-queued", "7", "--heartbeat-interval", "0.5", "--drain-timeout", "2", "--service-max-request-bytes", "a=10"]
    made = from_args(BrokerSettings, parser.parse_args(["launch", "broker", *argv]))
    assert made == BrokerSettings(max_queued_per_service=7, heartbeat_interval_s=0.5, drain_timeout_s=2.0, service_max_request_bytes={"a": 10})
    argv = ["--broker", "tcp://h:1", "--target", "/m", "--send-timeout", "3", "--capacity", "4", "--task", "dspark", "--target-layer-ids=-1,2"]
    args = parser.parse_args(["launch", "worker", *argv, "--engine-option", "a=1", "--devices", "cpu"])
    settings = from_args(WorkerSettings, args, service="s")
    target = TargetSettings(path="/m", engine_options={"a": 1}, devices=("cpu",))
    assert settings == WorkerSettings(
        broker="tcp://h:1", service="s", send_timeout_s=3.0, capacity=4, target=target, task=TaskSettings(name="dspark", target_layer_ids=[-1, 2])
    )
    assert from_args(WorkerCommand, args).worker == settings.model_copy(update={"service": None})


def test_a_value_its_field_refuses_is_one_line_naming_the_flag():
    from draftfeed.launch.flags import from_args
    from draftfeed.launch.options import WorkerCommand
    from draftfeed.schemas.errors import UsageError

    args = build_parser().parse_args(["launch", "worker", "--broker", "tcp://h:1", "--target", "/m"])
    args.task = "medusa"  # past argparse's choices: the model refuses it too
    with pytest.raises(UsageError, match=r"^--task 'medusa': input should be 'eagle3', 'dspark'"):
        from_args(WorkerCommand, args)


def test_the_defaults_docs_operations_shows_are_the_flags_defaults():
    """docs/operations.md's synopsis of `launch broker` / `launch worker` shows defaults (`[--capacity 2]`): each is
    the one the flag takes from its settings field."""
    import re
    from pathlib import Path

    text = (Path(__file__).parent.parent / "docs" / "operations.md").read_text()
    synopsis = text[text.index("draftfeed launch broker") : text.index("(both also take")]
    broker_part, worker_part = synopsis.split("draftfeed launch worker")
    checked = 0
    for role, part in (("broker", broker_part), ("worker", worker_part)):
        actions = {option: action for action in launch_parser(role)._actions for option in action.option_strings}
        for flag, value in re.findall(r"\[(--[a-z-]+) (\d+(?:\.\d+)?)\]", part):
            default = actions[flag].default
            if default is not None:
                assert float(value) == default, f"docs/operations.md shows {flag} {value}; its default is {default}"
                checked += 1
    assert checked >= 15
