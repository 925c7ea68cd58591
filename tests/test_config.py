"""Settings of `launch broker` and `launch worker` from --config FILE and DRAFTFEED_* variables: precedence flag >
environment > file > default, refusals that name the key and its line, --print-config."""

from __future__ import annotations

import pytest
import tomllib

from draftfeed.launch.cli import main

WORKER = ["launch", "worker"]


def printed(capsys, *argv: str) -> dict:
    assert main(list(argv) + ["--print-config"]) == 0
    return tomllib.loads(capsys.readouterr().out)


@pytest.fixture
def config(tmp_path):
    path = tmp_path / "worker.toml"
    path.write_text(
        'broker = "tcp://10.0.0.1:5556"\n'
        'target = "/models/llama"\n'
        "capacity = 3\n"
        "max_seq_len = 4096\n"
        "aux-layer-ids = [1, 15, 28]\n"
        "engine-option = { enforce_eager = true, max_model_len = 8192 }\n"
        "secure = false\n"
    )
    return path


def test_flag_beats_environment_beats_file_beats_default(capsys, monkeypatch, config):
    monkeypatch.delenv("DRAFTFEED_CAPACITY", raising=False)
    assert printed(capsys, *WORKER, "--broker", "tcp://h:1", "--target", "/m")["capacity"] == 2  # the default
    from_file = printed(capsys, *WORKER, "--config", str(config))
    assert from_file["capacity"] == 3 and from_file["max-seq-len"] == 4096 and from_file["broker"] == "tcp://10.0.0.1:5556"
    assert from_file["aux-layer-ids"] == [1, 15, 28] and from_file["engine-option"] == ["enforce_eager=true", "max_model_len=8192"]
    monkeypatch.setenv("DRAFTFEED_CAPACITY", "4")
    assert printed(capsys, *WORKER, "--config", str(config))["capacity"] == 4
    assert printed(capsys, *WORKER, "--config", str(config), "--capacity", "5")["capacity"] == 5


def test_the_printed_configuration_reads_back_as_the_same(capsys, tmp_path, config):
    first = printed(capsys, *WORKER, "--config", str(config), "--name", "w0")
    again = tmp_path / "again.toml"
    assert main([*WORKER, "--config", str(config), "--name", "w0", "--print-config"]) == 0
    again.write_text(capsys.readouterr().out)
    assert printed(capsys, *WORKER, "--config", str(again)) == first


def test_options_of_draftfeed_itself_may_come_first(capsys, config):
    assert printed(capsys, "--log-level", "WARNING", "--log-format=json", *WORKER, "--config", str(config))["capacity"] == 3


def test_required_flags_may_come_from_the_environment(capsys, monkeypatch):
    monkeypatch.setenv("DRAFTFEED_BROKER", "tcp://10.0.0.2:5556")
    monkeypatch.setenv("DRAFTFEED_TARGET", "/models/qwen")
    monkeypatch.setenv("DRAFTFEED_SECURE", "no")
    settings = printed(capsys, *WORKER)
    assert settings["broker"] == "tcp://10.0.0.2:5556" and settings["target"] == "/models/qwen" and settings["secure"] is False


@pytest.mark.parametrize(
    "text, message",
    [
        ('broker = "tcp://h:1"\ncapacty = 3\n', r"worker.toml:2: unknown key 'capacty'; this command takes: .*capacity"),
        ('broker = "tcp://h:1"\n\ncapacity = "two"\n', r"worker.toml:3: --capacity takes an integer, got 'two'"),
        ("secure = 1\n", r"worker.toml:1: --secure is true or false, got 1"),
        ('data-plane = "carrier-pigeon"\n', r"worker.toml:1: --data-plane 'carrier-pigeon' is not one of auto, frames"),
        ("capacity = 3\n[worker]\n", r"worker.toml:2: unknown key 'worker'"),
        ("capacity = \n", r"--config .*worker.toml: not TOML"),
    ],
    ids=["unknown", "type", "bool", "choice", "table", "syntax"],
)
def test_a_wrong_file_is_one_line_naming_the_key_and_line(capsys, tmp_path, text, message):
    import re

    path = tmp_path / "worker.toml"
    path.write_text(text)
    assert main([*WORKER, "--config", str(path), "--target", "/m"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and re.search(message, err), err


def test_a_wrong_variable_names_itself(capsys, monkeypatch):
    monkeypatch.setenv("DRAFTFEED_MAX_ATTEMPTS", "many")
    assert main(["launch", "broker", "--print-config"]) == 2
    assert "DRAFTFEED_MAX_ATTEMPTS: --max-attempts 'many': invalid literal for int()" in capsys.readouterr().err


def test_a_missing_file_is_one_line(capsys, tmp_path):
    assert main(["launch", "broker", "--config", str(tmp_path / "nope.toml")]) == 2
    assert "No such file or directory" in capsys.readouterr().err
