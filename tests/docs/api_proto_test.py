"""docs/api.md describes the proto as it is: every RPC, enum value and message field.

Reads proto/eps/v1/*.proto and the API pages (docs/api*.md) as text, no build needed:

- every RPC is a row of the RPC table, with its request and response messages;
- every enum value is written `NAME` = number, and every enum-like name the pages write
  (`METHOD_…`, `DTYPE_…`, …) is a value of the proto;
- every message with fields has them documented as table rows `| # | field | type |`
  under its bold name (or in a `| message | # | field | type |` table), with the proto's
  numbers and types, and no row documents a field the message does not have.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROTOS = sorted((ROOT / "proto" / "eps" / "v1").glob("*.proto"))
API_PAGES = sorted((ROOT / "docs").glob("api*.md"))


@dataclass
class Proto:
    rpcs: dict[str, tuple[str, str]] = field(default_factory=dict)  # name -> (request, response)
    enums: dict[str, dict[str, int]] = field(default_factory=dict)  # "BufferWrite.Target" too
    messages: dict[str, dict[str, tuple[int, str]]] = field(default_factory=dict)  # name -> fields


FIELD = re.compile(r"^\s*(optional\s+|repeated\s+)?([\w.]+)\s+(\w+)\s*=\s*(\d+)\s*;")


def strip_comments(text: str) -> str:
    return re.sub(r"//[^\n]*", "", text)


def parse_proto(text: str) -> Proto:
    """The RPCs, enums and message fields of one proto3 file (the subset this repo uses)."""
    proto = Proto()
    text = strip_comments(text)
    for name, req, resp in re.findall(
        r"rpc\s+(\w+)\s*\(\s*(?:stream\s+)?(\w+)\s*\)\s*returns\s*\(\s*(?:stream\s+)?(\w+)\s*\)",
        text,
    ):
        proto.rpcs[name] = (req, resp)
    # Walk the blocks, keeping the enclosing message names for nested enums.
    stack: list[tuple[str, str]] = []  # (kind, name)
    for line in text.splitlines():
        opened = re.match(r"\s*(message|enum|oneof|service)\s+(\w+)\s*\{", line)
        if opened:
            kind, name = opened.groups()
            if kind == "message":
                outer = [n for k, n in stack if k == "message"]
                full = ".".join([*outer, name])
                proto.messages[full] = {}
            elif kind == "enum":
                outer = [n for k, n in stack if k == "message"]
                full = ".".join([*outer, name])
                proto.enums[full] = {}
            stack.append((kind, name))
            if "}" in line:
                stack.pop()
            continue
        if re.match(r"\s*\}", line):
            stack.pop()
            continue
        if not stack:
            continue
        kind = stack[-1][0]
        messages = [n for k, n in stack if k == "message"]
        if kind == "enum":
            value = re.match(r"\s*(\w+)\s*=\s*(\d+)\s*;", line)
            if value:
                enum = ".".join([*messages, stack[-1][1]])
                proto.enums[enum][value.group(1)] = int(value.group(2))
        elif kind in ("message", "oneof"):
            f = FIELD.match(line)
            if f:
                label, type_, name, number = f.groups()
                label = (label or "").strip()
                if kind == "oneof":
                    label = "oneof"
                proto.messages[".".join(messages)][name] = (
                    int(number), f"{label} {type_}".strip())
    # A nested type is written by its full name in the pages (`BufferWrite.Target`).
    for message, fields in proto.messages.items():
        for name, (number, type_) in fields.items():
            label, _, base = type_.rpartition(" ")
            nested = f"{message}.{base}"
            if nested in proto.enums or nested in proto.messages:
                fields[name] = (number, f"{label} {nested}".strip())
    return proto


def load_proto() -> Proto:
    merged = Proto()
    for path in PROTOS:
        p = parse_proto(path.read_text(encoding="utf-8"))
        merged.rpcs.update(p.rpcs)
        merged.enums.update(p.enums)
        merged.messages.update(p.messages)
    return merged


def cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def plain(cell: str) -> str:
    return re.sub(r"\s+", " ", cell.replace("`", "")).strip()


def documented_fields(text: str) -> dict[str, dict[str, tuple[int, str]]]:
    """Message -> {field: (number, type)} from the pages' field tables.

    A table of `| # | field | type | …` rows belongs to the last bold message name
    (**`Name`**) above it; in a `| message | # | field | type | …` table the first cell
    names the message, a blank one continuing the row above. `**`M`**: `f` (1, string)`
    documents a one-field message inline. A oneof's row, `| 1–4 | `memory` | oneof a / b |`,
    documents the oneof's members.
    """
    docs: dict[str, dict[str, tuple[int, str]]] = {}
    current = None
    message_column = False
    fenced = False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if fenced:
            continue
        for name, fname, number, type_ in re.findall(
                r"\*\*`(\w+)`\*\*: `(\w+)` \((\d+), ([\w ]+)\)", line):
            docs.setdefault(name, {})[fname] = (int(number), type_)
        bold = re.match(r"\*\*`([\w.]+)`\*\*", line)
        if bold:
            current = bold.group(1)
            message_column = False
            continue
        if not line.startswith("|"):
            if line.strip():
                message_column = False
            continue
        row = cells(line)
        if row[:4] == ["message", "#", "field", "type"]:
            message_column = True
            continue
        if message_column:
            if row[0]:
                current = plain(row[0]) if re.fullmatch(r"`\w+`", row[0]) else None
            row = row[1:]
        if current is None or len(row) < 3:
            continue
        oneof = re.fullmatch(r"(\d+)[–-](\d+)", row[0])
        if oneof and plain(row[2]).startswith("oneof "):
            members = re.findall(r"`(\w+)`", row[2])
            first = int(oneof.group(1))
            for i, member in enumerate(members):
                docs.setdefault(current, {})[member] = (first + i, "oneof")
            continue
        if re.fullmatch(r"\d+", row[0]) and re.fullmatch(r"`\w+`", row[1]):
            docs.setdefault(current, {})[plain(row[1])] = (int(row[0]), plain(row[2]))
    return docs


def same_type(documented: str, proto_type: str) -> bool:
    """The page's type cell against the proto's: oneof members by name only."""
    if proto_type.startswith("oneof "):
        return documented == "oneof"
    return documented == proto_type


def api_text() -> str:
    return "\n".join(p.read_text(encoding="utf-8") for p in API_PAGES)


def test_the_proto_parser_reads_the_proto() -> None:
    proto = load_proto()
    assert proto.rpcs["StreamSelectPages"] == ("SelectPagesRequest", "SelectPagesResponse")
    assert proto.enums["BufferWrite.Target"]["TARGET_QUERIES"] == 4
    assert proto.messages["SelectOptions"]["alpha"] == (2, "optional float")
    assert proto.messages["MemoryDescriptor"]["host_shm"] == (3, "oneof HostShm")
    assert proto.messages["SelectPagesRequest"]["rows"] == (3, "repeated BatchRow")
    assert len(proto.messages) > 20, sorted(proto.messages)


def test_the_table_reader_finds_rows_under_their_message() -> None:
    page = """**`Foo`** — a message

| # | field | type | meaning |
| --- | --- | --- | --- |
| 1 | `a` | optional float | x |
| 2 | `b` | repeated `Bar` | |

| message | # | field | type | meaning |
| --- | --- | --- | --- | --- |
| `Baz` | 1 | `c` | string | |
| | 2 | `d` | uint32 | |
**`Qux`**: `e` (1, string). **`Quux`**: empty.
"""
    assert documented_fields(page) == {
        "Foo": {"a": (1, "optional float"), "b": (2, "repeated Bar")},
        "Baz": {"c": (1, "string"), "d": (2, "uint32")},
        "Qux": {"e": (1, "string")},
    }


def test_every_rpc_is_in_the_rpc_table_with_its_messages() -> None:
    text = api_text()
    problems = []
    for name, (req, resp) in load_proto().rpcs.items():
        row = re.search(rf"^\| `{name}` \| ([^|]*) \|", text, re.MULTILINE)
        if row is None:
            problems.append(f"{name}: no row in the RPC table")
        elif f"`{req}`" not in row.group(1) or f"`{resp}`" not in row.group(1):
            problems.append(f"{name}: the table says {row.group(1)!r}, the proto {req} -> {resp}")
    assert problems == []


def test_every_enum_value_is_documented_with_its_number() -> None:
    text = api_text()
    missing = [f"`{value}` = {number} ({enum})"
               for enum, values in load_proto().enums.items()
               for value, number in values.items()
               if not re.search(rf"`{value}` = {number}\b", text)]
    assert missing == []


def test_every_enum_value_the_docs_name_exists() -> None:
    proto = load_proto()
    values = {v for vals in proto.enums.values() for v in vals}
    prefixes = {re.match(r"[A-Z0-9]+_", v).group(0) for v in values}
    alternatives = "|".join(sorted(prefixes))
    pattern = re.compile(rf"\b(?:{alternatives})[A-Z0-9_]*[A-Z0-9]\b")
    unknown = set()
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    for page in docs:
        for name in pattern.findall(page.read_text(encoding="utf-8")):
            if name not in values:
                unknown.add(f"{page.relative_to(ROOT)}: {name}")
    assert sorted(unknown) == []


def test_every_message_field_is_documented_with_its_number_and_type() -> None:
    proto = load_proto()
    docs = documented_fields(api_text())
    problems = []
    for message, fields in proto.messages.items():
        documented = docs.get(message, {})
        for name, (number, type_) in fields.items():
            if name not in documented:
                problems.append(f"{message}.{name} ({number}, {type_}): not documented")
                continue
            doc_number, doc_type = documented[name]
            if doc_number != number or not same_type(doc_type, type_):
                problems.append(f"{message}.{name}: documented as ({doc_number}, {doc_type}), "
                                f"the proto has ({number}, {type_})")
    assert problems == []


def test_every_documented_field_exists_in_the_proto() -> None:
    proto = load_proto()
    problems = [f"{message}.{name}: documented, not in the proto"
                for message, fields in documented_fields(api_text()).items()
                for name in fields
                if name not in proto.messages.get(message, {})]
    assert problems == []


def test_every_message_is_named_in_the_api_pages() -> None:
    text = api_text()
    missing = [m for m in load_proto().messages if f"`{m}`" not in text]
    assert missing == []
