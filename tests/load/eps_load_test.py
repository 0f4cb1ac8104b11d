"""End-to-end tests of the eps-load binary against a real epsd (CPU backend); its ends by
signal are in eps_load_signals_test.py, the shared set-up in conftest.py."""

from __future__ import annotations

import json
import os
import signal
import time
import uuid
from pathlib import Path

from conftest import _run

CALL_KEYS = ("p50_us", "p90_us", "p99_us", "p999_us", "max_us", "count", "errors", "rps")


def _check_call_block(block: dict[str, object]) -> None:
    for key in CALL_KEYS:
        assert key in block, f"missing {key} in {block}"
    p50, p90, p99, p999, mx = (float(block[k]) for k in CALL_KEYS[:5])  # type: ignore[arg-type]
    assert 0 < p50 <= p90 <= p99 <= p999 <= mx


def test_a_short_run_reports_both_calls_without_errors(
    epsd: tuple[str, int], tmp_path: Path
) -> None:
    target, pid = epsd
    out = tmp_path / "out.json"
    result = _run(
        [
            f"--target={target}",
            "--preset=smollm2-135m",
            "--batch=2",
            "--context=uniform:1k-4k",
            "--duration=1s",
            "--warmup=200ms",
            "--sessions=2",
            f"--json={out}",
        ]
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SelectPages" in result.stdout and "Select/Ping" in result.stdout
    report = json.loads(out.read_text())
    for name in ("select", "ping"):
        _check_call_block(report[name])
        assert report[name]["count"] > 0
        assert report[name]["errors"] == 0
        assert report[name]["rps"] > 0
    assert report["ratio"]["p50"] > 0
    assert report["config"]["preset"] == "smollm2-135m"
    assert report["config"]["sessions"] == 2
    assert report["config"]["feedback_share"] == 0 and "feedback" not in report
    # The records' layout is part of the run's configuration (--quest8 / --quest8-only).
    assert report["config"]["features"] == {
        "key_sum": False,
        "principal": False,
        "quest": True,
        "quest8": False,
    }
    assert report["config"]["floor_server"] in ("process", "in-process")
    assert report["server"]["pages_total"] > 0
    assert report["epsd"]["pid"] == pid, report["epsd"]
    assert report["epsd"]["samples"][0]["rss_kb"] > 0
    assert report["epsd"]["samples"][0]["open_fds"] > 0
    floor = report["rpc_floor"]
    assert floor["server"] == "child process" and floor["errors"] == 0
    for name in ("floor_callback", "floor_sync", "ping_callback", "ping_sync"):
        assert floor[name]["count"] == 1000 and floor[name]["p50_us"] > 0, floor
    assert floor["ping_over_floor_p50"] > 0
    assert floor["rounds"] == 1000 and floor["aborted"] is None, floor
    # The run's SelectPages over the run's own Ping, not over the floor phase's Ping.
    assert floor["select_over_ping_p50"] == report["ratio"]["p50"], (floor, report["ratio"])
    assert "SelectPages / Ping (both of the run) p50" in result.stdout
    assert "Ping / floor (callback, both of the floor phase) p50" in result.stdout


def test_a_coarse_level_run_attaches_with_it_and_has_no_errors(
    epsd: tuple[str, int], tmp_path: Path
) -> None:
    target, _ = epsd
    out = tmp_path / "out.json"
    common = [f"--target={target}", "--preset=smollm2-135m", "--batch=2", "--context=8k",
              "--duration=500ms", "--warmup=100ms", "--floor-calls=0", "--eps-group-blocks=2"]
    result = _run([*common, "--coarse-blocks=16", "--coarse-candidates=1.5", f"--json={out}"])
    assert result.returncode == 0, result.stdout + result.stderr
    assert "coarse level: 16 blocks per coarse group, coarse_candidates 1.5" in result.stdout
    report = json.loads(out.read_text())
    assert report["config"]["coarse_blocks"] == 16
    assert report["config"]["coarse_candidates"] == 1.5
    assert report["select"]["count"] > 0 and report["select"]["errors"] == 0
    assert 0 < report["server"]["pages_visited"] < report["server"]["pages_total"]


def test_bad_coarse_flags_exit_2_and_name_the_flag() -> None:
    for args, flag in ((["--eps-group-blocks=2", "--coarse-blocks=3"], "--coarse-blocks=3"),
                       (["--coarse-candidates=2"], "--coarse-candidates=2"),
                       (["--coarse-blocks=16", "--coarse-candidates=0.5"],
                        "--coarse-candidates=0.5")):
        result = _run(["--preset=smollm2-135m", *args], timeout=10)
        assert result.returncode == 2, result.stdout + result.stderr
        assert flag in result.stderr, result.stderr


def test_a_feedback_run_writes_entries_that_epsd_consumes(
    epsd: tuple[str, int], tmp_path: Path
) -> None:
    target, _ = epsd
    out = tmp_path / "out.json"
    result = _run(
        [
            f"--target={target}",
            "--preset=smollm2-135m",
            "--batch=2",
            "--context=uniform:2k-8k",
            "--duration=500ms",
            "--warmup=100ms",
            "--floor-calls=0",
            "--feedback-share=0.25",
            f"--json={out}",
        ]
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "selection feedback: share 0.25" in result.stdout
    report = json.loads(out.read_text())
    assert report["config"]["feedback_share"] == 0.25
    assert report["select"]["count"] > 0 and report["select"]["errors"] == 0
    # Each measured step read one fed entry back: finite before the call (eps-load's write
    # reached the shared buffer), NaN after it (epsd got the buffer and consumed the entry).
    feedback = report["feedback"]
    assert feedback["probes"] > 0, feedback
    assert feedback["written"] == feedback["probes"], feedback
    assert feedback["consumed"] == feedback["probes"], feedback
    assert feedback["write_p50_us"] > 0


def test_a_bad_feedback_share_exits_2_and_says_what_it_wants() -> None:
    for value in ("1.5", "-0.25", "nan"):
        result = _run(["--preset=smollm2-135m", f"--feedback-share={value}"], timeout=10)
        assert result.returncode == 2, result.stdout + result.stderr
        assert f"--feedback-share={value}" in result.stderr, result.stderr
        assert "(0, 1]" in result.stderr, result.stderr


def test_the_rpc_floor_runs_in_process_on_request(epsd: tuple[str, int], tmp_path: Path) -> None:
    target, _ = epsd
    out = tmp_path / "out.json"
    result = _run(
        [
            f"--target={target}",
            "--preset=smollm2-135m",
            "--batch=1",
            "--context=1k",
            "--duration=200ms",
            "--warmup=0",
            "--floor-calls=50",
            "--floor-server=in-process",
            f"--json={out}",
        ]
    )
    assert result.returncode == 0, result.stdout + result.stderr
    floor = json.loads(out.read_text())["rpc_floor"]
    assert floor["server"] == "in-process" and floor["ping_callback"]["count"] == 50


def test_ranks_step_in_lockstep_and_report_each_rank_and_their_spread(
    epsd: tuple[str, int], tmp_path: Path
) -> None:
    target, _ = epsd
    out = tmp_path / "out.json"
    result = _run(
        [
            f"--target={target}",
            "--preset=llama-3-70b-tp4",
            "--layers=2",
            "--ranks=4",
            "--floor-calls=0",
            "--batch=1",
            "--context=2k",
            "--duration=1s",
            "--warmup=100ms",
            f"--json={out}",
        ]
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "spread between ranks at the same step" in result.stdout
    report = json.loads(out.read_text())
    assert report["config"]["ranks"] == 4 and report["config"]["sessions"] == 4
    assert report["config"]["q_heads"] == 16 and report["config"]["kv_heads"] == 2
    assert report["ping"]["count"] == 0
    ranks = report["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1, 2, 3]
    assert all(r["device"] == 0 and r["count"] > 0 and r["p50_us"] > 0 for r in ranks)
    # Lockstep: every rank ran the same steps, and each step's spread is measured.
    assert len({r["count"] for r in ranks}) == 1, ranks
    spread = report["rank_spread"]
    assert spread["steps"] == ranks[0]["count"]
    assert 0 <= spread["p50_us"] <= spread["p99_us"] <= spread["max_us"]


def test_an_open_loop_stream_run_keeps_near_its_rate(epsd: tuple[str, int], tmp_path: Path) -> None:
    target, _ = epsd
    out = tmp_path / "out.json"
    result = _run(
        [
            f"--target={target}",
            "--preset=smollm2-135m",
            "--batch=1",
            "--context=2k",
            "--duration=2s",
            "--warmup=200ms",
            "--rate=poisson:100",
            "--mode=stream",
            f"--json={out}",
        ]
    )
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(out.read_text())
    assert report["select"]["errors"] == 0
    # A Poisson process of 100/s over 2 s: 200 ± 5 standard deviations (sqrt(200) ≈ 14).
    assert 130 <= report["select"]["count"] <= 270, report["select"]
    assert report["config"]["mode"] == "stream"


def test_an_unreachable_target_is_counted_by_status_code_and_ends(tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    target = f"unix:///tmp/eps-load-test-nobody-{uuid.uuid4().hex[:12]}.sock"
    start = time.monotonic()
    result = _run(
        [
            f"--target={target}",
            "--preset=smollm2-135m",
            "--batch=1",
            "--context=1k",
            "--duration=1s",
            "--warmup=0",
            f"--json={out}",
        ],
        timeout=30,
    )
    assert time.monotonic() - start < 20
    assert result.returncode == 3, result.stdout + result.stderr
    report = json.loads(out.read_text())
    assert report["select"]["count"] == 0
    assert report["select"]["errors"] > 0
    assert report["select"]["errors_by_code"].get("UNAVAILABLE", 0) == report["select"]["errors"]
    assert report["ping"]["errors_by_code"].get("UNAVAILABLE", 0) > 0
    fallbacks = report["client_fallbacks"]
    assert fallbacks["not_attached"] + fallbacks["unavailable"] > 0
    assert "UNAVAILABLE" in result.stdout
    # The floor pinged epsd once and stopped there, instead of failing every round.
    floor = report["rpc_floor"]
    assert floor["rounds"] == 0 and "epsd did not answer a Ping" in floor["aborted"], floor
    assert "the RPC floor ended early" in result.stderr
    assert "n/a" in result.stdout and "nanx" not in result.stdout


def test_an_epsd_that_does_not_answer_ends_the_floor_within_a_deadline(
    epsd: tuple[str, int], tmp_path: Path
) -> None:
    # A stopped epsd once cost the floor two deadlines a round: 1100 rounds here, 11 minutes.
    target, pid = epsd
    out = tmp_path / "out.json"
    os.kill(pid, signal.SIGSTOP)
    try:
        start = time.monotonic()
        result = _run(
            [
                f"--target={target}",
                "--preset=smollm2-135m",
                "--batch=1",
                "--context=1k",
                "--duration=300ms",
                "--warmup=0",
                "--deadline=300ms",
                "--floor-calls=1000",
                f"--json={out}",
            ],
            timeout=60,
        )
    finally:
        os.kill(pid, signal.SIGCONT)
    assert time.monotonic() - start < 30
    assert result.returncode == 3, result.stdout + result.stderr
    floor = json.loads(out.read_text())["rpc_floor"]
    assert floor["rounds"] == 0, floor
    assert "epsd did not answer a Ping" in floor["aborted"], floor
    assert "DEADLINE_EXCEEDED" in floor["aborted"], floor


def test_a_window_that_measures_nothing_exits_3(tmp_path: Path) -> None:
    # Once exit 0: a window too short for any call is no successful run.
    out = tmp_path / "out.json"
    target = f"unix:///tmp/eps-load-test-nobody-{uuid.uuid4().hex[:12]}.sock"
    result = _run(
        [f"--target={target}", "--preset=smollm2-135m", "--batch=1", "--context=1k",
         "--duration=1us", "--warmup=0", "--floor-calls=0", f"--json={out}"],
        timeout=30,
    )
    assert result.returncode == 3, result.stdout + result.stderr
    select = json.loads(out.read_text())["select"]
    if select["errors"] == 0:  # a failed call may land in the 1 µs window: exit 3 either way
        assert select["count"] == 0
        assert "no SelectPages was measured" in result.stdout


def test_a_target_that_is_not_an_address_exits_2_before_the_run() -> None:
    for target in ("localhost", "garbage", "h:99999"):
        start = time.monotonic()
        result = _run([f"--target={target}", "--duration=10m"], timeout=30)
        assert result.returncode == 2, result.stdout + result.stderr
        assert f"--target={target}" in result.stderr
        assert time.monotonic() - start < 10


def test_calls_past_the_deadline_count_as_deadline_exceeded(
    epsd: tuple[str, int], tmp_path: Path
) -> None:
    target, _ = epsd
    out = tmp_path / "out.json"
    result = _run(
        [
            f"--target={target}",
            "--preset=smollm2-135m",
            "--batch=1",
            "--context=2k",
            "--duration=1s",
            "--warmup=0",
            "--deadline=1us",
            f"--json={out}",
        ]
    )
    assert result.returncode == 3, result.stdout + result.stderr
    report = json.loads(out.read_text())
    assert report["select"]["count"] == 0
    assert report["select"]["errors"] > 0
    assert report["select"]["errors_by_code"] == {"DEADLINE_EXCEEDED": report["select"]["errors"]}
    assert report["client_fallbacks"]["deadline"] >= report["select"]["errors"]
    assert report["select"]["p50_us"] is None


def test_an_open_loop_far_behind_its_schedule_counts_the_unsent_calls_and_ends(
    epsd: tuple[str, int], tmp_path: Path
) -> None:
    target, _ = epsd
    out = tmp_path / "out.json"
    start = time.monotonic()
    # 1000 steps of ~20-100 ms each in 1 s: no machine keeps up, so the session
    # stops 5 s after the window and counts what it never sent.
    result = _run(
        [
            f"--target={target}",
            "--preset=smollm2-135m",
            "--batch=8",
            "--context=32k",
            "--duration=1s",
            "--warmup=0",
            "--rate=1000",
            f"--json={out}",
        ]
    )
    assert time.monotonic() - start < 40
    assert result.returncode == 3, result.stdout + result.stderr
    report = json.loads(out.read_text())
    select = report["select"]
    assert select["unsent"] > 0
    assert select["count"] + select["errors"] + select["unsent"] == 1000, select
    assert "unsent" in result.stdout


def test_a_rate_too_small_for_a_second_call_sends_one_and_ends(
    epsd: tuple[str, int], tmp_path: Path
) -> None:
    # 1e-12 calls/s: gaps of 3e12 s, past what the clock holds in nanoseconds. The
    # conversion once overflowed, and the sessions spun for good, deaf to SIGTERM.
    target, _ = epsd
    out = tmp_path / "out.json"
    for rate in ("1e-12", "poisson:1e-12"):
        result = _run(
            [
                f"--target={target}",
                "--preset=smollm2-135m",
                "--batch=1",
                "--context=1k",
                "--duration=1s",
                "--warmup=0",
                "--floor-calls=0",
                "--sessions=3",
                f"--rate={rate}",
                f"--json={out}",
            ],
            timeout=30,
        )
        select = json.loads(out.read_text())["select"]
        assert select["errors"] == 0 and select["unsent"] == 0, (rate, select)
        if rate == "1e-12":
            # Session 0's first call is due at the start; the others' a lifetime later.
            assert result.returncode == 0, result.stdout + result.stderr
            assert select["count"] == 1, select
        else:  # every first call is a lifetime away: nothing measured
            assert result.returncode == 3, result.stdout + result.stderr
            assert select["count"] == 0, select


def test_a_json_path_that_cannot_be_created_exits_2_before_the_run(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-dir" / "out.json"
    result = _run(["--duration=10m", f"--json={missing}"], timeout=30)
    assert result.returncode == 2, result.stdout + result.stderr
    assert f"--json={missing}: cannot create it" in result.stderr


def test_a_json_path_that_is_a_directory_exits_2_before_the_run(tmp_path: Path) -> None:
    # With the report written through a temporary beside it, a directory was found only
    # when the finished run's rename failed (exit 1).
    result = _run(["--duration=10m", f"--json={tmp_path}"], timeout=30)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "it is a directory" in result.stderr
    assert list(tmp_path.iterdir()) == []


def test_a_json_report_through_a_link_is_written_to_its_target(
    epsd: tuple[str, int], tmp_path: Path
) -> None:
    # The temporary's rename replaced the link with a plain file and left its target stale.
    target, _ = epsd
    report = tmp_path / "target.json"
    report.write_text('{"earlier": true}\n')
    link = tmp_path / "link.json"
    link.symlink_to(report)
    result = _run(["--target=" + target, "--preset=smollm2-135m", "--context=1k", "--batch=1",
                   "--duration=500ms", "--warmup=100ms", "--floor-calls=0", f"--json={link}"])
    assert result.returncode == 0, result.stdout + result.stderr
    assert link.is_symlink()
    assert json.loads(report.read_text()).get("earlier") is None  # the run's report
    assert sorted(p.name for p in tmp_path.iterdir()) == ["epsd.log", "link.json", "target.json"]


def test_bad_flags_exit_2_and_name_the_flag() -> None:
    result = _run(["--rate=fast"])
    assert result.returncode == 2
    assert "--rate" in result.stderr


def test_the_cuda_backend_without_a_device_is_a_clear_error() -> None:
    # CI has no GPU: eps-load must say so and exit, never hang or crash.
    result = _run(["--backend=cuda", "--preset=smollm2-135m", "--context=1k", "--batch=1"])
    assert result.returncode == 1
    assert "--backend=cuda" in result.stderr


def test_a_failed_run_leaves_an_earlier_json_report_as_it_was(tmp_path: Path) -> None:
    # Once the report was truncated before the run: a run that failed left it empty.
    out = tmp_path / "out.json"
    out.write_text('{"earlier": true}\n')
    # CI has no GPU: the run cannot be set up (exit 1) after the report's path was checked.
    result = _run(["--backend=cuda", "--preset=smollm2-135m", "--context=1k", "--batch=1",
                   f"--json={out}"])
    assert result.returncode == 1, result.stdout + result.stderr
    assert out.read_text() == '{"earlier": true}\n'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.json"]  # no temporary left
