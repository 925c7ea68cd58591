"""The settings of ``launch broker`` and ``launch worker`` from a TOML file and the environment.

Every flag can also come from ``--config FILE`` (a TOML file of ``flag-name = value`` at its top level, the names
as the flags spell them without the dashes; ``max_seq_len`` and ``max-seq-len`` are the same key) and from a
``DRAFTFEED_<FLAG_NAME>`` environment variable (``DRAFTFEED_MAX_SEQ_LEN=4096``). Precedence: a flag given on the
command line, then the environment, then the file, then the flag's default. A key the command does not know,
or a value of the wrong type, is refused with its name, where it came from (the file and line, or the
variable) and what it takes.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import tomllib

from draftfeed.schemas.errors import UsageError

ENV_PREFIX = "DRAFTFEED_"
# Flags that are not settings: they say where the settings are or what to do with them.
_NOT_SETTINGS = {"help", "config", "print_config"}


def apply_sources(parser: argparse.ArgumentParser, argv: Sequence[str], environ: Mapping[str, str] = os.environ) -> None:
    """Make the file's and the environment's values ``parser``'s defaults (flags given in ``argv`` still win)."""
    actions = {action.dest: action for action in parser._actions if action.option_strings and action.dest not in _NOT_SETTINGS}
    values: dict[str, Any] = {}
    config = _config_path(argv)
    if config is not None:
        values.update(_from_file(config, actions))
    values.update(_from_environment(environ, actions))
    for dest in values:
        actions[dest].required = False  # given by the file or the environment
    parser.set_defaults(**values)


def effective(args: argparse.Namespace, parser: argparse.ArgumentParser) -> str:
    """The settings in force, as a TOML file ``--config`` reads back."""
    lines = []
    for action in parser._actions:
        if not action.option_strings or action.dest in _NOT_SETTINGS or not hasattr(args, action.dest):
            continue
        value = getattr(args, action.dest)
        key = action.option_strings[-1].lstrip("-")
        lines.append(f"# {key} = (not set)" if value is None else f"{key} = {_toml(value)}")
    return "\n".join(lines) + "\n"


def _config_path(argv: Sequence[str]) -> Path | None:
    for index, arg in enumerate(argv):
        if arg == "--config" and index + 1 < len(argv):
            return Path(argv[index + 1])
        if arg.startswith("--config="):
            return Path(arg.split("=", 1)[1])
    return None


def _from_file(path: Path, actions: dict[str, argparse.Action]) -> dict[str, Any]:
    try:
        text = path.read_text()
    except OSError as exc:
        raise UsageError(f"--config {path}: {exc.strerror}") from None
    try:
        table = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise UsageError(f"--config {path}: not TOML: {exc}") from None
    values = {}
    for key, value in table.items():
        where = f"{path}:{_line_of(text, key)}"
        dest = key.replace("-", "_")
        if dest not in actions:
            known = ", ".join(sorted(a.option_strings[-1].lstrip("-") for a in actions.values()))
            raise UsageError(f"{where}: unknown key {key!r}; this command takes: {known}")
        values[dest] = _converted(actions[dest], value, where, from_text=False)
    return values


def _from_environment(environ: Mapping[str, str], actions: dict[str, argparse.Action]) -> dict[str, Any]:
    values = {}
    for dest, action in actions.items():
        name = ENV_PREFIX + dest.upper()
        if name in environ:
            values[dest] = _converted(action, environ[name], name, from_text=True)
    return values


def _converted(action: argparse.Action, value: Any, where: str, *, from_text: bool) -> Any:
    """``value`` as the flag would have parsed it, or a UsageError that says what the flag takes."""
    flag = action.option_strings[-1]
    if isinstance(action, argparse._StoreTrueAction):
        if from_text:
            if value.lower() in ("1", "true", "yes", "on"):
                return True
            if value.lower() in ("0", "false", "no", "off", ""):
                return False
        elif isinstance(value, bool):
            return value
        raise UsageError(f"{where}: {flag} is true or false, got {value!r}")
    if isinstance(action, argparse._AppendAction):
        if from_text:
            items = shlex.split(value)
        elif isinstance(value, dict):
            items = [f"{k}={json.dumps(v) if not isinstance(v, str) else v}" for k, v in value.items()]
        elif isinstance(value, list):
            items = [str(v) for v in value]
        else:
            raise UsageError(f"{where}: {flag} takes a list of KEY=VALUE strings or a table, got {value!r}")
        return [_typed(action, item, where) for item in items]
    if not from_text:
        expected = _expected_type(action)
        if isinstance(value, list):
            value = ",".join(str(v) for v in value)  # a list of ids, as the flag's comma-separated form
        elif expected is int and (isinstance(value, bool) or not isinstance(value, int)):
            raise UsageError(f"{where}: {flag} takes an integer, got {value!r}")
        elif expected is float and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise UsageError(f"{where}: {flag} takes a number, got {value!r}")
        elif expected is str and not isinstance(value, str):
            raise UsageError(f"{where}: {flag} takes a string, got {value!r}")
    return _typed(action, str(value), where)


def _expected_type(action: argparse.Action) -> type | None:
    if action.type in (int, float):
        return action.type  # type: ignore[return-value]
    if action.type is None or action.type is str or action.type is str.upper:
        return str
    return None  # a parser of its own (endpoints, id lists): it checks the text


def _typed(action: argparse.Action, text: str, where: str) -> Any:
    flag = action.option_strings[-1]
    try:
        value = action.type(text) if callable(action.type) else text
    except (argparse.ArgumentTypeError, ValueError, TypeError) as exc:
        raise UsageError(f"{where}: {flag} {text!r}: {exc}") from None
    if action.choices is not None and value not in action.choices:
        raise UsageError(f"{where}: {flag} {value!r} is not one of {', '.join(map(str, action.choices))}")
    return value


def _line_of(text: str, key: str) -> int:
    pattern = re.compile(rf"""^\s*(\[\s*)?["']?{re.escape(key)}["']?\s*[=\]]""")  # key = ..., or a table [key]
    for number, line in enumerate(text.splitlines(), start=1):
        if pattern.match(line):
            return number
    return 1


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml(_pair(v) if isinstance(v, tuple) else v) for v in value) + "]"
    return json.dumps(str(value))


def _pair(item: tuple[Any, Any]) -> str:
    """A KEY=VALUE flag's parsed pair, written back as the flag takes it (a non-string value as JSON)."""
    key, value = item
    return f"{key}={value if isinstance(value, str) else json.dumps(value)}"
