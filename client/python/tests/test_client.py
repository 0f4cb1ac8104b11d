"""EpsClient against the real epsd (CPU backend, shared memory): the visit lists equal
core/'s reference step, over unary and stream transports, and re-attach works."""

from __future__ import annotations

import time
from concurrent import futures
from dataclasses import replace

import grpc
import numpy as np
import pytest
from engine_state import MODEL, OPTIONS, core_visits, make_state

from eps_client import (
    ClientOptions,
    EpsClient,
    EpsError,
    MassSetting,
    Row,
    StatusCode,
    groups_for,
)
from eps_client.proto import page_selector_pb2 as pb
from eps_client.proto import page_selector_pb2_grpc as pb_grpc


def assert_visits_equal_core(core_reference, tmp_path, state, attach, batch: int) -> int:
    want_blocks, want_count = core_visits(core_reference, tmp_path, state, attach)
    buf = state.buffers
    np.testing.assert_array_equal(buf.visit_count[:, :batch], want_count[:, :batch])
    visited = 0
    for layer in range(buf.visit_count.shape[0]):
        for b in range(batch):
            n = int(want_count[layer, b])
            np.testing.assert_array_equal(buf.visits(layer, b), want_blocks[layer, b, :n])
            visited += n
    return visited


@pytest.mark.parametrize("use_stream", [False, True])
def test_visit_lists_equal_the_core_reference_step(epsd, core_reference, tmp_path, rng,
                                                   use_stream):
    state = make_state(rng, contexts=[900, 517, 1000])
    attach = state.attach()
    options = ClientOptions(target=epsd.target, deadline_s=2.0, use_stream=use_stream)
    with state.client(options) as client:
        info = client.attach()
        assert info.session_id and info.record_words == state.buffers.layout.record_words
        assert info.options.method == "jl" and info.options.top_pages == 3
        total_blocks = sum((c + 15) // 16 for c in state.contexts) * 2
        for step in range(1, 4):
            state.new_queries(rng)
            result = client.select_pages(step, state.rows)
            assert result.ok, result.message
            assert result.step == step and result.done and result.stats is not None
            visited = assert_visits_equal_core(core_reference, tmp_path, state, attach, 3)
            assert result.stats.pages_visited == visited
            assert result.stats.pages_total == total_blocks
            assert visited < total_blocks  # the selection skipped something
            # every list ends with the sequence's last block
            for layer in range(2):
                for b, (row, ctx, _) in enumerate(state.rows):
                    last = state.buffers.block_table[row, (ctx - 1) // 16]
                    assert state.buffers.visits(layer, b)[-1] == last
        assert client.counters().selected == 3 and client.counters().fallbacks == 0
        stats = client.stats()
        assert stats.sessions[0].steps == 3
    # leaving the block detached the session
    with state.client(ClientOptions(target=epsd.target, deadline_s=2.0)) as probe:
        assert probe.stats(session_only=False).sessions_active == 0
    state.buffers.close()


def test_per_kv_head_lists_without_a_granularity_option_equal_the_core_reference_step(
        epsd, core_reference, tmp_path, rng):
    # epsd takes the lists' granularity from the rank of visit_blocks when the options leave
    # it unset; the reference must do the same (it once wrote union lists here).
    state = make_state(rng, contexts=[700, 1000], per_kv_head=True,
                       select=replace(OPTIONS, granularity=None))
    attach = state.attach()
    assert attach.options.granularity == pb.GRANULARITY_UNSPECIFIED
    with state.client(ClientOptions(target=epsd.target, deadline_s=2.0)) as client:
        client.attach()
        for step in range(1, 3):
            state.new_queries(rng)
            assert client.select_pages(step, state.rows).ok
            want_blocks, want_count = core_visits(core_reference, tmp_path, state, attach)
            buf = state.buffers
            np.testing.assert_array_equal(buf.visit_count[:, :2], want_count[:, :2])
            heads_differ = False
            for layer in range(MODEL.num_layers):
                for b in range(2):
                    lists = []
                    for h in range(MODEL.num_kv_heads):
                        n = int(want_count[layer, b, h])
                        got = buf.visit_blocks[layer, b, h, :n]
                        np.testing.assert_array_equal(got, want_blocks[layer, b, h, :n])
                        lists.append(tuple(got))
                    heads_differ |= len(set(lists)) > 1
            assert heads_differ  # per-head lists, not one union list copied to every head
    state.buffers.close()


def test_a_coarse_level_session_equals_the_core_reference_step(epsd, core_reference, tmp_path,
                                                               rng):
    model = replace(MODEL, coarse_blocks=8)
    select = replace(OPTIONS, method="quest", top_pages=2, coarse_candidates=1.0)
    # Long enough that the candidates cannot cover the context: a head names
    # ceil(1.0 · 2 / 4) = 1 coarse group, so 4 heads and 2 forced name at most 6 of a row's
    # 32 or 24 (with 1000 and 700 tokens they could name all 8, and the level read more than
    # the flat selection would: a failed run of 2026-11-26).
    state = make_state(rng, contexts=[4000, 3000], max_context=4096, model=model,
                       select=select)
    attach = state.attach()
    assert attach.layout.coarse_blocks == 8
    assert attach.buffers.HasField("coarse_pool") and attach.buffers.HasField("coarse_table")
    with state.client(ClientOptions(target=epsd.target, deadline_s=2.0)) as client:
        info = client.attach()
        assert info.options.coarse_candidates == 1.0
        for step in range(1, 3):
            state.new_queries(rng)
            result = client.select_pages(step, state.rows)
            assert result.ok, result.message
            assert_visits_equal_core(core_reference, tmp_path, state, attach, 2)
            # the coarse level pruned: fewer records read than one per group and KV head
            groups = sum(groups_for(c, model) for c in state.contexts)
            assert result.stats is not None
            assert result.stats.bytes_summary_read < (
                groups * model.num_layers * model.num_kv_heads * state.buffers.layout.record_words
                * 4)
    state.buffers.close()


def test_a_session_with_per_layer_mass_settings_equals_the_core_reference_step(
        epsd, core_reference, tmp_path, rng):
    layers = (MassSetting(target=0.5, max_pages=1), MassSetting(target=0.99, temperature=2.0,
                                                                  min_pages=2))
    select = replace(OPTIONS, budget="mass", mass_layers=layers)
    state = make_state(rng, contexts=[900, 600], select=select)
    attach = state.attach()
    assert len(attach.options.mass_layers) == MODEL.num_layers
    with state.client(ClientOptions(target=epsd.target, deadline_s=2.0)) as client:
        info = client.attach()
        assert [m.max_pages for m in info.options.mass_layers] == [1, 0]
        assert [m.target for m in info.options.mass_layers] == pytest.approx([0.5, 0.99])
        state.new_queries(rng)
        result = client.select_pages(1, state.rows)
        assert result.ok, result.message
        assert_visits_equal_core(core_reference, tmp_path, state, attach, 2)
    state.buffers.close()


def test_a_feedback_session_equals_the_core_reference_and_consumes_its_rows(
        epsd, core_reference, tmp_path, rng):
    state = make_state(rng, contexts=[1000, 700], select=replace(OPTIONS, top_pages=2),
                       with_feedback=True)
    attach = state.attach()
    assert attach.buffers.HasField("feedback")
    fb = state.buffers.feedback
    assert fb is not None and np.isnan(fb).all()
    with state.client(ClientOptions(target=epsd.target, deadline_s=2.0)) as client:
        client.attach()
        for step in range(1, 3):
            state.new_queries(rng)
            # as an attention would leave it: about half the groups of each head fed
            for row, ctx, _ in state.rows:
                groups = groups_for(ctx, MODEL)
                lse = rng.uniform(-4, 4, (MODEL.num_layers, MODEL.num_q_heads, groups))
                lse[rng.random(lse.shape) < 0.5] = np.nan
                fb[:, row, :, :groups] = lse
            fb[:, 0, :, :3] = 1.0  # row 0 is in no step: never consumed
            # core's lists with this feedback (the tool reads a copy), before epsd consumes it
            want_blocks, want_count = core_visits(core_reference, tmp_path, state, attach)
            result = client.select_pages(step, state.rows)
            assert result.ok, result.message
            np.testing.assert_array_equal(state.buffers.visit_count[:, :2], want_count[:, :2])
            for layer in range(MODEL.num_layers):
                for b in range(2):
                    n = int(want_count[layer, b])
                    np.testing.assert_array_equal(state.buffers.visits(layer, b),
                                                  want_blocks[layer, b, :n])
            for row, _, _ in state.rows:
                assert np.isnan(fb[:, row]).all()
            assert (fb[:, 0, :, :3] == 1.0).all()
    state.buffers.close()


def test_an_attach_without_the_coarse_buffers_is_refused_naming_them(epsd, rng):
    state = make_state(rng, contexts=[300], model=replace(MODEL, coarse_blocks=8))
    request = state.attach()
    request.buffers.ClearField("coarse_table")
    with grpc.insecure_channel(epsd.target) as channel:
        stub = pb_grpc.PageSelectorStub(channel)
        with pytest.raises(grpc.RpcError) as refused:
            stub.Attach(request, timeout=5)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.value.details() == (
        "coarse_table is required: layout.coarse_blocks=8 has a coarse level")
    state.buffers.close()


def test_invalid_row_is_an_error_fallback_and_the_session_keeps_serving(epsd, rng):
    state = make_state(rng, contexts=[300])
    with state.client(ClientOptions(target=epsd.target, deadline_s=2.0)) as client:
        client.attach()
        bad = client.select_pages(1, [Row(1, 10**6)])  # context beyond max_blocks
        assert bad.fallback and bad.code == grpc.StatusCode.INVALID_ARGUMENT
        assert client.counters().fallback_error == 1
        assert client.select_pages(2, state.rows).ok
    state.buffers.close()


def test_fail_closed_returns_the_error_instead_of_a_fallback(epsd, rng):
    state = make_state(rng, contexts=[300])
    options = ClientOptions(target=epsd.target, deadline_s=2.0, fail_open=False)
    with state.client(options) as client:
        client.attach()
        with pytest.raises(EpsError) as e:
            client.select_pages(1, [(1, 10**6, 0)])
        assert e.value.code == StatusCode.INVALID_ARGUMENT and "context_tokens" in e.value.message
        assert client.counters().errors == 1 and client.counters().fallbacks == 0
    state.buffers.close()


@pytest.mark.parametrize("use_stream", [False, True])
def test_client_reattaches_by_itself_after_epsd_restarts(epsd, rng, use_stream):
    state = make_state(rng, contexts=[400, 200])
    options = ClientOptions(target=epsd.target, deadline_s=2.0, reattach_backoff_s=0.05,
                            use_stream=use_stream)
    with state.client(options) as client:
        client.attach()
        assert client.select_pages(1, state.rows).ok
        first_session = client.session_id
        epsd.stop()
        down = client.select_pages(2, state.rows)
        assert down.fallback and down.code == grpc.StatusCode.UNAVAILABLE
        epsd.start()
        step, until = 3, time.monotonic() + 10
        while not (result := client.select_pages(step, state.rows)).ok:
            assert result.fallback, result.message
            assert time.monotonic() < until, f"no re-attach: {result.code} {result.message}"
            step += 1
        counters = client.counters()
        assert counters.reattaches == 1 and client.session_id != first_session
        assert counters.fallbacks == step - 2 and counters.selected == 2
    state.buffers.close()


def test_detach_then_unknown_session_reattaches(epsd, rng):
    state = make_state(rng, contexts=[256])
    with state.client(ClientOptions(target=epsd.target, deadline_s=2.0)) as client:
        client.attach()
        client.detach()
        with pytest.raises(EpsError) as e:
            client.heartbeat()
        assert e.value.code == grpc.StatusCode.NOT_FOUND
    state.buffers.close()


class RecordingSelector(pb_grpc.PageSelectorServicer):
    """A fake epsd that records metadata and answers SelectPages with an empty reply."""

    def __init__(self) -> None:
        self.metadata: list[dict[str, str]] = []

    def Attach(self, request, context):  # noqa: N802 - gRPC method name
        self.metadata.append(dict(context.invocation_metadata()))
        return pb.AttachResponse(session_id="fake-session")

    def SelectPages(self, request, context):  # noqa: N802
        self.metadata.append(dict(context.invocation_metadata()))
        return pb.SelectPagesResponse(step=request.step, done=True)

    def StreamSelectPages(self, request_iterator, context):  # noqa: N802
        self.metadata.append(dict(context.invocation_metadata()))
        for request in request_iterator:
            yield pb.SelectPagesResponse(step=request.step, done=True)


@pytest.mark.parametrize("use_stream", [False, True])
def test_traceparent_is_sent_as_metadata(tmp_path, use_stream):
    servicer = RecordingSelector()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    pb_grpc.add_PageSelectorServicer_to_server(servicer, server)
    target = f"unix://{tmp_path}/fake.sock"
    server.add_insecure_port(target)
    server.start()
    ids = iter(["00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
                "00-0af7651916cd43dd8448eb211c80319c-00f067aa0ba902b7-01"])
    options = ClientOptions(target=target, deadline_s=2.0, use_stream=use_stream,
                            traceparent=lambda: next(ids, None))
    try:
        with EpsClient.from_request(options, pb.AttachRequest(engine_id="e")) as client:
            client.attach()
            assert client.select_pages(1, [(0, 1, 0)]).ok
    finally:
        server.stop(grace=None)
    assert servicer.metadata[0]["traceparent"].endswith("b7ad6b7169203331-01")
    assert servicer.metadata[1]["traceparent"].endswith("00f067aa0ba902b7-01")


def test_a_connection_holds_at_most_100_streams_at_once(epsd):
    # One peer once opened 20,000 idle StreamSelectPages on one connection, each a reactor
    # with a read pending in epsd (363 MB, charged to no budget). epsd now caps a connection
    # at 100 concurrent streams (service/server.h); past them the peer's own calls wait in
    # its client, while other connections are served.
    import asyncio

    async def run() -> None:
        # Channels of one target share a connection unless told not to.
        own = [("grpc.use_local_subchannel_pool", 1)]
        crowded = grpc.aio.insecure_channel(epsd.target, options=own)
        other = grpc.aio.insecure_channel(epsd.target, options=own)
        stub, other_stub = pb_grpc.PageSelectorStub(crowded), pb_grpc.PageSelectorStub(other)
        await stub.Ping(pb.PingRequest(), timeout=5)
        streams = [stub.StreamSelectPages() for _ in range(100)]
        await asyncio.sleep(0.5)  # all 100 open and idle
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.Ping(pb.PingRequest(), timeout=1)  # a 101st stream waits
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        await other_stub.Ping(pb.PingRequest(), timeout=5)  # another connection is served
        streams.pop().cancel()
        await stub.Ping(pb.PingRequest(), timeout=5)  # room again on the crowded one
        for s in streams:
            s.cancel()
        await crowded.close()
        await other.close()

    asyncio.run(run())
