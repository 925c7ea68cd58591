"""Which of a batch's recorded target versions answers a request (docs/store.md, "Target versions").

A store may hold one batch at several target versions (a cache filled while the target was updated). A request
takes the newest recorded version it accepts, and never one it does not: ``at-least V`` the newest at V or past it,
``exact V`` V alone, ``latest`` the newest the store holds of that batch (at least V). A rank that asks for no
version takes the newest recorded. A batch recorded without a version (a store older than versions) answers only a
rank that asks for none.
"""

from __future__ import annotations

from collections.abc import Iterable

from draftfeed.schemas.messages import VersionWanted

Recorded = int | None  # a record's target version; None: recorded without one


def pick_version(recorded: Iterable[Recorded], wanted: VersionWanted | None) -> tuple[bool, Recorded]:
    """(found, version): the recorded version that answers ``wanted``; found is False when none does."""
    recorded = list(recorded)
    versions = [version for version in recorded if version is not None]
    if wanted is None:
        return (True, max(versions)) if versions else (bool(recorded), None)
    newest = max(versions, default=None)
    fitting = [version for version in versions if wanted.accepts(version, newest)]
    return (True, max(fitting)) if fitting else (False, None)


def describe_recorded(recorded: Iterable[Recorded]) -> str:
    """'at versions 2, 3' / 'without a version' / 'at version 1 and without one', for an error."""
    recorded = set(recorded)
    versions = sorted(version for version in recorded if version is not None)
    said = f"at version{'s' if len(versions) > 1 else ''} {', '.join(map(str, versions))}" if versions else ""
    if None in recorded:
        said = f"{said} and without one" if said else "without a version"
    return said
