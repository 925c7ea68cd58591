"""Command-line flags made from a settings dataclass's fields, and the settings made back from the parsed flags.

A setting is written once, as a field of its settings class (``BrokerSettings``, ``WorkerConfig``): its name, type,
default and, in the field's ``metadata``, its description. ``add_flags`` turns each field into a flag and
``from_args`` turns the parsed flags back into the settings, so neither the flag, its default, its help nor the
mapping is restated in the CLI. A field maps to a flag as follows:

- the flag's name is the field's, dashes for underscores and without a unit suffix ``_s`` (``drain_timeout_s``:
  ``--drain-timeout``), unless ``metadata["flag"]`` names it (``--max-queued`` for ``max_queued_per_service``);
  ``metadata["flag"] = None`` makes no flag (``WorkerConfig.keys``: it comes from ``--keys``). Its ``dest``, and so
  its ``DRAFTFEED_*`` variable and TOML key (draftfeed/launch/config.py), follows the flag's name;
- ``metadata["help"]`` is its description and its ``--help`` text; the help formatter appends the default;
- its default is the field's default (an empty tuple reads as not set, None); a field without a default is a
  required flag, unless ``metadata["required"]`` is False (then its default is None: the command derives one);
- its type comes from the annotation: ``bool`` a switch (``store_true``), ``int`` and ``float`` themselves, a
  ``Literal`` its values as choices, ``X | None`` as ``X``; ``metadata["parse"]`` names a parser of ``PARSERS``
  for text of its own form (an endpoint, comma-separated devices); a ``dict`` field is a repeatable flag of
  ``KEY=VALUE`` items, its values collected into the dict; ``metadata["choices"]`` and ``metadata["metavar"]`` are
  passed on.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import types
import typing
from collections.abc import Callable, Iterable
from typing import Any, Literal

__all__ = ["PARSERS", "Flag", "add_flags", "flags_of", "from_args"]

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


def service_limit(text: str) -> tuple[str, int]:
    """SERVICE=BYTES, BYTES a positive integer."""
    name, sep, value = text.rpartition("=")
    if not sep or not name or not value.isdigit() or int(value) <= 0:
        raise argparse.ArgumentTypeError(f"expected SERVICE=BYTES like llama-8b-eagle3=67108864; got {text!r}")
    return name, int(value)


# The parsers a field's metadata["parse"] may name: text of a form of its own, checked as the flag is read.
PARSERS: dict[str, Callable[[str], Any]] = {"endpoint": endpoint, "devices": device_list, "service_limit": service_limit}


@dataclasses.dataclass(frozen=True)
class Flag:
    """One field's flag: its option string, its dest, and the keyword arguments of ``add_argument``."""

    field: str
    option: str
    dest: str
    kwargs: dict[str, Any]
    collect: type | None = None  # dict or tuple: what from_args makes of the parsed list


def flags_of(settings: type) -> list[Flag]:
    """The flags of ``settings``'s fields, in field order (fields whose metadata says ``flag: None`` have none)."""
    hints = typing.get_type_hints(settings)
    out = []
    for item in dataclasses.fields(settings):
        meta = item.metadata
        option = meta.get("flag", "--" + re.sub(r"_s$", "", item.name).replace("_", "-"))
        if option is None:
            continue
        if "help" not in meta:
            raise TypeError(f"{settings.__name__}.{item.name}: its metadata has no help (the flag's description)")
        kind = _unwrap(hints[item.name])
        kwargs: dict[str, Any] = {"help": meta["help"], "dest": option.lstrip("-").replace("-", "_")}
        collect: type | None = None
        default = _default_of(item)
        if default is dataclasses.MISSING:
            if meta.get("required", True):
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
        if "parse" in meta:
            kwargs["type"] = PARSERS[meta["parse"]]
        for key in ("choices", "metavar"):
            if key in meta:
                kwargs[key] = meta[key]
        kwargs["default"] = default
        out.append(Flag(item.name, option, kwargs["dest"], kwargs, collect))
    return out


def add_flags(parser: argparse.ArgumentParser | argparse._ArgumentGroup, settings: type, names: Iterable[str] | None = None) -> list[Flag]:
    """Add the flags of ``settings``'s fields to ``parser`` (or an argument group): all of them, or those ``names``
    in that order. Returns the flags added."""
    flags = {flag.field: flag for flag in flags_of(settings)}
    chosen = [flags[name] for name in names] if names is not None else list(flags.values())
    for flag in chosen:
        parser.add_argument(flag.option, **flag.kwargs)
    return chosen


def from_args(settings: type, args: argparse.Namespace, **given: Any) -> Any:
    """``settings`` made from the parsed flags of its fields; ``given`` values (what the command derived: keys,
    resolved devices) win. A field without a flag or a given value keeps its default."""
    values = dict(given)
    for flag in flags_of(settings):
        if flag.field in given or hasattr(args, flag.dest):
            value = given[flag.field] if flag.field in given else getattr(args, flag.dest)
            values[flag.field] = flag.collect(value or ()) if flag.collect is not None else value
    return settings(**values)


def _unwrap(annotation: Any) -> Any:
    """``X`` of ``X | None``; any other annotation as it is."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        rest = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
        if len(rest) == 1:
            return rest[0]
    return annotation


def _default_of(item: dataclasses.Field) -> Any:
    if item.default is not dataclasses.MISSING:
        return item.default
    if item.default_factory is not dataclasses.MISSING:
        return item.default_factory()
    return dataclasses.MISSING
