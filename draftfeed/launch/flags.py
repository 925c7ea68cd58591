"""Command-line flags made from a settings model's fields, and the settings made back from the parsed flags.

A setting is written once, as a field of its settings model (draftfeed/schemas/settings.py): its name, type, default
and description. ``add_flags`` turns each field into a flag and ``from_args`` turns the parsed flags back into the
settings, so neither the flag, its default, its help nor the mapping is restated in the CLI. A field maps to a flag
as follows:

- the flag's name is the field's, dashes for underscores and without a unit suffix ``_s`` (``drain_timeout_s``:
  ``--drain-timeout``), unless the field's ``flag`` names it; ``flag=None`` makes no flag. Its ``dest``, and so
  its ``DRAFTFEED_*`` variable and TOML key (draftfeed/launch/toml_and_environment.py), follows the flag's name;
- the field's description is its ``--help`` text; the help formatter appends the default;
- its default is the field's default (an empty tuple reads as not set, None); a field without a default is a
  required flag, unless its ``required`` is False;
- its type comes from the annotation: ``bool`` a switch (``store_true``), ``int`` and ``float`` themselves, a
  ``Literal`` its values as choices, ``X | None`` as ``X``; ``parse`` names a parser of ``PARSERS`` for text of its
  own form (an endpoint, comma-separated devices or layer ids); a ``dict`` field is a repeatable flag of
  ``KEY=VALUE`` items, its values collected into the dict;
- a field whose type is itself a settings model contributes that model's flags, under its ``GROUP`` in ``--help``
  (a field may name another ``group``); ``from_args`` makes the nested model from them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import types
import typing
from collections.abc import Callable, Iterable
from typing import Any, Literal

from pydantic import ValidationError
from pydantic.fields import FieldInfo

from draftfeed.schemas.errors import UsageError
from draftfeed.schemas.settings import Settings, problems

__all__ = ["PARSERS", "Flag", "add_flags", "flags_of", "from_args", "option_of"]

_ENDPOINT = re.compile(r"^(tcp://(\*|[A-Za-z0-9_.-]+|\[[0-9a-fA-F:]+\]):(\*|\d{1,5})|ipc://.+|inproc://.+)$")


def endpoint(text: str) -> str:
    """A ZeroMQ endpoint: tcp://HOST:PORT (HOST * or an address; PORT * for a free one), ipc://PATH or inproc://NAME."""
    if not _ENDPOINT.match(text):
        hint = f"tcp://*:{text}" if text.isdigit() else "tcp://HOST:PORT"
        raise argparse.ArgumentTypeError(f"{text!r} is not a ZeroMQ endpoint: write {hint} (or ipc://PATH)")
    return text


def device_list(text: str) -> list[str]:
    devices = [part.strip() for part in text.split(",") if part.strip()]
    if not devices:
        raise argparse.ArgumentTypeError(f"expected comma-separated devices like cuda:0,cuda:1; got {text!r}")
    return devices


def layer_ids(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated layer ids like 1,15,28; got {text!r}") from None


def service_limit(text: str) -> tuple[str, int]:
    """SERVICE=BYTES, BYTES a positive integer."""
    name, sep, value = text.rpartition("=")
    if not sep or not name or not value.isdigit() or int(value) <= 0:
        raise argparse.ArgumentTypeError(f"expected SERVICE=BYTES like llama-8b-eagle3=67108864; got {text!r}")
    return name, int(value)


def engine_option(text: str) -> tuple[str, object]:
    """KEY=VALUE; VALUE is read as JSON when it parses (0.8, 2, true, {...}) and kept as a string otherwise."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip().isidentifier():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE like gpu_memory_utilization=0.8; got {text!r}")
    try:
        return key.strip(), json.loads(value)
    except json.JSONDecodeError:
        return key.strip(), value


# The parsers a field's ``parse`` may name: text of a form of its own, checked as the flag is read.
PARSERS: dict[str, Callable[[str], Any]] = {
    "endpoint": endpoint,
    "devices": device_list,
    "layer_ids": layer_ids,
    "service_limit": service_limit,
    "engine_option": engine_option,
}


@dataclasses.dataclass(frozen=True)
class Flag:
    """One field's flag: its option string, its dest, the keyword arguments of ``add_argument`` and its help group."""

    field: str
    option: str
    dest: str
    kwargs: dict[str, Any]
    group: str
    collect: type | None = None  # dict or tuple: what from_args makes of the parsed list


def option_of(name: str, info: FieldInfo) -> str | None:
    """The option string of field ``name`` (None: it has no flag)."""
    return _extra(info).get("flag", "--" + re.sub(r"_s$", "", name).replace("_", "-"))


def flags_of(settings: type[Settings]) -> list[Flag]:
    """The flags of ``settings``'s fields, nested settings' included, in field order."""
    out: list[Flag] = []
    for name, info in settings.model_fields.items():
        kind = _unwrap(info.annotation)
        if isinstance(kind, type) and issubclass(kind, Settings):
            out += flags_of(kind)
            continue
        option = option_of(name, info)
        if option is None:
            continue
        if not info.description:
            raise TypeError(f"{settings.__name__}.{name}: it has no description (the flag's help)")
        extra = _extra(info)
        kwargs: dict[str, Any] = {"help": info.description, "dest": option.lstrip("-").replace("-", "_")}
        collect: type | None = None
        default = info.get_default(call_default_factory=True)
        if info.is_required():
            if extra.get("required", True):
                kwargs["required"] = True
            default = None
        origin = typing.get_origin(kind) or kind
        if kind is bool:
            kwargs["action"] = "store_true"
        elif origin is dict:
            kwargs["action"], collect = "append", dict
            default = [*default.items()] if default else []
        else:
            if origin is tuple:
                collect = tuple
                default = [*default] if default else None  # empty: not set
            if origin is Literal:
                kwargs["choices"] = typing.get_args(kind)
            elif kind in (int, float):
                kwargs["type"] = kind
        if "parse" in extra:
            kwargs["type"] = PARSERS[extra["parse"]]
        for key in ("choices", "metavar"):
            if key in extra:
                kwargs[key] = extra[key]
        kwargs["default"] = default
        out.append(Flag(name, option, kwargs["dest"], kwargs, extra.get("group", settings.GROUP), collect))
    return out


def add_flags(parser: argparse.ArgumentParser, settings: type[Settings], skip: Iterable[str] = ()) -> list[Flag]:
    """Add the flags of ``settings``'s fields to ``parser``, each under its group's title (one argument group a
    title, in the order they first come), but those of the fields named in ``skip``. Returns the flags added."""
    groups: dict[str, argparse._ArgumentGroup] = {}
    added = []
    for flag in flags_of(settings):
        if flag.field in skip:
            continue
        if flag.group not in groups:
            groups[flag.group] = parser.add_argument_group(flag.group)
        groups[flag.group].add_argument(flag.option, **flag.kwargs)
        added.append(flag)
    return added


def from_args(settings: type[Settings], args: argparse.Namespace, **given: Any) -> Any:
    """``settings`` made from the parsed flags of its fields (nested settings made from theirs); ``given`` values
    (what the command derived: keys, the service's name) win. A field without a flag or a given value keeps its
    default. A value its field refuses is a UsageError naming the flag."""
    values = dict(given)
    for name, info in settings.model_fields.items():
        if name in given:
            continue
        kind = _unwrap(info.annotation)
        if isinstance(kind, type) and issubclass(kind, Settings):
            values[name] = from_args(kind, args)
            continue
        option = option_of(name, info)
        dest = option.lstrip("-").replace("-", "_") if option is not None else None
        if dest is None or not hasattr(args, dest):
            continue
        value = getattr(args, dest)
        origin = typing.get_origin(kind) or kind
        if origin is dict:
            value = dict(value or ())
        elif origin is tuple:
            value = tuple(value or ())
        if value is None and not info.is_required():
            continue  # not given: the field's default
        values[name] = value
    try:
        return settings(**values)
    except ValidationError as exc:
        flags = {flag.field: flag.option for flag in flags_of(settings)}
        raise UsageError(problems(exc, lambda field: flags.get(field, field))) from None


def _extra(info: FieldInfo) -> dict[str, Any]:
    extra = info.json_schema_extra
    return dict(extra) if isinstance(extra, dict) else {}


def _unwrap(annotation: Any) -> Any:
    """``X`` of ``X | None``; any other annotation as it is."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        rest = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
        if len(rest) == 1:
            return rest[0]
    return annotation
