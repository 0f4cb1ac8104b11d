"""The harness's argument types (eps_eval.args) and the checks that keep a run from starting
on settings that would give silently wrong results."""

from __future__ import annotations

import argparse

import numpy as np
import pytest
from eps_eval import args
from eps_eval.run_gemma import variant_list


def test_counts_and_targets_refuse_what_would_run_nothing_or_wrongly() -> None:
    assert args.positive_int("3") == 3
    for bad in ("0", "-1", "x", "1.5"):
        with pytest.raises(argparse.ArgumentTypeError):
            args.positive_int(bad)
    assert args.int_list("16384,0,32768") == [16384, 32768]  # 0: none
    with pytest.raises(argparse.ArgumentTypeError):
        args.int_list("-128")  # was dropped silently, leaving an empty run
    assert args.unit_interval("0.95") == 0.95
    for bad in ("0", "1.5", "nan", "x"):
        with pytest.raises(argparse.ArgumentTypeError):
            args.unit_interval(bad)


def test_an_unknown_variant_method_is_refused_before_the_model_loads() -> None:
    assert variant_list("questclt:8,quest:1") == (("questclt", 8), ("quest", 1))
    with pytest.raises(argparse.ArgumentTypeError, match="fro"):
        variant_list("fro:1")


def test_a_passage_too_short_for_its_query_positions_is_refused() -> None:
    # The first query position was T - steps - lag: below 0 it wrapped to the passage's end
    # (a future token's query). Checked before the passage is read.
    from types import SimpleNamespace

    from eps_eval.realmodel import RealModel

    fake = SimpleNamespace(cfg=SimpleNamespace(context=8192))
    for T, steps, window, lag in ((40, 3, 40, 4), (64, 64, 1, 1), (-16, 3, 1, 1), (64, 0, 1, 1)):
        with pytest.raises(ValueError, match="must exceed|steps must be"):
            RealModel.passage_trace(fake, T, steps, window, lag)  # type: ignore[arg-type]


def test_a_truncated_model_file_in_the_cache_is_named(tmp_path) -> None:
    from eps_eval import gemma, model

    for module in (model, gemma):
        name = "SmolLM2-135M-Instruct.Q4_1.gguf" if module is model else gemma.GGUF_NAME
        (tmp_path / name).write_bytes(b"GGUF" + bytes(100))
        with pytest.raises(ValueError, match="delete it to fetch it again"):
            module.fetch_gguf(tmp_path)


def test_an_unwritable_out_is_refused_before_the_run(tmp_path) -> None:
    # Probed where it would be created, and not created: the run makes it once its
    # arguments are all read (the probe leaves nothing behind).
    made = args.output_dir(str(tmp_path / "new" / "out"))
    assert made == tmp_path / "new" / "out" and list(tmp_path.iterdir()) == []
    with pytest.raises(argparse.ArgumentTypeError, match="not a writable directory"):
        args.output_dir("/sys/no-such-dir/out")
    a_file = tmp_path / "file"
    a_file.write_text("")
    with pytest.raises(argparse.ArgumentTypeError, match="not a writable directory"):
        args.output_dir(str(a_file))
    # An existing directory that cannot be written (mkdir alone would not fail): /sys refuses
    # new files even to root, who may write into a directory of mode 0555.
    with pytest.raises(argparse.ArgumentTypeError, match="not a writable directory"):
        args.output_dir("/sys")


def test_every_writing_command_line_refuses_an_unwritable_out(tmp_path, capsys) -> None:
    from eps_eval import budget_ceiling, run, run_gemma, run_lowrank, run_quality

    a_file = tmp_path / "file"
    a_file.write_text("")
    for module in (budget_ceiling, run, run_gemma, run_lowrank, run_quality):
        with pytest.raises(SystemExit) as exit_info:
            module.main([f"--out={a_file}"])
        assert exit_info.value.code == 2, module.__name__
        assert "not a writable directory" in capsys.readouterr().err, module.__name__


def test_layer_lists_keep_layer_zero_and_refuse_what_is_no_layer() -> None:
    assert args.index_list("0,5,29") == [0, 5, 29]
    for bad in ("", "0,x", "-1", "1.5"):
        with pytest.raises(argparse.ArgumentTypeError):
            args.index_list(bad)


def test_the_issue19_runs_check_their_flags_before_any_work(tmp_path, capsys) -> None:
    # --synthetic=8k was a traceback after settings were written, --real-layers=0,x one after
    # every synthetic context had run, --workers=-1 one after the model had loaded.
    from eps_eval import run_gemma, run_quality

    for main, argv in ((run_quality.main, ["--synthetic=8k"]),
                       (run_quality.main, ["--real-layers=0,x"]),
                       (run_quality.main, ["--real-context=512", "--real-layers=0,30"]),
                       (run_gemma.main, ["--workers=-1"]),
                       (run_gemma.main, ["--compare-tokens=x"])):
        with pytest.raises(SystemExit) as e:
            main([f"--out={tmp_path / 'out'}", *argv])
        assert e.value.code == 2, argv
    assert "SmolLM2 has layers 0-29, not [30]" in capsys.readouterr().err


def test_the_issue19_runs_refuse_units_made_with_other_settings(tmp_path, capsys) -> None:
    # Their units are named by context and layer only: a second run with another --plan into
    # the same --out skipped them as done and reported the two runs as one.
    from eps_eval import run_gemma, run_quality

    out = tmp_path / "out"
    (out / "units").mkdir(parents=True)
    (out / "units" / "q19_synthetic_64_L0.csv").write_text("x\n1\n")
    args.same_settings(argparse.ArgumentParser(), out, {"args": {"plan": "full"}}, {})
    for main in (run_quality.main, run_gemma.main):
        with pytest.raises(SystemExit) as e:
            main([f"--out={out}", "--plan=mass"])
        assert e.value.code == 2
    assert "holds units made with other settings" in capsys.readouterr().err
    # the same settings resume: recorded, then found equal
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    args.same_settings(argparse.ArgumentParser(), fresh, {"args": {"plan": "mass"}}, {"t": 1})
    (fresh / "units").mkdir()
    (fresh / "units" / "u.csv").write_text("x\n")
    args.same_settings(argparse.ArgumentParser(), fresh, {"args": {"plan": "mass"}}, {"t": 2})
    with pytest.raises(SystemExit):
        args.same_settings(argparse.ArgumentParser(), fresh, {"args": {"plan": "c2f"}}, {})


def test_a_command_line_refused_after_out_leaves_no_out_behind(tmp_path, capsys) -> None:
    # output_dir once created --out as argparse read it, before a later argument failed.
    from eps_eval import budget_ceiling, run_gemma, run_quality

    for main, bad in ((budget_ceiling.main, "--g=0"), (run_quality.main, "--synthetic=8k"),
                      (run_gemma.main, "--workers=-1")):
        out = tmp_path / "new" / "out"
        with pytest.raises(SystemExit) as e:
            main([f"--out={out}", bad])
        assert e.value.code == 2, bad
        assert not (tmp_path / "new").exists(), bad


def test_settings_json_that_is_not_json_is_named_not_a_traceback(tmp_path, capsys) -> None:
    out = tmp_path / "out"
    (out / "units").mkdir(parents=True)
    (out / "units" / "u.csv").write_text("x\n")
    (out / "settings.json").write_text("{not json")
    with pytest.raises(SystemExit) as e:
        args.same_settings(argparse.ArgumentParser(), out, {"args": {}}, {})
    assert e.value.code == 2
    assert f"{out / 'settings.json'} cannot be read as the settings" in capsys.readouterr().err
    assert (out / "settings.json").read_text() == "{not json"


def test_a_context_too_short_for_its_query_positions_is_refused_before_any_work(
        tmp_path, capsys) -> None:
    # run_quality --synthetic=5 (2 steps, lags up to 4) made up queries at position -1 and
    # planted its needles after its earliest query; --synthetic=3 was an IndexError inside
    # numpy; run_gemma, run_lowrank, budget_ceiling and run --real-context loaded the model
    # first and then read negative positions or raised deep in the trace.
    from eps_eval import budget_ceiling, run, run_gemma, run_lowrank, run_quality

    out = tmp_path / "out"
    for main, argv, flag in (
            (run_quality.main, ["--synthetic=5"], "--synthetic: context 5"),
            (run_quality.main, ["--synthetic=3", "--plan=mass"], "--synthetic: context 3"),
            (run_quality.main, ["--real-context=6"], "--real-context: context 6"),
            (run_gemma.main, ["--context=4", "--steps=3"], "--context: context 4"),
            (run_lowrank.main, ["--context=12"], "--context: context 12"),
            (budget_ceiling.main, ["--context=64,12"], "--context: context 12"),
            (run.main, ["--real-context=41"], "--real-context: context 41"),
            (run.main, ["--quick", "--real-context=6"], "--real-context: context 6")):
        with pytest.raises(SystemExit) as e:
            main([f"--out={out}", *argv])
        assert e.value.code == 2, argv
        assert f"{flag} is too short" in capsys.readouterr().err, argv
        assert not out.exists(), argv
    # the shortest contexts that fit are accepted by the check
    ap = argparse.ArgumentParser()
    args.check_context(ap, "--context", 7, 2, 4, 1)
    args.check_context(ap, "--context", 42, 40, 2)


def test_a_passkey_context_too_short_for_a_prompt_is_refused_before_any_work(
        tmp_path, capsys) -> None:
    # A context shorter than the question and its margin left a negative filler budget: the
    # filler's slice [start:start + budget] then took nearly all of it, and the "short" prompt
    # was as long as the filler text.
    from eps_eval import run, run_gemma

    out = tmp_path / "out"
    for main, argv in ((run.main, ["--passkey-context=40"]),
                       (run_gemma.main, ["--context=0", "--passkey-context=2048,100"])):
        with pytest.raises(SystemExit) as e:
            main([f"--out={out}", *argv])
        assert e.value.code == 2, argv
        assert "--passkey-context: " in capsys.readouterr().err, argv
        assert not out.exists(), argv
    ap = argparse.ArgumentParser()
    args.passkey_contexts(ap, "--passkey-context", [0, args.PASSKEY_MIN_CONTEXT])


def test_a_passkey_prompt_without_room_for_filler_is_refused() -> None:
    from eps_eval.realmodel import PASSKEY_MIN_FILLER, passkey_prompt

    class Tok:  # one token a character
        def encode(self, text: str) -> list[int]:
            return [ord(c) for c in text]

        def decode(self, ids: list[int]) -> str:
            return "".join(chr(i) for i in ids)

    filler = Tok().encode("A sentence. " * 2000)
    rng = np.random.default_rng(1)
    question = len(Tok().encode("\n\nWhat is the pass key? The pass key is"))
    with pytest.raises(ValueError, match="leaves 31 tokens of filler"):
        passkey_prompt(Tok(), filler, question + 40 + PASSKEY_MIN_FILLER - 1, rng)
    ctx = question + 40 + PASSKEY_MIN_FILLER
    key, _, prompt = passkey_prompt(Tok(), filler, ctx, rng)
    assert key in prompt and len(Tok().encode(prompt)) < ctx + 80


def test_the_synthetic_workload_refuses_queries_before_its_planted_keys() -> None:
    from eps_eval import synthetic

    for positions in ([-1, 4], [2, 3], [4, 9], [5, 10]):
        with pytest.raises(ValueError, match="must lie in"):
            synthetic.make_layer("needle", 10, positions, head_dim=16)
    tr = synthetic.make_layer("needle", 10, [5, 9], head_dim=16)
    assert tr.k.shape == (2, 10, 16) and sorted(tr.q) == [5, 9]
    assert all(p < 5 for p in tr.info["needles"][0])  # planted before the earliest query


def test_settings_json_is_replaced_whole_or_left_as_it_was(tmp_path, monkeypatch) -> None:
    # It was written in place: a write that failed midway (a full disk, a killed run) left
    # half a file, which every later run on that --out refused; a run of the documented
    # parallel pair could read the other's half-written file.
    from pathlib import Path

    out = tmp_path / "out"
    (out / "units").mkdir(parents=True)
    (out / "units" / "u.csv").write_text("x\n")
    args.same_settings(argparse.ArgumentParser(), out, {"args": {"plan": "mass"}}, {"t": 1})
    before = (out / "settings.json").read_text()
    real_write = Path.write_text

    def half_then_fail(self: Path, data: str, *a: object, **k: object) -> int:
        real_write(self, data[: len(data) // 2])
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Path, "write_text", half_then_fail)
    with pytest.raises(OSError):
        args.same_settings(argparse.ArgumentParser(), out, {"args": {"plan": "mass"}}, {"t": 2})
    monkeypatch.undo()
    assert (out / "settings.json").read_text() == before
    assert sorted(p.name for p in out.iterdir()) == ["settings.json", "units"]
