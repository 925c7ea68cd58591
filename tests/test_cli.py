"""The command line: every command explains itself, both entry points work, names are derived sensibly."""

from __future__ import annotations

import subprocess
import sys

import pytest

from draftfeed.launch.cli import build_parser, default_service_name

pytestmark = pytest.mark.timeout(120)


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=60)


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
    from draftfeed.consumers.config import WorkerConfig

    worker = run("-m", "draftfeed.launch", "worker", "--help").stdout
    for text in (
        "--dtype {auto,float32,bfloat16,float16}",
        f"(default: {WorkerConfig.capacity})",
        "(default: auto)",
        "(default: the task's first form)",
    ):
        assert text in " ".join(worker.split()), text
    broker = " ".join(run("-m", "draftfeed.launch", "broker", "--help").stdout.split())
    assert f"(default: {BrokerSettings.max_queued_per_rank})" in broker and f"(default: {BrokerSettings.heartbeat_interval_s})" in broker
    status = " ".join(run("-m", "draftfeed", "status", "--help").stdout.split())
    assert "(default: tcp://127.0.0.1:5555)" in status and "(default: 10.0)" in status


def launch_parser(role: str):
    from draftfeed.launch.cli import _subparsers

    return _subparsers(_subparsers(build_parser())["launch"])[role]


@pytest.mark.parametrize("role", ["broker", "worker"])
def test_every_setting_is_a_flag_described_by_its_field(role):
    """Each field of BrokerSettings / WorkerConfig is a flag of its launch command whose help is the field's
    description and whose default is the field's: a new field cannot be forgotten, nor its help written twice."""
    import dataclasses

    from draftfeed.broker.settings import BrokerSettings
    from draftfeed.consumers.config import WorkerConfig
    from draftfeed.launch.flags import flags_of

    settings = BrokerSettings if role == "broker" else WorkerConfig
    actions = {option: action for action in launch_parser(role)._actions for option in action.option_strings}
    flags = {flag.field: flag for flag in flags_of(settings)}
    assert set(flags) == {f.name for f in dataclasses.fields(settings) if f.metadata.get("flag", "") is not None}
    helped = "".join(run("-m", "draftfeed.launch", role, "--help").stdout.split())  # argparse wraps lines at hyphens too
    for item in dataclasses.fields(settings):
        if item.name not in flags:
            continue
        action = actions[flags[item.name].option]
        assert action.help == item.metadata["help"], item.name
        assert action.option_strings[0] in helped and "".join(item.metadata["help"].split()) in helped, item.name
        if item.default is not dataclasses.MISSING and item.default != ():
            assert action.default == item.default, item.name


def test_settings_are_made_from_the_parsed_flags_by_their_fields():
    from draftfeed.broker.settings import BrokerSettings
    from draftfeed.consumers.config import WorkerConfig
    from draftfeed.launch.flags import from_args

    parser = build_parser()
    args = parser.parse_args(["launch", "broker"])
    assert from_args(BrokerSettings, args) == BrokerSettings()
    argv = ["--max-queued", "7", "--heartbeat-interval", "0.5", "--drain-timeout", "2", "--service-max-request-bytes", "a=10"]
    made = from_args(BrokerSettings, parser.parse_args(["launch", "broker", *argv]))
    assert made == BrokerSettings(max_queued_per_service=7, heartbeat_interval_s=0.5, drain_timeout_s=2.0, service_max_request_bytes={"a": 10})
    args = parser.parse_args(["launch", "worker", "--broker", "tcp://h:1", "--target", "/m", "--send-timeout", "3", "--capacity", "4"])
    config = from_args(WorkerConfig, args, service="s", devices=["cpu"])
    assert config == WorkerConfig(broker="tcp://h:1", service="s", send_timeout_s=3.0, capacity=4, devices=("cpu",))


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
