"""Argument types the harness's command lines share: a bad value is an argparse error that
names it (exit 2) before any model is loaded, never a traceback later or a silent skip."""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path


def _int(arg: str) -> int:
    try:
        return int(arg)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{arg!r} is not an integer") from None


def positive_int(arg: str) -> int:
    """An integer >= 1 (a count of steps, prompts or tokens)."""
    value = _int(arg)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be >= 1")
    return value


def non_negative_int(arg: str) -> int:
    """An integer >= 0, where 0 means none (and says so in the flag's help)."""
    value = _int(arg)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} must be >= 0")
    return value


def int_list(arg: str) -> list[int]:
    """`16384,32768` -> [16384, 32768]; a 0 means none and is dropped; a negative is an
    error."""
    return [v for v in (non_negative_int(c) for c in arg.split(",") if c.strip()) if v > 0]


def positive_int_list(arg: str) -> list[int]:
    """`1,2,8` -> [1, 2, 8]: one or more integers >= 1, for a list the run cannot do
    without (its group sizes, its contexts); 0 and an empty list are errors."""
    values = [positive_int(c) for c in arg.split(",") if c.strip()]
    if not values:
        raise argparse.ArgumentTypeError(f"{arg!r} names no value")
    return values


def index_list(arg: str) -> list[int]:
    """`0,5,29` -> [0, 5, 29]: indices (layers), 0 included; a negative or none is an
    error."""
    values = [non_negative_int(c) for c in arg.split(",") if c.strip()]
    if not values:
        raise argparse.ArgumentTypeError(f"{arg!r} names no index")
    return values


# The shortest pass-key prompt the runners' --passkey-context takes: room for the question,
# a margin and realmodel.PASSKEY_MIN_FILLER tokens of filler around the key.
PASSKEY_MIN_CONTEXT = 128


def passkey_contexts(ap: argparse.ArgumentParser, flag: str, values: list[int]) -> None:
    """Refuses (an argparse error naming `flag`) a pass-key context too short for a prompt
    (0, "none", passes)."""
    for ctx in values:
        if 0 < ctx < PASSKEY_MIN_CONTEXT:
            ap.error(f"{flag}: {ctx} tokens is too short for a pass-key prompt "
                     f"(at least {PASSKEY_MIN_CONTEXT})")


def write_text_atomic(path: Path, text: str) -> None:
    """Writes `path` whole or not at all: a file beside it, renamed over it. The documented
    full run starts two processes on one --out, and each reads settings.json before it
    writes it: a plain write let the other read it truncated (a resumed run then refused
    its own directory), and a write that failed midway left it half there for every later
    run to refuse."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def check_context(ap: argparse.ArgumentParser, flag: str, ctx: int, steps: int, history: int,
                  first: int = 0) -> None:
    """Refuses (an argparse error naming `flag`) a context too short for its query positions:
    the last `steps` positions and the `history` positions before them (the largest lag, a
    warm-up) all need a query, and the first of them, ctx - steps - history, must be at least
    `first`. Below 0 a run read queries at negative positions (the synthetic workload made
    them up, a model's trace wrapped to its end) or failed deep inside numpy; checked before
    any model loads."""
    if ctx - steps - history < first:
        ap.error(f"{flag}: context {ctx} is too short for {steps} measured positions with "
                 f"{history} positions of query history before them: the first query would "
                 f"be at position {ctx - steps - history}, and it must be >= {first}")


def check_contexts(ap: argparse.ArgumentParser, flag: str, contexts: list[int], steps: int,
                   history: int) -> None:
    """check_context for each of `contexts`."""
    for ctx in contexts:
        check_context(ap, flag, ctx, steps, history)


def same_settings(ap: argparse.ArgumentParser, out: Path, wanted: dict[str, object],
                  extra: dict[str, object]) -> None:
    """Units resume by name (context, layer, prompt), which does not hold the settings: a
    directory whose units were made with other settings would mix two runs. Refuses (an
    argparse error) a run whose ``wanted`` settings differ from those ``out/settings.json``
    recorded when ``out/units`` holds any unit; otherwise records them there, with
    ``extra`` (the machine, the start time)."""
    wanted = json.loads(json.dumps(wanted, default=str))
    out.mkdir(parents=True, exist_ok=True)  # output_dir checked it, and created nothing
    prior = out / "settings.json"
    units = out / "units"
    if prior.exists() and units.is_dir() and any(units.iterdir()):
        try:
            old = json.loads(prior.read_text())
        except (OSError, ValueError) as e:
            ap.error(f"{prior} cannot be read as the settings of the units in {units} ({e}); "
                     f"give another --out, or remove {units} to start over")
        if not isinstance(old, dict):
            ap.error(f"{prior} does not hold one run's settings (an object); give another "
                     f"--out, or remove {units} to start over")
        if {k: old.get(k) for k in wanted} != wanted:
            ap.error(f"{out} holds units made with other settings ({prior}); give another "
                     f"--out, or remove {units} to start over")
    write_text_atomic(prior, json.dumps({**wanted, **extra}, indent=1, default=str))


def unit_interval(arg: str) -> float:
    """A float in (0, 1] (a recall or mass target)."""
    try:
        value = float(arg)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{arg!r} is not a number") from None
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"{value} is not in (0, 1]")
    return value


def output_dir(arg: str) -> Path:
    """A directory the run writes into, probed for writing now but not created: an
    unwritable `--out` is an argparse error before any model loads, not a traceback when the
    first result is written (possibly hours later), and a command line refused for a later
    argument leaves no directory behind. The run creates it (parents included) once its
    arguments are all read."""
    path = Path(arg)
    # The directory itself when it exists, else the nearest ancestor that does, where the
    # run will create it: a probe directory made and removed there answers for both.
    probe_in = path
    while not probe_in.exists() and probe_in != probe_in.parent:
        probe_in = probe_in.parent
    try:
        if not probe_in.is_dir():
            raise NotADirectoryError(20, "Not a directory")
        with tempfile.TemporaryDirectory(dir=probe_in):
            pass
    except OSError as e:
        raise argparse.ArgumentTypeError(f"{arg!r} is not a writable directory: {e.strerror}") from None
    return path
