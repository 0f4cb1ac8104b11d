"""The environment variables epsd and the clients read are the ones the docs give.

- every OTEL_* variable service/ reads is a row of docs/observability-traces.md's table
  (`OTEL_EXPORTER_OTLP_[TRACES_]X` standing for both spellings), and every OTEL_* variable
  the docs name is one epsd reads;
- the variables the client libraries read (EPS_TARGET, the library paths) are named in the
  docs.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TRACES_PAGE = ROOT / "docs" / "observability-traces.md"


def sources(*folders: str, suffixes: tuple[str, ...] = (".cc", ".h")) -> str:
    return "\n".join(p.read_text(encoding="utf-8") for folder in folders
                     for p in sorted((ROOT / folder).rglob("*")) if p.suffix in suffixes)


def otel_read_by(code: str) -> set[str]:
    """OTEL_* names a C++ source reads: literals, and the suffixes given to GetTraces or
    TracesName, which read OTEL_EXPORTER_OTLP_TRACES_X and then OTEL_EXPORTER_OTLP_X."""
    names = set(re.findall(r"\"(OTEL_[A-Z_]*[A-Z])\"", code))
    for suffix in re.findall(r"(?:GetTraces|TracesName)\(\w+, \"([A-Z_]+)\"\)", code):
        names |= {f"OTEL_EXPORTER_OTLP_{suffix}", f"OTEL_EXPORTER_OTLP_TRACES_{suffix}"}
    return names


def otel_named_in(text: str) -> set[str]:
    """OTEL_* names a page writes, `OTEL_EXPORTER_OTLP_[TRACES_]X` as both spellings; a
    prefix the page writes with an ellipsis (`OTEL_EXPORTER_OTLP_…`) is not a name."""
    names = set()
    for head, optional, tail in re.findall(r"\b(OTEL_[A-Z_]*?)(\[[A-Z_]+\])?([A-Z_]*[A-Z])\b(?!…)",
                                           text):
        names.add(head + tail)
        if optional:
            names.add(head + optional.strip("[]") + tail)
    return names


def test_the_readers_expand_both_spellings() -> None:
    code = 'Get(env, "OTEL_SDK_DISABLED"); GetTraces(env, "PROTOCOL"); TracesName(env, "TIMEOUT");'
    assert otel_read_by(code) == {"OTEL_SDK_DISABLED", "OTEL_EXPORTER_OTLP_PROTOCOL",
                                  "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_TIMEOUT",
                                  "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT"}
    assert otel_named_in("| `OTEL_EXPORTER_OTLP_[TRACES_]HEADERS` | `OTEL_BSP_X` "
                         "`OTEL_EXPORTER_OTLP_…`") == {
        "OTEL_EXPORTER_OTLP_HEADERS", "OTEL_EXPORTER_OTLP_TRACES_HEADERS", "OTEL_BSP_X"}


def test_every_otel_variable_epsd_reads_is_in_the_table() -> None:
    read = otel_read_by(sources("service"))
    assert len(read) > 10, read  # the reader still understands otel_config.cc
    rows = "\n".join(line for line in TRACES_PAGE.read_text(encoding="utf-8").splitlines()
                     if line.startswith("| `OTEL_"))
    assert sorted(read - otel_named_in(rows)) == []


def test_every_otel_variable_the_docs_name_is_read() -> None:
    read = otel_read_by(sources("service"))
    unknown = set()
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        for name in otel_named_in(page.read_text(encoding="utf-8")) - read:
            unknown.add(f"{page.relative_to(ROOT)}: {name}")
    assert sorted(unknown) == []


def test_every_variable_the_client_libraries_read_is_documented() -> None:
    code = (sources("client/cpp") + sources("client/python/src", suffixes=(".py",)))
    read = set(re.findall(r"getenv\(\"(EPS_[A-Z_]+)\"\)", code))
    read |= set(re.findall(r"environ\.get\(\"(EPS_[A-Z_]+)\"", code))
    assert "EPS_TARGET" in read, read
    docs = "\n".join(p.read_text(encoding="utf-8") for p in (ROOT / "docs").rglob("*.md"))
    assert sorted(name for name in read if name not in docs) == []
