"""docs/protocol.md stays true to the models: every JSON example in it parses as the message (or target info) it
names and is written as the model writes it, every message type its tables list exists on the socket they put it on,
and every message a socket accepts is listed there."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from pydantic import TypeAdapter

from draftfeed.schemas.messages import (
    BACKEND_INBOUND,
    BACKEND_OUTBOUND,
    DATA_INBOUND,
    DATA_OUTBOUND,
    FRONTEND_INBOUND,
    FRONTEND_OUTBOUND,
    WEIGHTS_INBOUND,
    WEIGHTS_OUTBOUND,
    TargetInfo,
)

DOC = Path(__file__).parent.parent / "docs" / "protocol.md"
TEXT = DOC.read_text()
# Each table of messages, by its heading, and the socket direction it describes.
TABLES = {
    "### Rank → broker (frontend)": FRONTEND_INBOUND,
    "### Broker → rank (frontend)": FRONTEND_OUTBOUND,
    "### Worker → broker (backend)": BACKEND_INBOUND,
    "### Broker → worker (backend)": BACKEND_OUTBOUND,
    "### Worker → rank (data)": DATA_INBOUND,
    "### Rank → worker (data, back on the worker's connection)": DATA_OUTBOUND,
    "### Worker → weights publisher (the socket `publish_weights` opens)": WEIGHTS_INBOUND,
    "### Weights publisher → worker": WEIGHTS_OUTBOUND,
}
SOCKETS = list(TABLES.values())


def json_examples() -> list[tuple[int, str]]:
    """(line number, text) of each line of every ```json block."""
    examples, inside = [], False
    for number, line in enumerate(TEXT.splitlines(), start=1):
        if line.startswith("```"):
            inside = line.strip() == "```json"
            continue
        if inside and line.strip():
            examples.append((number, line))
    return examples


def test_the_doc_has_examples_of_every_kind():
    kinds = {json.loads(line).get("type") or json.loads(line)["task"] for _, line in json_examples()}
    assert {"hello", "welcome", "submit", "dispatch", "result", "done", "eagle3", "dspark", "dflash", "eagle", "vispec"} <= kinds


@pytest.mark.parametrize(("number", "line"), json_examples(), ids=lambda item: str(item) if isinstance(item, int) else "")
def test_each_json_example_parses_as_what_it_names(number, line):
    value = json.loads(line)
    where = f"docs/protocol.md:{number}"
    if "type" in value:
        sockets = [socket for socket in SOCKETS if value["type"] in socket.types]
        assert sockets, f"{where}: no socket takes a {value['type']!r}"
        parsed = sockets[0].validate_json(line.encode())
    else:
        parsed = TypeAdapter(TargetInfo).validate_json(line)
    written = parsed.model_dump(mode="json", exclude_none=True)
    assert written == value, f"{where}: the model writes {json.dumps(written)}"


@pytest.mark.parametrize("heading", list(TABLES))
def test_each_table_lists_exactly_the_messages_its_socket_takes(heading):
    start = TEXT.index(heading)
    end = TEXT.find("\n#", start + len(heading))
    table = TEXT[start : end if end > 0 else len(TEXT)]
    listed = set(re.findall(r"^\| `([a-z_]+)`", table, re.M))
    assert listed == set(TABLES[heading].types), f"{heading}: lists {sorted(listed)}; the socket takes {sorted(TABLES[heading].types)}"
