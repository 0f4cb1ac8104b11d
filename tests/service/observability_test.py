"""Observability end to end: the real epsd, driven by the C++ client
(observability_traffic), exports spans over OTLP/gRPC and OTLP/HTTP to a
receiver that decodes them with the official opentelemetry-proto package;
/metrics is scraped and compared with the traffic sent; the step log is read
back; a dead or silent collector must neither fail steps nor hold up exit.

Run by ctest with EPSD_BIN and EPS_TRAFFIC_BIN set; EPS_TEST_SEED replays."""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from opentelemetry.proto.trace.v1 import trace_pb2
from otlp_receiver import OtlpReceiver, ReceivedSpan, attributes

EPSD = os.environ.get("EPSD_BIN", "build/service/epsd")
TRAFFIC = os.environ.get("EPS_TRAFFIC_BIN", "build/tests/service/observability_traffic")
SERVER_SPAN = "eps.v1.PageSelector/SelectPages"


@pytest.fixture(scope="module")
def seed() -> int:
    value = int(os.environ.get("EPS_TEST_SEED", random.SystemRandom().randrange(1 << 62)))
    print(f"seed={value} (replay with EPS_TEST_SEED={value})")
    return value


@pytest.fixture
def receiver() -> Iterator[OtlpReceiver]:
    r = OtlpReceiver().start()
    yield r
    r.stop()


class Epsd:
    """epsd on a fresh Unix socket with /metrics on a kernel-chosen port; stderr is collected
    by a reader thread, and start() returns once epsd has printed where it serves."""

    def __init__(self, tmp: Path, env: dict[str, str], flags: list[str]) -> None:
        self.lines: list[str] = []
        self._cond = threading.Condition()
        full_env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
        full_env.update(env)
        self.proc = subprocess.Popen(
            [
                EPSD,
                f"--listen=unix://{tmp}/epsd.sock",
                "--backend=cpu",
                "--metrics-listen=127.0.0.1:0",
                *flags,
            ],
            stderr=subprocess.PIPE,
            text=True,
            env=full_env,
        )
        threading.Thread(target=self._read, daemon=True).start()
        with self._cond:
            ok = self._cond.wait_for(
                lambda: self._find(r"metrics on (http://\S+)") or self.proc.poll() is not None,
                timeout=30,
            )
        assert ok and self.proc.poll() is None, "epsd did not start:\n" + "".join(self.lines)
        self.target = self._find(r"listening on (\S+)")
        self.metrics_url = self._find(r"metrics on (http://\S+)")

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            with self._cond:
                self.lines.append(line)
                self._cond.notify_all()

    def _find(self, pattern: str) -> str | None:
        for line in self.lines:
            if m := re.search(pattern, line):
                return m.group(1)
        return None

    def scrape(self) -> dict[str, float]:
        return parse_metrics(self.scrape_text())

    def scrape_text(self) -> str:
        assert self.metrics_url is not None
        with urllib.request.urlopen(self.metrics_url, timeout=10) as reply:
            return reply.read().decode()

    def stop(self) -> float:
        """SIGTERM; returns seconds until exit (fails past 20 s)."""
        start = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        assert self.proc.wait(timeout=20) == 0, "".join(self.lines)
        return time.monotonic() - start

    def log(self) -> str:
        with self._cond:
            return "".join(self.lines)


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text format -> {'name{a="x",b="y"}': value} with labels sorted by name."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = re.fullmatch(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})? (\S+)( \d+)?", line)
        assert m, f"not a sample line: {line!r}"
        labels = sorted(re.findall(r'([a-zA-Z_]+)="((?:[^"\\]|\\.)*)"', m.group(3) or ""))
        key = m.group(1) + ("{" + ",".join(f'{k}="{v}"' for k, v in labels) + "}" if labels else "")
        out[key] = float(m.group(4))
    return out


def metric(samples: dict[str, float], name: str, **labels: str) -> float:
    key = name
    if labels:
        key += "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"
    assert key in samples, f"{key} not scraped; have {[k for k in samples if k.startswith(name)]}"
    return samples[key]


def run_traffic(target: str, seed: int, *args: str) -> tuple[list[dict], dict]:
    out = subprocess.run(
        [TRAFFIC, f"--target={target}", f"--seed={seed}", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    records = [json.loads(line) for line in out.splitlines()]
    return [r for r in records if "summary" not in r], records[-1]


@contextlib.contextmanager
def refused_port() -> Iterator[int]:
    """A loopback port where connections are refused for as long as the block runs: bound by
    this socket (so no other process can take it meanwhile, as it could a port found free and
    released) and never listening."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield s.getsockname()[1]


@pytest.mark.parametrize(
    ("protocol", "transport"),
    [
        ("grpc", "unary"),
        ("http/protobuf", "unary"),
        ("grpc", "stream"),
        ("http/protobuf", "stream"),
    ],
)
def test_exported_spans_continue_the_clients_trace_with_step_attributes(
    tmp_path: Path, receiver: OtlpReceiver, seed: int, protocol: str, transport: str
) -> None:
    rng = random.Random(seed)
    trace_id = rng.randbytes(16)
    client_span = rng.randbytes(8)
    port = receiver.grpc_port if protocol == "grpc" else receiver.http_port
    epsd = Epsd(
        tmp_path,
        {
            "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}",
            "OTEL_EXPORTER_OTLP_PROTOCOL": protocol,
            "OTEL_BSP_SCHEDULE_DELAY": "50",
            "OTEL_SERVICE_NAME": "epsd-test",
            "OTEL_RESOURCE_ATTRIBUTES": "deployment.environment=ci,k8s.pod.name=pod%2C1",
            "OTEL_EXPORTER_OTLP_HEADERS": "x-tenant=eps%20ci",
        },
        ["--eps-top-pages=8"],  # a budget that skips groups of the traffic's contexts
    )
    steps = 6
    extra = ["--stream"] if transport == "stream" else []
    sent, summary = run_traffic(
        epsd.target,
        seed,
        f"--steps={steps}",
        f"--traceparent=00-{trace_id.hex()}-{client_span.hex()}-01",
        *extra,
    )
    assert summary["selected"] == steps
    spans = receiver.wait_for_spans(2 * steps, timeout_s=30)
    epsd.stop()

    servers = {attributes(s.span)["eps.step"]: s for s in spans if s.span.name == SERVER_SPAN}
    prepass = {s.span.parent_span_id: s for s in spans if s.span.name == "eps.prepass"}
    assert len(spans) == 2 * steps, [s.span.name for s in spans]
    assert sorted(servers) == [r["step"] for r in sent]
    assert len({s.span.span_id for s in spans}) == len(spans), "span ids repeat"
    for record in sent:
        received: ReceivedSpan = servers[record["step"]]
        span = received.span
        assert received.export.transport == ("grpc" if protocol == "grpc" else "http")
        assert received.export.headers.get("x-tenant") == "eps ci"
        assert received.resource["service.name"] == "epsd-test"
        assert received.resource["deployment.environment"] == "ci"
        assert received.resource["k8s.pod.name"] == "pod,1"
        assert received.scope == "epsd"
        # The engine's trace continues: its span is the parent, marked remote.
        assert span.trace_id == trace_id
        assert span.parent_span_id == client_span
        assert span.kind == trace_pb2.Span.SPAN_KIND_SERVER
        assert span.flags & 0x3FF == 0x301
        assert len(span.span_id) == 8 and span.span_id != bytes(8)
        # Same host, same clock: the server span lies inside the client's call.
        assert record["start_ns"] <= span.start_time_unix_nano < span.end_time_unix_nano
        assert span.end_time_unix_nano <= record["end_ns"]
        a = attributes(span)
        assert a["rpc.system"] == "grpc"
        assert a["rpc.method"] == ("StreamSelectPages" if transport == "stream" else "SelectPages")
        assert a["rpc.grpc.status_code"] == 0
        # Traces show the session id's public part; its random part is a capability.
        assert a["eps.session_id"] == summary["session"].rsplit("-", 1)[0]
        assert a["eps.batch_size"] == record["batch"]
        assert a["eps.backend"] == "cpu"
        assert a["eps.reply_mode"] == "sync"
        for key in (
            "groups_total",
            "groups_visited",
            "pages_total",
            "pages_visited",
            "bytes_kv_dense",
            "bytes_kv_read_est",
            "bytes_summary_read",
        ):
            assert a[f"eps.{key}"] == record[key], key
        assert a["eps.prepass_us"] == pytest.approx(record["prepass_us"])
        assert record["groups_total"] > record["groups_visited"] > 0
        # The pre-pass child: the backend's own timing, inside the server span.
        child = prepass[span.span_id].span
        assert child.trace_id == trace_id
        assert child.kind == trace_pb2.Span.SPAN_KIND_INTERNAL
        assert span.start_time_unix_nano <= child.start_time_unix_nano
        assert child.end_time_unix_nano <= span.end_time_unix_nano
        duration_ns = child.end_time_unix_nano - child.start_time_unix_nano
        assert abs(duration_ns - record["prepass_us"] * 1000) <= 1000
        assert attributes(child)["eps.timing"] == "cpu_wall"


def test_steps_without_traceparent_start_their_own_traces(
    tmp_path: Path, receiver: OtlpReceiver, seed: int
) -> None:
    epsd = Epsd(
        tmp_path,
        {
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": f"http://127.0.0.1:{receiver.grpc_port}",
            "OTEL_BSP_SCHEDULE_DELAY": "50",
        },
        [],
    )
    run_traffic(epsd.target, seed, "--steps=3")
    spans = receiver.wait_for_spans(6, timeout_s=30)
    epsd.stop()
    servers = [s.span for s in spans if s.span.name == SERVER_SPAN]
    assert len(servers) == 3
    assert all(s.parent_span_id == b"" for s in servers)
    assert all(s.flags & 0x3FF == 0x101 for s in servers)  # local root, sampled
    assert len({s.trace_id for s in servers}) == 3
    assert spans[0].resource["service.name"] == "epsd"


def test_metrics_and_step_log_count_exactly_the_traffic_sent(tmp_path: Path, seed: int) -> None:
    step_log = tmp_path / "steps.jsonl"
    epsd = Epsd(tmp_path, {}, [f"--step-log={step_log}"])
    requests = 9
    sent, summary = run_traffic(epsd.target, seed, f"--steps={requests}", "--stale-after=4")
    ok = [r for r in sent if r["ok"]]
    assert len(ok) == requests - 1 and summary["fallback_error"] == 1
    m = epsd.scrape()

    def rpc(name: str, method: str, **labels: str) -> float:
        return metric(
            m,
            name,
            grpc_method=method,
            grpc_service="eps.v1.PageSelector",
            grpc_type="unary",
            **labels,
        )

    assert rpc("grpc_server_started_total", "SelectPages") == requests
    assert rpc("grpc_server_handled_total", "SelectPages", grpc_code="OK") == requests - 1
    assert rpc("grpc_server_handled_total", "SelectPages", grpc_code="FailedPrecondition") == 1
    assert rpc("grpc_server_handling_seconds_count", "SelectPages") == requests
    assert rpc("grpc_server_handling_seconds_bucket", "SelectPages", le="+Inf") == requests
    assert rpc("grpc_server_started_total", "Attach") == 1
    assert rpc("grpc_server_handled_total", "Attach", grpc_code="OK") == 1
    buckets = sorted(
        (float(re.search(r'le="([^"]+)"', k).group(1)), v)
        for k, v in m.items()
        if k.startswith("grpc_server_handling_seconds_bucket") and '"SelectPages"' in k
    )
    assert buckets[0][0] <= 5e-6, "buckets must start at a few microseconds"
    assert [v for _, v in buckets] == sorted(v for _, v in buckets)

    def total(key: str) -> int:
        return sum(r[key] for r in ok)

    assert metric(m, "eps_steps_total", backend="cpu") == len(ok)
    assert metric(m, "eps_steps_total", backend="cuda") == 0
    assert metric(m, "eps_groups_total") == total("groups_total")
    assert metric(m, "eps_groups_visited_total") == total("groups_visited")
    assert metric(m, "eps_groups_skipped_total") == total("groups_total") - total("groups_visited")
    assert metric(m, "eps_pages_total") == total("pages_total")
    assert metric(m, "eps_pages_visited_total") == total("pages_visited")
    assert metric(m, "eps_kv_bytes_dense_total") == total("bytes_kv_dense")
    assert metric(m, "eps_kv_bytes_read_estimated_total") == total("bytes_kv_read_est")
    assert metric(m, "eps_kv_bytes_saved_estimated_total") == (
        total("bytes_kv_dense") - total("bytes_kv_read_est")
    )
    assert metric(m, "eps_summaries_bytes_read_total") == total("bytes_summary_read")
    assert metric(m, "eps_prepass_seconds_count", backend="cpu") == len(ok)
    assert metric(m, "eps_prepass_seconds_sum", backend="cpu") == pytest.approx(
        total("prepass_us") * 1e-6, rel=1e-9
    )
    assert metric(m, "eps_client_fallbacks_total", reason="error") == 1
    assert metric(m, "eps_client_fallbacks_total", reason="deadline") == 0
    assert metric(m, "eps_validation_failures_total", reason="failed_precondition") == 1
    assert metric(m, "eps_validation_failures_total", reason="invalid_argument") == 0
    assert metric(m, "eps_sessions") == 1
    assert metric(m, "eps_sessions_attached_total") == 1
    assert metric(m, "eps_session_memory_bytes") > 0  # the attached session's buffers
    assert epsd.stop() < 10

    lines = [json.loads(line) for line in step_log.read_text().splitlines()]
    assert len(lines) == requests
    by_step = {(r["step"], r["ok"]): r for r in sent}
    for line in lines:
        assert line["session"] == summary["session"].rsplit("-", 1)[0]
        assert line["backend"] == "cpu" and line["transport"] == "unary"
        record = by_step[(line["step"], line["status"] == "OK")]
        if line["status"] != "OK":
            assert line["status"] == "FAILED_PRECONDITION" and "not after" in line["error"]
            continue
        for key in (
            "groups_total",
            "groups_visited",
            "pages_total",
            "pages_visited",
            "bytes_kv_dense",
            "bytes_kv_read_est",
            "bytes_summary_read",
        ):
            assert line[key] == record[key], key
        assert line["pages_skipped"] == record["pages_total"] - record["pages_visited"]
        assert line["prepass_us"] == pytest.approx(record["prepass_us"], abs=1e-3)
        assert line["server_us"] >= 0


def wait_for_metric(epsd: Epsd, name: str, want: float, **labels: str) -> float:
    """Scrapes until the series reaches `want` (counters move after the reply the client saw)."""
    deadline = time.monotonic() + 20
    while True:
        value = metric(epsd.scrape(), name, **labels)
        if value >= want or time.monotonic() > deadline:
            return value


def test_a_scrape_after_traffic_passes_promtool_check_metrics(tmp_path: Path, seed: int) -> None:
    promtool = shutil.which("promtool")
    assert promtool, "promtool not found: scripts/setup.sh installs Debian's prometheus package"
    epsd = Epsd(tmp_path, {}, [])
    run_traffic(epsd.target, seed, "--steps=3")
    text = epsd.scrape_text()
    epsd.stop()
    assert "eps_steps_total" in text
    check = subprocess.run(
        [promtool, "check", "metrics"],
        input=text,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,  # the assert below prints promtool's findings
    )
    assert check.returncode == 0, check.stdout + check.stderr
    # docs/observability.md documents every family the scrape exposes, and the reverse.
    doc = (Path(__file__).resolve().parents[2] / "docs" / "observability.md").read_text()
    tabled = set(re.findall(r"^\| `([a-z_:]+)[`{]", doc, re.MULTILINE))  # the metrics tables
    named = set(re.findall(r"`([a-z_:]+)[`{]", doc))  # the exposer's own are in a sentence
    exposed = set(re.findall(r"^# TYPE ([a-zA-Z_:][a-zA-Z0-9_:]*) ", text, re.MULTILINE))
    assert len(exposed) > 10, text
    assert exposed <= named, f"undocumented: {sorted(exposed - named)}"
    assert tabled <= exposed, f"documented, not exposed: {sorted(tabled - exposed)}"


def test_stream_metrics_count_every_message_and_the_stream_once(tmp_path: Path, seed: int) -> None:
    epsd = Epsd(tmp_path, {}, [])
    steps = 7
    sent, summary = run_traffic(epsd.target, seed, f"--steps={steps}", "--stream")
    assert summary["selected"] == steps
    stream = {
        "grpc_method": "StreamSelectPages",
        "grpc_service": "eps.v1.PageSelector",
        "grpc_type": "bidi_stream",
    }
    assert wait_for_metric(epsd, "grpc_server_msg_received_total", steps, **stream) == steps
    assert wait_for_metric(epsd, "grpc_server_msg_sent_total", steps, **stream) == steps
    # The client closed the stream when it exited: one stream, finished OK.
    assert wait_for_metric(epsd, "grpc_server_handled_total", 1, grpc_code="OK", **stream) == 1
    m = epsd.scrape()
    assert metric(m, "grpc_server_started_total", **stream) == 1
    assert metric(m, "eps_steps_total", backend="cpu") == steps
    assert metric(m, "eps_groups_total") == sum(r["groups_total"] for r in sent)
    epsd.stop()


def test_a_dead_collector_fails_no_step_and_does_not_hold_up_exit(
    tmp_path: Path, seed: int
) -> None:
    with refused_port() as dead:  # nothing listens there: connections are refused
        epsd = Epsd(
            tmp_path,
            {
                "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{dead}",
                "OTEL_BSP_SCHEDULE_DELAY": "10",
                "OTEL_BSP_MAX_QUEUE_SIZE": "8",
                "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "4",
            },
            [],
        )
        _, summary = run_traffic(epsd.target, seed, "--steps=40")
        assert summary["selected"] == 40 and summary["fallbacks"] == 0
        m = epsd.scrape()
        assert metric(m, "eps_trace_spans_exported_total") == 0
        assert epsd.stop() < 6  # the 2 s shutdown budget, and process teardown
        assert "dropped" in epsd.log()


def test_a_silent_collector_does_not_hold_up_exit_past_its_timeouts(
    tmp_path: Path, seed: int
) -> None:
    with socket.socket() as silent:  # accepts connections (backlog) and never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(64)
        epsd = Epsd(
            tmp_path,
            {
                "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{silent.getsockname()[1]}",
                "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
                "OTEL_EXPORTER_OTLP_TIMEOUT": "1000",
                "OTEL_BSP_SCHEDULE_DELAY": "10",
            },
            [],
        )
        _, summary = run_traffic(epsd.target, seed, "--steps=20")
        assert summary["selected"] == 20 and summary["fallbacks"] == 0
        # The 2 s shutdown budget (an attempt still in flight is cancelled then), plus teardown.
        assert epsd.stop() < 8


def test_bad_otel_settings_stop_epsd_with_a_clear_error(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update({"OTEL_EXPORTER_OTLP_PROTOCOL": "http/json", "OTEL_EXPORTER_OTLP_ENDPOINT": "x:1"})
    run = subprocess.run(
        [EPSD, f"--listen=unix://{tmp_path}/e.sock", "--metrics-listen=off"],
        capture_output=True,
        text=True,
        env=env,
        timeout=30,
        check=False,
    )
    assert run.returncode == 1
    assert "OTEL_EXPORTER_OTLP_PROTOCOL=http/json" in run.stderr


def test_a_busy_metrics_port_stops_epsd_with_a_clear_error(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        run = subprocess.run(
            [EPSD, f"--listen=unix://{tmp_path}/e.sock", f"--metrics-listen=127.0.0.1:{port}"],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
    assert run.returncode == 1
    assert f"--metrics-listen=127.0.0.1:{port}" in run.stderr


def test_a_receiver_that_rejects_the_batch_gets_no_retries(
    tmp_path: Path, receiver: OtlpReceiver, seed: int
) -> None:
    # The test receiver answers 404 off /v1/traces: a permanent failure, dropped at once.
    epsd = Epsd(
        tmp_path,
        {
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": f"http://127.0.0.1:{receiver.http_port}/wrong",
            "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
            "OTEL_BSP_SCHEDULE_DELAY": "10",
        },
        [],
    )
    _, summary = run_traffic(epsd.target, seed, "--steps=3")
    assert summary["selected"] == 3
    # Retrying would hold the spans for OTEL_BSP_EXPORT_TIMEOUT (30 s); dropping is immediate.
    assert wait_for_metric(epsd, "eps_trace_spans_dropped_total", 6) == 6
    m = epsd.scrape()
    assert metric(m, "eps_trace_spans_exported_total") == 0
    assert 1 <= metric(m, "eps_trace_export_failures_total") <= 6  # one per batch
    epsd.stop()
    assert "404" in epsd.log()
