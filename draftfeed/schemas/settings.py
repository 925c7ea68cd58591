"""The one kind of settings model every side uses (the broker's, a worker's, a rank's, the bench's), as the wire's
messages are pydantic models too. Importing it loads no torch.

A setting is written once, as a field: its name, type, default, and with ``setting()`` its description (the flag's
``--help``) and how a command line spells it (draftfeed/launch/flags.py reads these):

- ``flag``: the option string, when it is not the field's name with dashes and without a unit suffix ``_s``
  (``--max-queued`` for ``max_queued_per_service``); None makes no flag (a value the command derives, like keys);
- ``parse``: the name of a parser in launch/flags.py's ``PARSERS`` for text of its own form (an endpoint, a list);
- ``required``: False for a field without a default whose flag may still be left out (the command derives it);
- ``metavar``, ``choices``, ``group`` (the help section it is listed under, when not its model's ``GROUP``).
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic_core import PydanticUndefined

__all__ = ["Settings", "problems", "setting"]


class Settings(BaseModel):
    """Settings: every field known (no extras), not changed once made (``model_copy(update=...)`` makes another)."""

    model_config = ConfigDict(extra="forbid", frozen=True, arbitrary_types_allowed=True)
    GROUP: ClassVar[str] = "settings"  # the --help section of its fields


def setting(default: Any = PydanticUndefined, help: str = "", *, default_factory: Any = None, **cli: Any) -> Any:
    """A field with its description (``help``) and the command line's spelling of it (``cli``: flag, parse, required,
    metavar, choices, group). Without ``default`` (or ``default_factory``) the field is required."""
    if default_factory is not None:
        return Field(default_factory=default_factory, description=help, json_schema_extra=cli or None)
    return Field(default, description=help, json_schema_extra=cli or None)


def problems(exc: ValidationError, spell: Any = None) -> str:
    """A pydantic error as one line: each wrong field (as ``spell(field_name)`` writes it, e.g. its flag), the value
    given and what it takes."""
    parts = []
    for error in exc.errors():
        where = ".".join(str(part) for part in error["loc"])
        name = spell(str(error["loc"][-1])) if spell is not None and error["loc"] else where
        parts.append(f"{name} {error.get('input')!r}: {error['msg'].lower()}")
    return "; ".join(parts)
