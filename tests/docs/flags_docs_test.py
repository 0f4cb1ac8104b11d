"""The docs give every binary's flags as its `--help` does: names, defaults and ranges.

`--help` lists each flag as `  --name=default` with its help below, and the help ends with
its range where the flag has one (`in [1, 64]`, `in (0, 1]`, `in [50ms, 1h]`). Checked:

- epsd's flag table (docs/api-server.md) has one row per flag and no other, each with the
  default `--help` prints; the other tables that quote epsd flags with a default
  (docs/observability.md, docs/security.md) quote the same default;
- a default the prose gives (`--slo` (default 2 ms), `--mode=stream`, the default) is the
  binary's;
- every range `--help` prints is written, the same, where the flag's reference page names it;
- every flag a binary takes is named in its reference page (moved here from
  tests/cli/flags_consistency_test.py);
- every `--flag` docs/cli.md names is a flag (or an older name) of one of the binaries.

The binaries come from EPS_BINARIES ("name=path;…", as ctest sets it) or else the build/
folder of this checkout.
"""

from __future__ import annotations

import re
import subprocess
from functools import cache
from pathlib import Path

from docs_binaries import BUILT, binaries, binary

ROOT = Path(__file__).resolve().parents[2]

# Where each binary's flags are documented (docs/cli.md names the pages).
REFERENCE_PAGES = {
    "epsd": ["docs/api-server.md"],
    "eps-load": ["docs/benchmarks/latency.md", "docs/cli.md"],
    "eps-demo": ["docs/cli.md"],
    "eps_core_demo": ["docs/cli.md"],
    "eps-health-probe": ["docs/cli.md"],
}
# Pages with tables of epsd flags and their defaults (| `--flag` | default | …).
EPSD_TABLES = ["docs/api-server.md", "docs/observability.md", "docs/security.md"]


@cache
def usage(name: str) -> dict[str, tuple[str, str]]:
    """Flag -> (default, help) as `name --help` prints them; older names -> ("alias", name)."""
    done = subprocess.run([binary(name), "--help"], capture_output=True, text=True, timeout=30,
                          check=False)
    assert done.returncode == 0, done.stderr
    flags: dict[str, tuple[str, str]] = {}
    for flag, default, help_ in re.findall(r"^  --([a-z0-9-]+)=(.*)\n((?:      .*\n)*)",
                                           done.stdout, re.MULTILINE):
        flags[flag] = (default, " ".join(help_.split()))
    for old, new in re.findall(r"^  --([a-z0-9-]+)  \(the older name of --([a-z0-9-]+)\)",
                               done.stdout, re.MULTILINE):
        flags[old] = ("alias", new)
    assert len(flags) >= 3, done.stdout  # the usage was read
    return flags


SIZE = {"k": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40,
        "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}
SECONDS = {"us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0}
SUPERSCRIPT = str.maketrans("⁰¹²³⁴⁵⁶⁷⁸⁹", "0123456789")


def value(text: str, millis: bool = False) -> float | str:
    """A flag value as a number where it is one (a size, a duration in seconds, 2^30, 1e6),
    else the word: `1k` = `1024` = `1 KiB`, `10s` = `10 s` = `10000` for a *-ms flag."""
    text = text.strip().strip("`").strip()
    if text in ('""', "off", ""):
        return ""
    text = re.sub(r"(?<=\d) (?=\d{3}\b)", "", text)  # 100 000
    power = re.fullmatch(r"(\d+)\s*(?:\^|\*\*)\s*(\d+)", text.replace("2³⁰", "2^30"))
    if power:
        return float(int(power.group(1)) ** int(power.group(2)))
    ten = re.fullmatch(r"10([⁰¹²³⁴⁵⁶⁷⁸⁹]+)", text)
    if ten:
        return float(10 ** int(ten.group(1).translate(SUPERSCRIPT)))
    number = re.fullmatch(r"(\d+(?:\.\d+)?(?:e[+-]?\d+)?)\s*([a-zA-Zµ]*)", text)
    if number:
        n, unit = float(number.group(1)), number.group(2)
        if unit in SIZE:
            return n * SIZE[unit]
        if unit in SECONDS:
            return n * SECONDS[unit]
        if not unit:
            return n / 1000 if millis else n
    return text


INTERVAL = re.compile(r"([\[(])\s*([^\[\](),]+?)\s*,\s*([^\[\](),]+?)\s*([\])])")


def intervals(text: str, millis: bool = False) -> list[tuple]:
    return [(lo_b, value(lo, millis), value(hi, millis), hi_b)
            for lo_b, lo, hi, hi_b in INTERVAL.findall(text)]


def help_range(help_: str, millis: bool) -> tuple | None:
    """The range a flag's help gives: `in [a, b]`, `in (a, b]` (the last one)."""
    found = re.findall(r"\bin ([\[(][^\[\]()]*[\])])", help_)
    return intervals(found[-1], millis)[0] if found else None


def page_blocks(page: str) -> list[str]:
    """A page's table rows, list items and paragraphs, each joined into one line."""
    blocks: list[str] = []
    current: list[str] = []
    fenced = False
    for line in (ROOT / page).read_text(encoding="utf-8").splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        starts = (not line.strip() or line.startswith(("|", "#"))
                  or re.match(r"\s*[-*] ", line) or fenced)
        if starts and current:
            blocks.append(" ".join(current))
            current = []
        if line.strip():
            current.append(line.strip())
    if current:
        blocks.append(" ".join(current))
    return blocks


def names(block: str, flag: str) -> bool:
    return re.search(rf"--{re.escape(flag)}(?![a-z0-9-])", block) is not None


def table_defaults(page: str) -> dict[str, str]:
    """`| `--flag[=X]` | default | …` rows of a page: flag -> the default cell."""
    rows = {}
    for line in (ROOT / page).read_text(encoding="utf-8").splitlines():
        row = re.match(r"\| `--([a-z0-9-]+)(?:=[^`]*)?` \| ([^|]*) \|", line)
        if row:
            rows[row.group(1)] = row.group(2)
    return rows


def default_cell(cell: str) -> str:
    """The value of a default cell: `536870912 (512 MiB)` -> 536870912, `0 (off)` -> 0."""
    return re.sub(r"\s*\(.*\)$", "", cell.strip()).strip("`")


def same(documented: str, printed: str, flag: str) -> bool:
    millis = flag.endswith("-ms")
    a, b = value(documented, millis), value(printed, millis)
    if isinstance(a, float) and isinstance(b, float):
        return abs(a - b) <= 1e-9 * max(abs(a), abs(b), 1.0)
    return a == b


def test_the_value_reader_reads_sizes_durations_and_powers() -> None:
    assert value("1k") == value("1024") == value("1 KiB") == 1024.0
    assert value("10s") == value("10000", millis=True) == value("10 s") == 10.0
    assert value("2³⁰") == value("2^30") == float(1 << 30)
    assert value("10⁶") == value("1e6") == value("1e+06") == 1e6
    assert value("100 000") == 100000.0
    assert value('""') == value("off") == ""
    assert value("questclt") == "questclt"
    assert help_range("sessions at once, in [1, 100000]; also …", False) == ("[", 1.0, 1e5, "]")
    assert help_range("the call's deadline, in [1ms, 60s] (a bare number is ms)", True) == (
        "[", 1e-3, 60.0, "]")
    assert intervals("α in [1, 10⁶]") == [("[", 1.0, 1e6, "]")]


def test_the_epsd_flag_table_has_one_row_per_flag() -> None:
    flags = {f for f, (d, _) in usage("epsd").items() if d != "alias"}
    rows = set(table_defaults("docs/api-server.md"))
    assert sorted(flags - rows) == [], "epsd flags without a row in docs/api-server.md"
    assert sorted(rows - flags) == [], "rows of docs/api-server.md that epsd does not take"


def test_every_epsd_flag_table_quotes_the_default_epsd_prints() -> None:
    flags = usage("epsd")
    problems = []
    for page in EPSD_TABLES:
        for flag, cell in table_defaults(page).items():
            if flag not in flags:
                problems.append(f"{page}: --{flag} is not an epsd flag")
            elif not same(default_cell(cell), flags[flag][0], flag):
                problems.append(f"{page}: --{flag} default {cell!r}, epsd --help: "
                                f"{flags[flag][0]}")
    assert problems == []


# `--flag` (default X), `--flag=N`, default X, `--flag` defaults to X, `--flag=V`, the default;
# X a number (with a unit) or in backticks. An owner before the flag (epsd's `--flag`) says
# whose flag it is on a page that describes several binaries.
PROSE_DEFAULT = re.compile(
    r"(?:([\w-]+)'s )?`--([a-z0-9-]+)(?:=[^`]*)?`\)?,?\s*\(?(?:default|defaults? to):? "
    r"(`[^`]+`|\d+(?:\.\d+)?(?: ?(?:[µm]?s|min|m|h|[kMGT]|[KMGT]iB)\b)?)"
    r"|(?:([\w-]+)'s )?`--([a-z0-9-]+)=([^`]+)`,? the default")


def prose_defaults(page: str) -> list[tuple[str, str, str]]:
    """(owner or "", flag, default) for each default the page's prose gives."""
    found = []
    for block in page_blocks(page):
        for owner, flag, default, owner2, flag2, default2 in PROSE_DEFAULT.findall(block):
            found.append((owner or owner2, flag or flag2, default or default2))
    return found


def test_the_prose_reader_finds_defaults_written_either_way() -> None:
    text = ("`--slo` (default 2 ms) and (`--floor-calls=N`, default 1000; 0 skips it) and "
            "(`--mode=stream`, the default, or …) and epsd's `--eps-group-blocks` defaults to 2 "
            "and `--backend=cuda` (default flags) and `--service` (default `x.y`)")
    found = [(a, b, c) for a, b, c in prose_defaults_of(text)]
    assert found == [("", "slo", "2 ms"), ("", "floor-calls", "1000"), ("", "mode", "stream"),
                     ("epsd", "eps-group-blocks", "2"), ("", "service", "`x.y`")]


def prose_defaults_of(text: str) -> list[tuple[str, str, str]]:
    return [(o or o2, f or f2, d or d2) for o, f, d, o2, f2, d2 in PROSE_DEFAULT.findall(text)]


def test_every_default_the_prose_gives_is_the_binarys() -> None:
    problems = []
    checked = 0
    for page in sorted({p for pages in REFERENCE_PAGES.values() for p in pages}):
        described = [n for n, pages in REFERENCE_PAGES.items() if page in pages]
        for owner, flag, default in prose_defaults(page):
            if owner in BUILT:
                owners = [owner]
            else:  # a flag of one binary the page describes; else ambiguous, not checked
                owners = [n for n in described
                          if flag in usage(n) and usage(n)[flag][0] != "alias"]
                if len(owners) != 1:
                    continue
            printed = usage(owners[0]).get(flag, ("(no such flag)", ""))[0]
            checked += 1
            if not same(default, printed, flag):
                problems.append(f"{page}: {owners[0]} --{flag} default {default}, --help: "
                                f"{printed}")
    assert checked >= 10  # the reader still finds the prose defaults
    assert problems == []


def test_every_flag_a_binary_takes_is_named_in_its_reference_page() -> None:
    assert set(REFERENCE_PAGES) == set(binaries())
    for name, pages in REFERENCE_PAGES.items():
        text = "\n".join((ROOT / page).read_text() for page in pages)
        named = set(re.findall(r"--([a-z0-9][a-z0-9-]*)", text))
        flags = {flag for flag, (default, _) in usage(name).items() if default != "alias"}
        missing = sorted(flags - named)
        assert not missing, f"{name} takes flags {pages} never names: {missing}"


def test_every_range_help_prints_is_in_the_reference_page() -> None:
    problems = []
    for name, pages in REFERENCE_PAGES.items():
        blocks = [b for page in pages for b in page_blocks(page)]
        for flag, (_, help_) in usage(name).items():
            millis = flag.endswith("-ms")
            want = help_range(help_, millis)
            if want is None or help_ == flag:
                continue
            naming = [b for b in blocks if names(b, flag)]
            if not any(want in intervals(b, millis) for b in naming):
                problems.append(f"{name} --{flag}: {help_range_text(help_)} is not written "
                                f"where {pages} name the flag")
    assert problems == []


def help_range_text(help_: str) -> str:
    return re.findall(r"\bin ([\[(][^\[\]()]*[\])])", help_)[-1]


def test_every_flag_cli_md_names_exists() -> None:
    known = {flag for name in BUILT for flag in usage(name)} | {"help", "version"}
    text = (ROOT / "docs" / "cli.md").read_text(encoding="utf-8")
    named = set(re.findall(r"(?<![\w-])--([a-z][a-z0-9-]*[a-z0-9])", text))
    # Not flags: the syntax (`--name=value`, `--name=--value`, `--eps-*`), and a former
    # name the page records.
    named -= {"name", "value", "eps", "deadline-us"}
    assert sorted(named - known) == []
