"""The chaos run's engine processes (scripts/chaos.py starts them with --role): the steady,
sleeper, chaos and intruder roles, each writing its tally of calls by status code."""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import random
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "client" / "python" / "src"))

from multiprocessing import resource_tracker

import grpc
import numpy as np
from eps_client import (
    BufferShape,
    ClientOptions,
    EpsClient,
    EpsError,
    ModelLayout,
    Row,
    SelectOptions,
    ShmBuffers,
    SummaryWriter,
)
from eps_client.proto import page_selector_pb2 as pb
from eps_client.proto import page_selector_pb2_grpc as pb_grpc
from eps_client.requests import attach_request

MODEL = ModelLayout(num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16,
                    group_blocks=2, kv_dtype="float32")
CONTEXT = 2048  # tokens a row may hold
SHAPE = BufferShape(num_slots=2 * CONTEXT // MODEL.group_tokens, max_seqs=2, max_context=CONTEXT,
                    max_batch=2)
TAG = "chaos"
INTRUDER_UID = 65534
LEASE_MS = 1000

# Codes a step of a chaos engine may fall back with (docs/api-failures.md §4, §5): a miss, the
# sidecar's refusals of what the engine did to itself, a session it lost. INTERNAL or UNKNOWN
# would be epsd's own failure (or a reply for another step).
CHAOS_STEP_CODES = {"OK", "DEADLINE_EXCEEDED", "UNAVAILABLE", "NOT_FOUND", "CANCELLED",
                    "RESOURCE_EXHAUSTED", "UNIMPLEMENTED", "FAILED_PRECONDITION",
                    "INVALID_ARGUMENT"}


# -- workers -------------------------------------------------------------------------------------


class Tally:
    """A worker's calls and their codes, written to its own file after every action, so a
    worker killed with SIGKILL loses at most its last action's counts."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.calls: collections.Counter[str] = collections.Counter()
        self.violations: list[str] = []

    def add(self, what: str, code: str, allowed: set[str] | None = None, detail: str = "") -> None:
        self.calls[f"{what} {code}"] += 1
        if allowed is not None and code not in allowed:
            self.violation(f"{what}: {code} not in {sorted(allowed)} {detail[:200]}")

    def violation(self, text: str) -> None:
        if len(self.violations) < 50:
            self.violations.append(text)
        print(f"chaos: VIOLATION pid {os.getpid()}: {text}", file=sys.stderr, flush=True)

    def flush(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"calls": self.calls, "violations": self.violations}))
        tmp.replace(self.path)


class Engine:
    """One engine's shared buffers with a little context written, and its client."""

    def __init__(self, target: str, engine_id: str, rng: random.Random, *, stream: bool,
                 deadline_s: float, tag: str = TAG, lease_ms: int = 0) -> None:
        self.rng = rng
        self.buf = ShmBuffers(MODEL, SHAPE, tag)
        writer = SummaryWriter(MODEL)
        writer.reset(self.buf.summary_pool)
        nrng = np.random.default_rng(rng.randrange(2**32))
        for row in range(SHAPE.max_seqs):
            groups = self.buf.max_groups
            self.buf.group_table[row] = np.arange(groups) + row * groups
            self.buf.block_table[row] = np.arange(self.buf.max_blocks) + row * self.buf.max_blocks
        for layer in range(MODEL.num_layers):  # 512 tokens of keys for row 0's first groups
            keys = nrng.standard_normal((512, MODEL.num_kv_heads, MODEL.head_dim))
            writer.append(self.buf.summary_pool, layer,
                          np.arange(512) // MODEL.group_tokens, keys.astype(np.float32))
        self.buf.queries[:] = nrng.standard_normal(self.buf.queries.shape)
        self.engine_id = engine_id
        self.client = self.new_client(target, stream=stream, deadline_s=deadline_s,
                                      lease_ms=lease_ms)
        self.step = 0

    def new_client(self, target: str, *, stream: bool, deadline_s: float,
                   lease_ms: int = 0) -> EpsClient:
        options = ClientOptions(target=target, deadline_s=deadline_s, attach_deadline_s=2.0,
                                use_stream=stream)
        return EpsClient(self.buf, engine_id=self.engine_id, num_kv_blocks=1 << 20,
                         select=SelectOptions(top_pages=8), options=options, lease_ms=lease_ms)

    def rows(self) -> list[Row]:
        return [Row(table_row=r, context_tokens=self.rng.randint(1, CONTEXT))
                for r in range(self.rng.randint(1, SHAPE.max_batch))]

    def check_lists(self, rows: list[Row], tally: Tally) -> None:
        """Every list a step wrote holds block ids of its row's block table, within its
        context."""
        for pos, row in enumerate(rows):
            blocks = -(-row.context_tokens // MODEL.block_size)
            table = self.buf.block_table[row.table_row, :blocks]
            for layer in range(MODEL.num_layers):
                count = int(self.buf.visit_count[layer, pos])
                listed = self.buf.visit_blocks[layer, pos, :max(count, 0)]
                if count < -1 or count > blocks or not np.isin(listed, table).all():
                    tally.violation(f"step {self.step} layer {layer} pos {pos}: count {count} "
                                    f"of {blocks} blocks, lists {listed[:8]}")

    def select(self, tally: Tally, what: str, allowed: set[str], *, async_reply: bool = False,
               client: EpsClient | None = None) -> str:
        client = client or self.client
        self.step += 1
        rows = self.rows()
        result = client.select_pages(self.step, rows, async_reply=async_reply)
        code = "OK" if result.ok else result.code.name
        tally.add(what, code, allowed, result.message)
        if result.ok:
            self.check_lists(rows, tally)
        return code

    def close(self) -> None:
        self.client.close()
        self.buf.close()


def publish_session(run_dir: Path, engine: Engine) -> None:
    """Leaves the session id and shm name where the intruder reads them."""
    if engine.client.session_id:
        path = run_dir / "sessions" / f"{os.getpid()}-{engine.engine_id.replace('/', '_')}"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(f"{engine.client.session_id} {engine.buf.shm_name}")
        tmp.replace(path)


def run_steady(args: argparse.Namespace, tally: Tally) -> None:
    """A well-behaved engine until SIGTERM: every step must be selected. ``--stopped``: one
    the driver stops with SIGSTOP for up to 3 s (past its lease): it may fall back while it
    finds its session gone and re-attaches, for at most 2 s of steps after each stop."""
    rng = random.Random(args.seed)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    engine = Engine(args.target, args.engine_id, rng, stream=args.stream, deadline_s=2.0)
    engine.client.attach()
    publish_session(args.run_dir, engine)
    what = "sleeper.select" if args.stopped else "steady.select"
    allowed = {"OK", "NOT_FOUND", "UNAVAILABLE", "DEADLINE_EXCEEDED"} if args.stopped else {"OK"}
    fallen_since = None
    while not stop.is_set():
        code = engine.select(tally, what, allowed)
        if code == "OK":
            fallen_since = None
        elif fallen_since is None:
            fallen_since = time.monotonic()
        elif time.monotonic() - fallen_since > 2.0:
            tally.violation(f"{what}: no selection for {time.monotonic() - fallen_since:.1f} s "
                            f"(last {code})")
            fallen_since = time.monotonic()
        if rng.random() < 0.02:
            with contextlib.suppress(EpsError):
                engine.client.heartbeat()
                tally.add("steady.heartbeat", "OK")
        tally.flush()
        stop.wait(0.05)
    try:
        engine.client.detach()
        tally.add("steady.detach", "OK")
    except EpsError as x:  # the sleeper's lease may have run out while it was stopped
        tally.add("sleeper.detach" if args.stopped else "steady.detach", code_of(x),
                  {"NOT_FOUND"} if args.stopped else {"OK"}, str(x))
    engine.close()
    tally.flush()


def code_of(e: Exception) -> str:
    if isinstance(e, EpsError):
        return e.code.name
    if isinstance(e, grpc.RpcError):
        return e.code().name
    return type(e).__name__


def self_kill_after(delay_s: float) -> None:
    threading.Timer(delay_s, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()


def act_steps(e: Engine, tally: Tally, rng: random.Random, args: argparse.Namespace) -> None:
    """Steps in a random transport with a normal or a 1 ms deadline; sometimes async."""
    e.client.options.use_stream = rng.random() < 0.5
    e.client.options.deadline_s = rng.choice([0.001, 0.002, 0.5, 2.0])
    for _ in range(rng.randint(1, 40)):
        e.select(tally, "chaos.select", CHAOS_STEP_CODES, async_reply=rng.random() < 0.05)
        publish_session(args.run_dir, e)
        time.sleep(rng.choice([0, 0.01, 0.05]))


def attach(e: Engine, tally: Tally) -> None:
    """An Attach of a chaos engine: refused only for lack of room, time or a build in flight."""
    try:
        e.client.attach()
        tally.add("chaos.attach", "OK")
    except EpsError as x:
        tally.add("chaos.attach", code_of(x), {"RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED",
                                              "ABORTED"})


def act_detach(e: Engine, tally: Tally, rng: random.Random, args: argparse.Namespace) -> None:
    try:
        e.client.detach()
        tally.add("chaos.detach", "OK")
    except EpsError as x:
        tally.add("chaos.detach", code_of(x), {"NOT_FOUND", "DEADLINE_EXCEEDED"})
    e.select(tally, "chaos.select_after_detach", {"FAILED_PRECONDITION"})
    attach(e, tally)


def act_replace(e: Engine, tally: Tally, rng: random.Random, args: argparse.Namespace) -> None:
    """A second client of the same engine_id takes the session over, back and forth."""
    other = e.new_client(args.target, stream=rng.random() < 0.5, deadline_s=1.0)
    try:
        for _ in range(rng.randint(1, 6)):
            e.select(tally, "chaos.replace_select", CHAOS_STEP_CODES, client=other)
            e.select(tally, "chaos.replace_select", CHAOS_STEP_CODES)
    finally:
        other.close()  # no detach: the session it holds, if any, ends with its lease


def act_expire(e: Engine, tally: Tally, rng: random.Random, args: argparse.Namespace) -> None:
    """No call for longer than the lease: the next step finds the session gone and the client
    re-attaches in the background."""
    time.sleep(LEASE_MS / 1000 * rng.uniform(1.2, 2.5))
    e.client.options.deadline_s = 1.0
    for _ in range(rng.randint(1, 5)):
        e.select(tally, "chaos.select_after_expiry", CHAOS_STEP_CODES)
        time.sleep(0.06)


def act_flood(e: Engine, tally: Tally, rng: random.Random, args: argparse.Namespace) -> None:
    """Several unary steps of one session in flight at once (docs/api-failures.md §5.6)."""
    if not e.client.session_id:
        return
    futures = []
    for _ in range(rng.randint(2, 6)):
        e.step += 1
        request = pb.SelectPagesRequest(session_id=e.client.session_id, step=e.step,
                                        rows=[pb.BatchRow(table_row=0, context_tokens=1024)])
        futures.append(e.client.stub.SelectPages.future(request, timeout=2.0))
    if rng.random() < 0.3:
        self_kill_after(rng.uniform(0, 0.003))
    for f in futures:
        try:
            f.result()
            tally.add("chaos.flood", "OK")
        except grpc.RpcError as x:
            tally.add("chaos.flood", x.code().name, {"RESOURCE_EXHAUSTED", "FAILED_PRECONDITION",
                                                     "NOT_FOUND", "DEADLINE_EXCEEDED"},
                      x.details() or "")


def act_race(e: Engine, tally: Tally, rng: random.Random, args: argparse.Namespace) -> None:
    """A unary step in flight while the session is detached or replaced from another call."""
    if not e.client.session_id:
        return
    e.step += 1
    request = pb.SelectPagesRequest(session_id=e.client.session_id, step=e.step,
                                    rows=[pb.BatchRow(table_row=0, context_tokens=2048),
                                          pb.BatchRow(table_row=1, context_tokens=2048)])
    step = e.client.stub.SelectPages.future(request, timeout=2.0)
    time.sleep(rng.choice([0, 0.0002, 0.001]))
    if rng.random() < 0.5:
        try:
            e.client.stub.Detach(pb.DetachRequest(session_id=e.client.session_id), timeout=2.0)
            tally.add("chaos.race_detach", "OK")
        except grpc.RpcError as x:
            tally.add("chaos.race_detach", x.code().name, {"NOT_FOUND"}, x.details() or "")
    else:
        try:
            e.client.stub.Attach(e.client._attach, timeout=2.0)
            tally.add("chaos.race_attach", "OK")  # the client's session is replaced
        except grpc.RpcError as x:
            tally.add("chaos.race_attach", x.code().name, {"RESOURCE_EXHAUSTED", "ABORTED"},
                      x.details() or "")
    try:
        step.result()
        tally.add("chaos.race_step", "OK")
    except grpc.RpcError as x:
        # CANCELLED: its reply was handed to gRPC, not yet read, when the session ended
        # (docs/api-failures.md §4)
        tally.add("chaos.race_step", x.code().name,
                  {"NOT_FOUND", "RESOURCE_EXHAUSTED", "CANCELLED"}, x.details() or "")


def act_cancel(e: Engine, tally: Tally, rng: random.Random, args: argparse.Namespace) -> None:
    """Streams and unary calls cancelled right after they were sent."""
    stub = e.client.stub
    sid = e.client.session_id or "s-none"
    requests = []
    for _ in range(rng.randint(1, 5)):
        e.step += 1
        requests.append(pb.SelectPagesRequest(session_id=sid, step=e.step,
                                              rows=[pb.BatchRow(table_row=1, context_tokens=2000)]))
    call = stub.StreamSelectPages(iter(requests))
    time.sleep(rng.choice([0, 0.0005, 0.002]))
    call.cancel()
    with contextlib.suppress(grpc.RpcError):
        for _ in call:
            pass
    tally.add("chaos.stream_cancel", call.code().name)
    future = stub.SelectPages.future(requests[-1], timeout=2.0)
    time.sleep(rng.choice([0, 0.001]))
    future.cancel()
    tally.add("chaos.unary_cancel", "sent")


def inline_attach(engine_id: str, slots: int) -> pb.AttachRequest:
    """An Attach whose summary pool lives in the message (epsd allocates and zeroes it)."""
    layout = ShmBuffersLayout(slots)
    request = pb.AttachRequest(engine_id=engine_id, layout=MODEL.to_proto(), max_batch=2,
                               buffers=layout.descriptors({"inline_bytes": pb.InlineBytes()}))
    for name in ("summary_pool", "group_table", "block_table", "queries", "visit_blocks",
                 "visit_count", "flags"):
        getattr(request.buffers, name).offset = 0
    return request


def ShmBuffersLayout(slots: int) -> Any:
    from eps_client.buffers import BufferLayout
    return BufferLayout.compute(MODEL, BufferShape(num_slots=slots, max_seqs=2,
                                                   max_context=CONTEXT, max_batch=2))


def act_abandoned_attach(e: Engine, tally: Tally, rng: random.Random,
                         args: argparse.Namespace) -> None:
    """Attach calls with deadlines of 1-30 ms, some over large inline buffers (tens of ms to
    build), some of them the engine's own id (a replacement given up mid-build)."""
    stub = e.client.stub
    for _ in range(rng.randint(1, 4)):
        engine_id = e.engine_id if rng.random() < 0.5 else f"{e.engine_id}-inline"
        request = inline_attach(engine_id, rng.choice([64, 4096, 16384]))
        try:
            reply = stub.Attach(request, timeout=rng.uniform(0.001, 0.03))
            tally.add("chaos.short_attach", "OK")
            with contextlib.suppress(grpc.RpcError):
                stub.Detach(pb.DetachRequest(session_id=reply.session_id), timeout=2.0)
        except grpc.RpcError as x:
            tally.add("chaos.short_attach", x.code().name,
                      {"DEADLINE_EXCEEDED", "CANCELLED", "RESOURCE_EXHAUSTED", "ABORTED"},
                      x.details() or "")


def mutate_attach(request: pb.AttachRequest, rng: random.Random) -> pb.AttachRequest:
    bad = pb.AttachRequest()
    bad.CopyFrom(request)
    choice = rng.randrange(10)
    if choice == 0:
        bad.engine_id = rng.choice(["", "x" * 300])
    elif choice == 1:
        bad.layout.num_layers = rng.choice([0, 5000, 2**31])
    elif choice == 2:
        bad.layout.head_dim = rng.choice([30, 0, 65])
    elif choice == 3:
        bad.buffers.summary_pool.host_shm.name = rng.choice(
            ["x/y", "/..", "/eps-no-such-object", "/a\x01b", "/" + "n" * 300])
    elif choice == 4:
        bad.buffers.queries.shape[1] = 7
    elif choice == 5:
        bad.buffers.summary_pool.offset = 4
    elif choice == 6:
        bad.max_batch = rng.choice([0, 10**6])
    elif choice == 7:
        bad.options.top_pages = 0
        bad.options.method = pb.METHOD_QUEST
    elif choice == 8:
        bad.buffers.block_table.host_shm.size = bad.buffers.block_table.host_shm.size + 4096
    else:
        bad.options.alpha = 0.5
    return bad


def act_malformed(e: Engine, tally: Tally, rng: random.Random, args: argparse.Namespace) -> None:
    """Invalid requests: every one must be refused with a status naming the problem, never OK,
    never INTERNAL or UNKNOWN; random bytes that do not parse are gRPC's UNIMPLEMENTED."""
    stub = e.client.stub
    good = attach_request(e.buf, engine_id=e.engine_id + "-bad")
    refused = {"INVALID_ARGUMENT", "NOT_FOUND", "FAILED_PRECONDITION", "RESOURCE_EXHAUSTED",
               "PERMISSION_DENIED"}
    for _ in range(rng.randint(1, 8)):
        kind = rng.randrange(4)
        try:
            if kind == 0:
                stub.Attach(mutate_attach(good, rng), timeout=2.0)
                tally.add("chaos.bad_attach", "OK", refused)
            elif kind == 1:
                sid = e.client.session_id or "s-1-" + "0" * 32
                request = pb.SelectPagesRequest(session_id=sid, step=rng.choice([0, 2**64 - 1]),
                                                rows=[pb.BatchRow(
                                                    table_row=rng.choice([-1, 2, 0]),
                                                    context_tokens=rng.choice([0, -5, 2**62]))])
                stub.SelectPages(request, timeout=2.0)
                tally.add("chaos.bad_select", "OK", refused)
            elif kind == 2:
                garbage = bytes(rng.randrange(256) for _ in range(rng.randint(1, 200)))
                method = rng.choice(["Attach", "SelectPages", "Heartbeat", "Detach"])
                call = e.client._channel.unary_unary(f"/eps.v1.PageSelector/{method}")
                call(garbage, timeout=2.0)
                tally.add("chaos.garbage", "OK")  # some bytes parse as a valid message
            else:
                sid = "s-" + "9" * rng.choice([3, 70, 5000])
                stub.Heartbeat(pb.HeartbeatRequest(session_id=sid), timeout=2.0)
                tally.add("chaos.bad_heartbeat", "OK", refused)
        except grpc.RpcError as x:
            what = ["chaos.bad_attach", "chaos.bad_select", "chaos.garbage",
                    "chaos.bad_heartbeat"][kind]
            # bytes that do not parse: gRPC answers UNIMPLEMENTED (docs/api-failures.md §4)
            allowed = refused | ({"UNIMPLEMENTED"} if kind == 2 else set())
            tally.add(what, x.code().name, allowed, x.details() or "")


def act_shrink(e: Engine, tally: Tally, rng: random.Random, args: argparse.Namespace) -> None:
    """Shrinks the engine's shm object under epsd: its steps fail FAILED_PRECONDITION, epsd
    lives (docs/security.md class 1). The engine ends here."""
    os.truncate(f"/dev/shm{e.buf.shm_name}", 4096)
    e.client.options.deadline_s = 2.0
    for _ in range(3):
        e.select(tally, "chaos.select_shrunk", {"FAILED_PRECONDITION", "UNAVAILABLE",
                                                "NOT_FOUND", "DEADLINE_EXCEEDED"})
    raise SystemExit(0)


ACTIONS = [(act_steps, 10), (act_detach, 2), (act_replace, 2), (act_expire, 1), (act_flood, 2),
           (act_cancel, 2), (act_abandoned_attach, 2), (act_malformed, 2), (act_race, 2),
           (act_shrink, 0.3)]


def run_chaos(args: argparse.Namespace, tally: Tally) -> None:
    rng = random.Random(args.seed)
    # 50 ms: the reaper ends the session between steps, and while one waits
    engine = Engine(args.target, args.engine_id, rng, stream=rng.random() < 0.5,
                    deadline_s=0.5, lease_ms=rng.choice([0, 0, 50, 200]))
    if rng.random() < 0.15:
        self_kill_after(rng.uniform(0, 0.01))  # often mid-Attach
    attach(engine, tally)
    publish_session(args.run_dir, engine)
    actions, weights = zip(*ACTIONS)
    for _ in range(rng.randint(1, 12)):
        action = rng.choices(actions, weights)[0]
        if rng.random() < 0.05:
            self_kill_after(rng.uniform(0, 0.02))  # mid-step, mid-call
        action(engine, tally, rng, args)
        tally.flush()
    if rng.random() < 0.5:
        with contextlib.suppress(EpsError):
            engine.client.detach()
    engine.close()  # otherwise the session ends with its lease


def run_intruder(args: argparse.Namespace, tally: Tally) -> None:
    """Another user: names the root engines' sessions and shm objects, and fills its quota."""
    rng = random.Random(args.seed)
    # multiprocessing's tracker of shared memory, started as root: as uid 65534 it could not
    # run this interpreter (under /root), and every ShmBuffers would then fail on its pipe.
    resource_tracker.ensure_running()
    os.setgroups([])
    os.setresgid(INTRUDER_UID, INTRUDER_UID, INTRUDER_UID)
    os.setresuid(INTRUDER_UID, INTRUDER_UID, INTRUDER_UID)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    channel = grpc.insecure_channel(args.target)
    stub = pb_grpc.PageSelectorStub(channel)
    denied = {"PERMISSION_DENIED", "NOT_FOUND"}
    own: list[Engine] = []
    while not stop.is_set():
        entries = [e for e in (args.run_dir / "sessions").iterdir() if e.suffix != ".tmp"]
        if entries:
            sid, shm = rng.choice(entries).read_text().split()
            calls = {
                "intruder.select": lambda sid=sid: stub.SelectPages(pb.SelectPagesRequest(
                    session_id=sid, step=2**62, rows=[pb.BatchRow(table_row=0,
                                                                  context_tokens=16)]),
                    timeout=2.0),
                "intruder.heartbeat": lambda sid=sid: stub.Heartbeat(
                    pb.HeartbeatRequest(session_id=sid), timeout=2.0),
                "intruder.detach": lambda sid=sid: stub.Detach(
                    pb.DetachRequest(session_id=sid), timeout=2.0),
                "intruder.stats": lambda sid=sid: stub.GetStats(
                    pb.GetStatsRequest(session_id=sid), timeout=2.0),
            }
            what = rng.choice(list(calls))
            try:
                calls[what]()
                tally.add(what, "OK", denied, f"session {sid[:12]}")
            except grpc.RpcError as x:
                tally.add(what, x.code().name, denied)
            if own and rng.random() < 0.3:  # the engine's own buffers, the victim's shm name
                request = attach_request(own[0].buf, engine_id="intruder-shm")
                request.buffers.summary_pool.host_shm.name = shm
                try:
                    stub.Attach(request, timeout=2.0)
                    tally.add("intruder.attach_their_shm", "OK", {"PERMISSION_DENIED"})
                except grpc.RpcError as x:
                    # RESOURCE_EXHAUSTED: its quota, checked first (docs/api-failures.md §4)
                    tally.add("intruder.attach_their_shm", x.code().name,
                              {"PERMISSION_DENIED", "NOT_FOUND", "INVALID_ARGUMENT",
                               "RESOURCE_EXHAUSTED"})
        if rng.random() < 0.05:  # its own engines, past the per-user quota, with root's ids
            for engine in own:
                with contextlib.suppress(EpsError):
                    engine.client.detach()
                engine.close()
            own = []
            for i in range(args.max_sessions_per_user + 2):
                engine = Engine(args.target, f"steady-{i}", rng, stream=False, deadline_s=1.0,
                                tag="chaos-intruder")
                own.append(engine)
                try:
                    engine.client.attach()
                    tally.add("intruder.attach", "OK")
                except EpsError as x:
                    tally.add("intruder.attach", code_of(x), {"RESOURCE_EXHAUSTED"})
        tally.flush()
        stop.wait(0.1)
    for engine in own:
        with contextlib.suppress(EpsError):
            engine.client.detach()
        engine.close()
    tally.flush()


def worker_main(args: argparse.Namespace) -> int:
    tally = Tally(args.run_dir / "tally" / f"{args.role}-{os.getpid()}.json")
    logging_off()
    try:
        run = {"steady": run_steady, "sleeper": run_steady, "chaos": run_chaos,
               "intruder": run_intruder}[args.role]
        run(args, tally)
    except SystemExit:
        pass
    except Exception as x:  # noqa: BLE001 - an exception out of the client is a finding
        tally.violation(f"{args.role} raised {type(x).__name__}: {x}")
    tally.flush()
    os._exit(0)  # no waiting for grpc's threads


def logging_off() -> None:
    import logging
    logging.getLogger("eps_client").setLevel(logging.ERROR)
