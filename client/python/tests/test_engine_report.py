"""The reference engine's bookkeeping (examples/engine_report.py, numpy only): the fallback
accounting finds every dense step's reason and flags the ones without, the limit and the
summaries are what their definitions say; and the state each run starts from
(examples/engine_snapshot.py), over numpy arrays with torch's in-place methods; the kill
run's kill -9 reaches epsd under a wrapper (examples/reference_engine.py)."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from engine_report import (  # noqa: E402
    account_fallbacks,
    attention_limit_ms,
    delta_ppl_percent,
    gating,
    markdown,
    ran_gated,
    summarize,
)
from engine_snapshot import CHANGED_BY_DECODE, BufferSnapshot  # noqa: E402
from reference_engine import build_parser, kill_epsd, process_tree  # noqa: E402

from eps_client import StepStats  # noqa: E402


def test_every_dense_step_of_a_kill_run_has_a_counted_reason():
    first = 100
    # steps 100..109: accepted 100-104 (103, 104 released after epsd died), fallbacks 105-109
    marks = [False] * 3 + [True] * 7
    acc = account_fallbacks(fallback_steps=[105, 106, 107, 108, 109],
                            accepted_steps=[100, 101, 102, 103, 104], first_step=first,
                            dense_marks=marks, watchdog_releases=1, device_errors=0)
    assert acc["ok"] and acc["dense_steps"] == 7 and acc["client_fallbacks"] == 5
    assert acc["accepted_then_released"] == 2
    assert acc["released_by_a_later_fallback_or_failed"] == 1


def test_a_dense_step_without_a_reason_or_a_fallback_that_was_not_dense_fails():
    acc = account_fallbacks([3], [1, 2], 1, [False, False, True, True], 0, 0)
    assert not acc["ok"] and acc["unexplained_dense_steps"] == [4]
    acc = account_fallbacks([2], [1], 1, [False, False], 0, 0)
    assert not acc["ok"] and acc["fallbacks_not_dense"] == [2]
    # more watchdog releases than accepted steps that ended dense cannot be
    acc = account_fallbacks([], [1, 2], 1, [False, True], 2, 0)
    assert not acc["ok"]


def test_limit_and_summaries():
    assert attention_limit_ms(20.0, 12.0, 0.25) == pytest.approx(11.0)
    assert delta_ppl_percent(0.0) == 0.0
    assert delta_ppl_percent(0.01) == pytest.approx(1.005, rel=1e-3)
    run = SimpleNamespace(step_ms=[9.0, 1.0, 2.0, 3.0], graph_ms=[1.0] * 4,
                          wait_selection_ms=[0.1] * 4, wait_summaries_ms=[0.2] * 4,
                          host_ms=[0.5] * 4, first_step=10, accepted_steps=[11, 12],
                          rtt_us=[300.0, 500.0],
                          stats=[StepStats(step=11, pages_visited=25, pages_total=100,
                                           prepass_us=50.0),
                                 StepStats(step=12, pages_visited=0, pages_total=100,
                                           error="boom")])
    s = summarize(run, warmup=1)
    assert s["step_ms_p50"] == 2.0 and s["pages_read_fraction"] == 0.25
    assert s["rpc_us_p50"] == 400.0 and s["prepass_us_p50"] == 50.0


def test_a_run_that_reuses_its_selections_reports_the_mean_step_and_wait():
    # reuse 4: one step in four waits for its lists (3 ms), the others do not (1 ms); the
    # p50 is a step that did not wait, the mean is what a step costs on average
    run = SimpleNamespace(step_ms=[9.0] + [3.0, 1.0, 1.0, 1.0] * 2, graph_ms=[1.0] * 9,
                          wait_selection_ms=[5.0] + [2.0, 0.0, 0.0, 0.0] * 2,
                          wait_summaries_ms=[0.2] * 9, host_ms=[0.5] * 9, first_step=10,
                          accepted_steps=[10, 11, 15], rtt_us=[1.0, 2.0, 3.0],
                          stats=[StepStats(step=s, pages_visited=10, pages_total=100)
                                 for s in (10, 11, 15)])
    s = summarize(run, warmup=1)
    assert s["step_ms_p50"] == 1.0 and s["step_ms_mean"] == 1.5
    assert s["wait_selection_ms_mean"] == 0.5 and s["pages_read_fraction"] == 0.1


def test_selections_of_warm_up_steps_and_of_steps_outside_the_run_are_not_summarized():
    # selection steps 20..23 are decode steps 0..3; 19 (calibration) and 26 (the sync step
    # after the run) are not the run's; 20 and 21 are warm-up
    steps = [19, 20, 21, 22, 23, 26]
    run = SimpleNamespace(step_ms=[1.0] * 4, graph_ms=[1.0] * 4, wait_selection_ms=[0.1] * 4,
                          wait_summaries_ms=[0.2] * 4, host_ms=[0.5] * 4, first_step=20,
                          accepted_steps=[20, 21, 22, 23],
                          rtt_us=[900.0, 800.0, 100.0, 300.0],
                          stats=[StepStats(step=s, pages_visited=90 if s not in (22, 23)
                                           else 10 * (s - 21), pages_total=100,
                                           prepass_us=1000.0 if s not in (22, 23) else 40.0)
                                 for s in steps])
    s = summarize(run, warmup=2)
    assert s["pages_read_fraction"] == pytest.approx(0.15)  # (10 + 20) / 200
    assert s["prepass_us_p50"] == 40.0 and s["rpc_us_p50"] == 200.0
    assert summarize(run, warmup=0)["pages_read_fraction"] == pytest.approx(0.525)  # 20..23


def test_steps_that_ran_dense_or_failed_on_the_device_are_counted_against_the_run():
    # selection steps 30..33: 31 released by the watchdog (dense, no client fallback), 32
    # failed on the device; 29 (calibration) failed too but is not the run's
    run = SimpleNamespace(first_step=30, dense_marks=[False, True, True, False],
                          fallback_steps=[], watchdog_releases=1, refused_lists=0,
                          stats=[StepStats(step=29, error="x"), StepStats(step=30),
                                 StepStats(step=32, error="device")])
    counts = gating(run)
    assert counts == {"dense_steps": 2, "fallbacks": 0, "watchdog_releases": 1,
                      "device_errors": 1, "refused_lists": 0}
    assert not ran_gated(counts)
    clean = SimpleNamespace(first_step=30, dense_marks=[False] * 4, fallback_steps=[],
                            watchdog_releases=0, refused_lists=0,
                            stats=[StepStats(step=s) for s in range(30, 34)])
    assert ran_gated(gating(clean))
    # a release alone (the step's lists came late and no longer read dense) fails the run
    assert not ran_gated(gating(SimpleNamespace(**{**vars(clean), "watchdog_releases": 1})))
    # a list the views refused (reused past the window, never written) read the engine's row
    assert not ran_gated(gating(SimpleNamespace(**{**vars(clean), "refused_lists": 1})))


class HostTensor(np.ndarray):
    """A numpy array with the torch methods BufferSnapshot calls."""

    def clone(self) -> HostTensor:
        return self.copy()

    def copy_(self, other: np.ndarray) -> HostTensor:
        self[...] = other
        return self

    def fill_(self, value: float) -> HostTensor:
        self.fill(value)
        return self


def _buffers(coarse: bool, feedback: bool) -> SimpleNamespace:
    rng = np.random.default_rng(0)

    def t(*shape: int) -> HostTensor:
        return rng.standard_normal(shape).view(HostTensor)

    return SimpleNamespace(summary_pool=t(6, 4), coarse_pool=t(3, 4) if coarse else None,
                           queries=t(2, 3, 8), feedback=t(2, 6) if feedback else None,
                           visit_count=t(2, 3))


@pytest.mark.parametrize("coarse,feedback", [(False, False), (True, True)])
def test_a_restore_undoes_everything_a_decode_run_writes_for_the_next_run(coarse, feedback):
    buf = _buffers(coarse, feedback)
    before = {n: getattr(buf, n).copy() for n in CHANGED_BY_DECODE if getattr(buf, n) is not None}
    saved = BufferSnapshot.take(buf)
    assert set(saved.saved) == set(before)  # the coarse pool too, when there is one
    for name in before:  # a decode run: appends to the pools, its queries
        getattr(buf, name).fill_(7.0)
    if feedback:
        buf.feedback.fill_(1.0)
    lists = buf.visit_count.copy()
    saved.restore(buf)
    for name, value in before.items():
        np.testing.assert_array_equal(getattr(buf, name), value, err_msg=name)
    if feedback:  # no entries from the earlier run
        assert np.isnan(buf.feedback).all()
    np.testing.assert_array_equal(buf.visit_count, lists)  # epsd's, not the engine's


def test_a_table_row_of_another_width_than_its_header_is_refused():
    # the speed table's dense row was one cell short: every later column under the wrong name
    assert markdown(["a", "b"], [[1, 2.5]]).splitlines()[2] == "| 1 | 2.5 |"
    with pytest.raises(ValueError, match="a row of 1 cells under 2 headings"):
        markdown(["a", "b"], [[1]])


def test_reuse_is_a_comma_list_and_a_bad_entry_is_a_usage_error(capsys):
    mode = ["--mode", "speed"]
    assert build_parser().parse_args([*mode, "--reuse", "1,4"]).reuse == [1, 4]
    assert build_parser().parse_args(mode).reuse == [1]
    for value in ("0", "2,x", "", "1010"):
        with pytest.raises(SystemExit) as e:
            build_parser().parse_args([*mode, "--reuse", value])
        assert e.value.code == 2 and "--reuse" in capsys.readouterr().err


def test_the_process_tree_lists_the_root_then_its_descendants_and_nothing_else():
    parents = {1: 0, 10: 1, 11: 10, 12: 10, 13: 11, 20: 1, 21: 20}
    assert process_tree(10, parents) == [10, 11, 12, 13]
    assert process_tree(13, parents) == [13]


def test_kill_reaches_the_child_of_a_wrapper_in_the_pid_file(tmp_path):
    # the wrapper stays the child's parent, as ncu does with epsd under EPS_EPSD_PREFIX
    wrapper = subprocess.Popen(["bash", "-c", "sleep 300 & echo $!; wait"],
                               stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert wrapper.stdout is not None
        child = int(wrapper.stdout.readline())
        child_exit = os.pidfd_open(child)  # readable once the child has exited
        pid_file = tmp_path / "epsd.pid"
        pid_file.write_text(str(wrapper.pid))
        kill_epsd(SimpleNamespace(epsd_pid_file=str(pid_file)))
        # killed, or (the child killed first) exited when its wait ended: gone either way
        wrapper.wait(timeout=10)
        assert select.select([child_exit], [], [], 10)[0], f"child {child} still runs"
        os.close(child_exit)
    finally:
        try:
            os.killpg(wrapper.pid, signal.SIGKILL)  # whatever a failure left
        except ProcessLookupError:
            pass
        wrapper.wait()
