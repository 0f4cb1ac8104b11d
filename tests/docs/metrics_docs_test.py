"""docs/observability.md lists the metrics epsd exports, with their types and labels.

Two views of the same contract:

- the source: every family service/telemetry/metrics.cc defines (prometheus-cpp builders,
  the `counter` helper, `Scalar` and hand-built `MetricFamily`s) is a row of the metrics
  tables with the same type, and every `eps_*` or `grpc_server_*` name the docs write is
  one of them;
- a scrape: an idle epsd (every labelled series exists from the start at 0) exports each
  family with the type and the label names the page gives it.

The binaries come from EPS_BINARIES ("name=path;…", as ctest sets it) or else the build/
folder of this checkout.
"""

from __future__ import annotations

import re
import subprocess
import urllib.request
from pathlib import Path

from docs_binaries import binary

ROOT = Path(__file__).resolve().parents[2]
METRICS_CC = ROOT / "service" / "telemetry" / "metrics.cc"
PAGE = ROOT / "docs" / "observability.md"
# The exposer's own families, named in a sentence of the page rather than a table.
EXPOSER = {"exposer_transferred_bytes_total", "exposer_scrapes_total", "exposer_request_latencies"}
# Labels every grpc_server_* series carries, given once above the table.
GRPC_LABELS = {"grpc_service", "grpc_method", "grpc_type"}


def defined_metrics(source: str) -> dict[str, str]:
    """Family name -> type (counter, gauge, histogram) as the C++ source defines them."""
    text = re.sub(r'"\s+"', "", source)  # join adjacent string literals
    found: dict[str, str] = {}
    for kind, name in re.findall(r"prometheus::Build(Counter|Gauge|Histogram|Summary)\(\)\s*"
                                 r"\.Name\(\"(\w+)\"\)", text):
        found[name] = kind.lower()
    for name in re.findall(r"\bcounter\(\"(\w+)\"", text):
        found[name] = "counter"
    for name, kind in re.findall(r"(?:Scalar\(|MetricFamily\s+\w+\s*\{)\s*\"(\w+)\",\s*\"[^\"]*\",\s*"
                                 r"prometheus::MetricType::(\w+)", text):
        found[name] = kind.lower()
    return found


def documented_metrics(page: str) -> dict[str, tuple[str, set[str]]]:
    """Family name -> (type, label names) from the page's metrics tables.

    Rows are `| `name` | type | …` (the gRPC table, whose extra label is written
    `name{label}` and whose shared labels are GRPC_LABELS) or `| `name` | type | labels | …`
    (the eps_* table, the label names in backticks in the third column).
    """
    out: dict[str, tuple[str, set[str]]] = {}
    for line in page.splitlines():
        row = re.match(r"\| `([a-z_:]+)(?:\{(\w+)\})?` \| (counter|gauge|histogram) \|([^|]*)\|",
                       line)
        if not row:
            continue
        name, extra, kind, third = row.groups()
        if name.startswith("grpc_server_"):
            labels = GRPC_LABELS | ({extra} if extra else set())
        else:
            # The labels column names each label in backticks before its values in brackets.
            labels = set(re.findall(r"`(\w+)`", re.sub(r"\([^)]*\)", "", third)))
        out[name] = (kind, labels)
    return out


def test_the_source_reader_finds_every_way_a_family_is_defined() -> None:
    source = '''
auto& a = prometheus::BuildCounter()
  .Name("a_total")
x = counter("b_total",
 "help");
Scalar("c", "help " "more", prometheus::MetricType::Gauge, 1)
prometheus::MetricFamily d{
 "d_seconds",
 "h",
 prometheus::MetricType::Histogram,
'''
    assert defined_metrics(source) == {"a_total": "counter", "b_total": "counter",
                                       "c": "gauge", "d_seconds": "histogram"}


def test_the_page_reader_takes_labels_from_either_table() -> None:
    page = """
| `grpc_server_handled_total{grpc_code}` | counter | RPCs finished |
| `eps_steps_total` | counter | `backend` (cpu, cuda) | steps |
| `eps_groups_total` | counter | | groups |
| `eps_x_total` | counter | `reason` (the code: `not_found`, …) | x |
"""
    assert documented_metrics(page) == {
        "grpc_server_handled_total": ("counter", GRPC_LABELS | {"grpc_code"}),
        "eps_steps_total": ("counter", {"backend"}),
        "eps_groups_total": ("counter", set()),
        "eps_x_total": ("counter", {"reason"}),
    }


def test_every_metric_the_source_defines_is_documented_with_its_type() -> None:
    defined = defined_metrics(METRICS_CC.read_text(encoding="utf-8"))
    documented = documented_metrics(PAGE.read_text(encoding="utf-8"))
    assert len(defined) > 20, defined  # the reader still understands metrics.cc
    problems = [f"{name} ({kind}): not in a metrics table" if name not in documented
                else f"{name}: the page says {documented[name][0]}, the source {kind}"
                for name, kind in sorted(defined.items())
                if name not in documented or documented[name][0] != kind]
    assert problems == []


# Names shaped like a metric: a counter or histogram suffix, or the session gauges. Other
# eps_ names in the docs are libraries, targets and C functions (eps_attn_workspace_bytes).
METRIC_SHAPED = re.compile(r"\b((?:eps|grpc_server)_[a-z0-9_]*?(?:_total|_seconds)"
                           r"|eps_sessions?(?:_[a-z_]*[a-z])?)(?:_bucket|_sum|_count)?\b")
# Former names the docs keep for the record, with the name that replaced them.
FORMER_NAMES = {"eps_summary_bytes_read_total": "eps_summaries_bytes_read_total"}


def test_every_metric_the_docs_name_is_defined() -> None:
    defined = set(defined_metrics(METRICS_CC.read_text(encoding="utf-8")))
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    unknown = set()
    for page in pages:
        text = page.read_text(encoding="utf-8")
        for name in METRIC_SHAPED.findall(text):
            if name in defined:
                continue
            if FORMER_NAMES.get(name) in defined and FORMER_NAMES[name] in text:
                continue
            unknown.add(f"{page.relative_to(ROOT)}: {name}")
    assert sorted(unknown) == []


def scrape_idle_epsd(tmp_path: Path) -> str:
    epsd = subprocess.Popen(
        [binary("epsd"), f"--listen=unix://{tmp_path}/epsd.sock", "--backend=cpu",
         "--metrics-listen=127.0.0.1:0"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert epsd.stdout is not None
        url = None
        for line in epsd.stdout:  # epsd prints the URL once /metrics is served
            found = re.search(r"metrics on (http://\S+/metrics)", line)
            if found:
                url = found.group(1).rstrip(";")
                break
        assert url, "epsd exited without serving /metrics"
        with urllib.request.urlopen(url, timeout=10) as reply:
            return reply.read().decode()
    finally:
        epsd.terminate()
        epsd.wait(timeout=30)


def scraped_families(text: str) -> dict[str, tuple[str, set[str]]]:
    """Family -> (type, label names) of a Prometheus text exposition."""
    families: dict[str, tuple[str, set[str]]] = {}
    for name, kind in re.findall(r"^# TYPE (\S+) (\S+)$", text, re.MULTILINE):
        families[name] = (kind, set())
    for name, labels in re.findall(r"^([a-zA-Z_:][\w:]*)\{([^}]*)\}", text, re.MULTILINE):
        family = name if name in families else re.sub(r"_(bucket|count|sum)$", "", name)
        keys = set(re.findall(r"(\w+)=\"", labels)) - {"le", "quantile"}
        families[family][1].update(keys)
    return families


def test_a_scrape_exports_each_documented_family_with_its_type_and_labels(
        tmp_path: Path) -> None:
    scraped = scraped_families(scrape_idle_epsd(tmp_path))
    documented = documented_metrics(PAGE.read_text(encoding="utf-8"))
    assert "eps_steps_total" in scraped, sorted(scraped)
    problems = []
    for name, (kind, labels) in sorted(scraped.items()):
        if name in EXPOSER:
            continue
        if name not in documented:
            problems.append(f"{name}: exported, not in a metrics table")
        elif documented[name] != (kind, labels):
            problems.append(f"{name}: exported as {kind} {sorted(labels)}, documented as "
                            f"{documented[name][0]} {sorted(documented[name][1])}")
    problems += [f"{name}: documented, not exported" for name in sorted(documented)
                 if name not in scraped]
    assert EXPOSER <= set(scraped), sorted(scraped)
    assert all(f"`{name}`" in PAGE.read_text(encoding="utf-8") for name in EXPOSER)
    assert problems == []
