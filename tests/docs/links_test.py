"""Every reference in the repository points into it.

Fails on a markdown link to a missing file or heading, on a `docs/x.md §N`
reference (in any source or doc file) to a missing page or section, and on
any reference to a document outside the repository: the shared folder beside
a checkout, or the starting design document and its numbered sections.
"""

from __future__ import annotations

import os
import re
import subprocess
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SELF = Path(__file__).resolve()
TEXT_SUFFIXES = {".md", ".cc", ".h", ".cu", ".cuh", ".py", ".proto", ".sh", ".txt", ".yaml",
                 ".yml", ".cmake", ".toml", ".json", ".cfg"}
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
SECTION_REF = re.compile(r"\b(docs/[\w./-]+\.md)(?:\s*§\s*(\d+(?:\.\d+)*)(?:\s*[-–]\s*(\d+))?)?")
# Character classes keep the patterns from matching this file's own source.
OUTSIDE = re.compile(r"\.\.[/]shared|DESIGN[.]md|DESIGN[ ]§")


def repo_files() -> list[Path]:
    """Tracked and untracked-but-not-ignored files (a fresh clone: what git tracks)."""
    try:
        out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout
        files = [ROOT / line for line in out.splitlines()]
    except (OSError, subprocess.CalledProcessError):
        files = [Path(d) / f for d, dirs, names in os.walk(ROOT)
                 for f in names if not any(p.startswith((".", "build")) for p in
                                           Path(d).relative_to(ROOT).parts)]
    return sorted(f for f in files if f.suffix in TEXT_SUFFIXES and f.is_file() and f != SELF)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]{2,}|`", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


@cache
def headings(path: Path) -> tuple[list[str], list[str]]:
    """(anchors, heading texts) of a markdown file, outside fenced code."""
    anchors: list[str] = []
    texts: list[str] = []
    seen: dict[str, int] = {}
    fenced = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        m = None if fenced else re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            base = slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            anchors.append(base if n == 0 else f"{base}-{n}")
            texts.append(m.group(1))
    return anchors, texts


def has_section(path: Path, number: str) -> bool:
    """A heading numbered `number` ("5. The step contract", "3.4 Flags")."""
    return any(re.match(re.escape(number) + r"\.?(\s|$)", t) for t in headings(path)[1])


def prose_lines(path: Path) -> list[tuple[int, str]]:
    """Lines of a markdown file outside fenced code; every line of other files."""
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    if path.suffix != ".md":
        return list(enumerate(lines, 1))
    out, fenced = [], False
    for i, line in enumerate(lines, 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced:
            out.append((i, re.sub(r"`[^`]*`", "", line)))
    return out


def link_problems(path: Path) -> list[str]:
    problems = []
    for i, line in prose_lines(path):
        for target in LINK.findall(line):
            if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
                continue
            file_part, _, anchor = target.partition("#")
            dest = (path.parent / file_part).resolve() if file_part else path
            where = f"{path.relative_to(ROOT)}:{i}: link {target}"
            if not dest.exists():
                problems.append(f"{where}: no such file")
            elif anchor and dest.suffix == ".md" and anchor not in headings(dest)[0]:
                problems.append(f"{where}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    return problems


def section_problems(path: Path) -> list[str]:
    problems = []
    for i, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
        for page, first, last in SECTION_REF.findall(line):
            dest = ROOT / page
            where = f"{path.relative_to(ROOT)}:{i}: {page}"
            if not dest.exists():
                problems.append(f"{where}: no such file")
                continue
            numbers = [first] if first else []
            if first and last:
                numbers += [str(n) for n in range(int(first.split(".")[0]) + 1, int(last) + 1)]
            for n in numbers:
                if not has_section(dest, n):
                    problems.append(f"{where} §{n}: no section {n}")
    return problems


FILES = repo_files()


def test_the_checker_sees_the_docs() -> None:
    assert ROOT / "docs" / "design.md" in FILES
    assert has_section(ROOT / "docs" / "design.md", "5")
    assert not has_section(ROOT / "docs" / "design.md", "99")


def test_slug_follows_github() -> None:
    assert slug("3.4 Flags: `inputs_ready`, `selection_done`") == "34-flags-inputs_ready-selection_done"
    assert slug("Answer: recall at 75 % of KV bytes skipped") == "answer-recall-at-75--of-kv-bytes-skipped"


@pytest.mark.parametrize("path", [f for f in FILES if f.suffix == ".md"],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_markdown_links_resolve(path: Path) -> None:
    assert link_problems(path) == []


def test_section_references_resolve() -> None:
    assert [p for f in FILES for p in section_problems(f)] == []


def test_nothing_points_outside_the_repository() -> None:
    hits = [f"{f.relative_to(ROOT)}:{i}: {line.strip()}"
            for f in FILES
            for i, line in enumerate(f.read_text(encoding="utf-8", errors="replace").splitlines(), 1)
            if OUTSIDE.search(line)]
    assert hits == []
