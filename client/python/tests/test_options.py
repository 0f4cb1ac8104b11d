"""SelectOptions and ClientOptions in Python and on the wire: every policy field survives the
round trip, and a name the server does not know, a value of the wrong type or beyond its wire
type is refused at construction, naming the field."""

from __future__ import annotations

import numpy as np
import pytest

from eps_client import ClientOptions, MassSetting, SelectOptions
from eps_client.client_options import valid_traceparent
from eps_client.proto import page_selector_pb2 as pb


def test_every_field_round_trips_through_the_proto() -> None:
    options = SelectOptions(method="questclt", alpha=0.5, first_n=2, last_n=3, top_pages=7,
                            strict=False, heads="all", budget="mass", mass_target=0.9,
                            mass_temperature=2.0, min_pages=4, max_pages=9, mass_scope="list",
                            granularity="per_kv_head")
    message = options.to_proto()
    assert message.method == pb.METHOD_QUEST_CLT
    assert message.budget == pb.BUDGET_MASS
    assert message.min_pages == 4 and message.max_pages == 9
    assert message.mass_scope == pb.MASS_SCOPE_LIST
    back = SelectOptions.from_proto(message)
    assert back.method == "questclt" and back.budget == "mass"
    assert back.mass_target == pytest.approx(0.9) and back.mass_temperature == pytest.approx(2.0)
    assert (back.min_pages, back.max_pages, back.top_pages) == (4, 9, 7)
    assert back.mass_scope == "list"


def test_coarse_candidates_round_trip_and_stay_unset_when_none() -> None:
    message = SelectOptions(coarse_candidates=3.5).to_proto()
    assert message.HasField("coarse_candidates") and message.coarse_candidates == 3.5
    assert SelectOptions.from_proto(message).coarse_candidates == 3.5
    unset = SelectOptions(method="quest").to_proto()
    assert not unset.HasField("coarse_candidates")
    assert SelectOptions.from_proto(unset).coarse_candidates is None


def test_unset_fields_stay_unset_so_the_session_keeps_its_setting() -> None:
    message = SelectOptions(method="quest").to_proto()
    assert message.budget == pb.BUDGET_UNSPECIFIED
    assert message.mass_scope == pb.MASS_SCOPE_UNSPECIFIED
    assert not message.HasField("mass_target") and not message.HasField("min_pages")
    assert len(message.mass_layers) == 0


def test_mass_layers_go_on_the_wire_one_setting_per_layer_in_order() -> None:
    layers = [MassSetting(target=0.9, temperature=0.5, min_pages=1, max_pages=8),
              MassSetting(target=0.6)]
    message = SelectOptions(budget="mass", mass_layers=layers).to_proto()
    assert [m.target for m in message.mass_layers] == pytest.approx([0.9, 0.6])
    assert [m.temperature for m in message.mass_layers] == pytest.approx([0.5, 1.0])
    assert [(m.min_pages, m.max_pages) for m in message.mass_layers] == [(1, 8), (0, 0)]
    back = SelectOptions.from_proto(message).mass_layers
    assert [m.target for m in back] == pytest.approx([0.9, 0.6])
    assert back[0] == MassSetting(target=back[0].target, temperature=0.5, min_pages=1, max_pages=8)
    assert back[1] == MassSetting(target=back[1].target)


def test_mass_layers_given_as_a_list_are_kept_as_a_tuple_so_options_stay_hashable() -> None:
    options = SelectOptions(mass_layers=[MassSetting(target=0.9)])
    assert options.mass_layers == (MassSetting(target=0.9),)
    assert hash(options) == hash(SelectOptions(mass_layers=(MassSetting(target=0.9),)))


def test_an_unknown_method_is_refused_with_the_known_names() -> None:
    with pytest.raises(ValueError, match="questclt"):
        SelectOptions(method="questbound").to_proto()  # type: ignore[arg-type]


def test_an_unknown_mass_scope_is_refused_with_the_known_names() -> None:
    with pytest.raises(ValueError, match="'head', 'list'"):
        SelectOptions(budget="mass", mass_scope="layer").to_proto()  # type: ignore[arg-type]


@pytest.mark.parametrize(("fields", "error", "message"), [
    ({"top_pages": -1}, ValueError, "SelectOptions.top_pages=-1 is not in [0, 4294967295]"),
    ({"first_n": 2**32}, ValueError, "SelectOptions.first_n=4294967296 is not in"),
    ({"top_pages": 1.5}, TypeError, "SelectOptions.top_pages=1.5 is not an integer"),
    ({"last_n": True}, TypeError, "SelectOptions.last_n=True is a bool"),
    ({"alpha": "x"}, TypeError, "SelectOptions.alpha='x' is not a number"),
    ({"alpha": float("nan")}, ValueError, "SelectOptions.alpha=nan is not a finite float32"),
    ({"top_p": 1e39}, ValueError, "SelectOptions.top_p=1e+39 is not a finite float32"),
    ({"strict": "no"}, TypeError, "SelectOptions.strict='no' is not a bool"),
    ({"method": 1}, TypeError, "SelectOptions.method=1 is not a str"),
    ({"budget": "Fixed"}, ValueError, "SelectOptions.budget='Fixed' is not one of"),
    ({"retrieval_heads": None}, TypeError, "SelectOptions.retrieval_heads=None is not bytes"),
    ({"retrieval_heads": [1, 0]}, TypeError, "SelectOptions.retrieval_heads=[1, 0] is not"),
    ({"mass_layers": None}, TypeError, "SelectOptions.mass_layers=None is not a sequence"),
    ({"mass_layers": [None]}, TypeError, "SelectOptions.mass_layers[0]=None is not a Mass"),
])
def test_a_bad_field_is_refused_at_construction_naming_it(fields, error, message) -> None:
    with pytest.raises(error) as e:
        SelectOptions(**fields)
    assert message in str(e.value)


@pytest.mark.parametrize(("fields", "error", "message"), [
    ({"target": None}, TypeError, "MassSetting.target=None is not a number"),
    ({"target": 0.9, "temperature": float("inf")}, ValueError, "MassSetting.temperature=inf"),
    ({"target": 0.9, "min_pages": -1}, ValueError, "MassSetting.min_pages=-1 is not in"),
    ({"target": 0.9, "max_pages": 2.0}, TypeError, "MassSetting.max_pages=2.0 is not an int"),
])
def test_a_bad_mass_setting_is_refused_at_construction_naming_it(fields, error, message) -> None:
    with pytest.raises(error) as e:
        MassSetting(**fields)
    assert message in str(e.value)


# The float32 field carries the value rounded; epsd checks that against the interval. A value
# rounding moves across an end was sent as one the caller never gave (top_p=1e-46 reached
# epsd as 0 and was refused as "top_p=0 not in (0, 1]") or taken though outside (alpha just
# under 1 reached epsd as 1).
@pytest.mark.parametrize(("fields", "message"), [
    ({"top_p": 1e-46}, "SelectOptions.top_p=1e-46 is in (0, 1], but the float32 field sends it "
                       "as 0.0, which is not in (0, 1]"),
    ({"top_p": 1.00000001}, "SelectOptions.top_p=1.00000001 is not in (0, 1], but the float32 "
                            "field sends it as 1.0, which is in (0, 1]"),
    ({"mass_target": 1e-50}, "SelectOptions.mass_target=1e-50 is in (0, 1], but the float32 "
                             "field sends it as 0.0, which is not in"),
    ({"mass_temperature": 1000.00001}, "SelectOptions.mass_temperature=1000.00001 is not in "
                                       "(0, 1000], but the float32 field sends it as 1000.0"),
    ({"alpha": 0.99999999}, "SelectOptions.alpha=0.99999999 is not in [1, 1e+06], but the "
                            "float32 field sends it as 1.0, which is in"),
    ({"coarse_candidates": 1024.00001}, "SelectOptions.coarse_candidates=1024.00001 is not in "
                                        "[1, 1024], but the float32 field sends it as 1024.0"),
])
def test_a_value_float32_rounding_moves_across_its_interval_is_refused_naming_both(
        fields, message) -> None:
    with pytest.raises(ValueError) as e:
        SelectOptions(**fields)
    assert message in str(e.value)


def test_a_mass_setting_float32_rounding_moves_across_its_interval_is_refused() -> None:
    with pytest.raises(ValueError, match=r"MassSetting.target=1e-46 is in \(0, 1\], but the "
                                         r"float32 field sends it as 0.0"):
        MassSetting(target=1e-46)
    with pytest.raises(ValueError, match=r"MassSetting.temperature=1e-46 is in \(0, 1000\]"):
        MassSetting(target=0.9, temperature=1e-46)


def test_values_rounding_keeps_on_their_side_are_sent_for_epsd_to_judge() -> None:
    # Inside both ways (the smallest float32 above 0 included), and outside both ways: epsd
    # refuses the latter itself, naming the value it received, which is the one given.
    tiny = float(np.nextafter(np.float32(0), np.float32(1)))
    message = SelectOptions(top_p=tiny, alpha=1.0, mass_temperature=1000.0,
                            coarse_candidates=1.0).to_proto()
    assert message.top_p == tiny and message.alpha == 1.0
    assert SelectOptions(top_p=0.0).to_proto().top_p == 0.0
    assert SelectOptions(alpha=0.5).to_proto().alpha == 0.5
    assert MassSetting(target=1.5).to_proto().target == 1.5


def test_numpy_numbers_are_taken_as_plain_ones_and_none_stays_unset() -> None:
    options = SelectOptions(top_pages=np.int64(3), alpha=np.float32(0.5), strict=np.bool_(True),
                            retrieval_heads=bytearray(b"\x01\x00"),
                            mass_layers=[MassSetting(np.float64(0.9), max_pages=np.uint32(4))])
    assert type(options.top_pages) is int and type(options.alpha) is float
    assert options.strict is True and options.retrieval_heads == b"\x01\x00"
    assert options == SelectOptions(top_pages=3, alpha=0.5, strict=True, retrieval_heads=b"\x01\0",
                                    mass_layers=(MassSetting(0.9, max_pages=4),))
    message = options.to_proto()
    assert message.top_pages == 3 and not message.HasField("first_n")
    # the server's intervals (p in (0, 1], top_pages against the session) stay epsd's
    assert SelectOptions(mass_target=2.0, top_pages=10**6).to_proto().mass_target == 2.0


@pytest.mark.parametrize(("fields", "error", "message"), [
    ({"deadline_s": None}, TypeError, "ClientOptions.deadline_s=None is not a number"),
    ({"deadline_s": -1.0}, ValueError, "ClientOptions.deadline_s=-1.0 must be in (0, 3600]"),
    ({"deadline_s": 0}, ValueError, "ClientOptions.deadline_s=0.0 must be in (0, 3600]"),
    # gRPC's deadline arithmetic failed every attach from about 8e9 s, and the stream's
    # wait raised OverflowError out of select_pages at 1e10: past an hour is refused
    ({"deadline_s": 1e10}, ValueError, "ClientOptions.deadline_s=10000000000.0 must be in"),
    ({"attach_deadline_s": 3600.5}, ValueError, "ClientOptions.attach_deadline_s=3600.5"),
    ({"reattach_backoff_s": 1e6}, ValueError, "reattach_backoff_s=1000000.0 must be in [0, 3600]"),
    ({"deadline_s": float("inf")}, ValueError, "ClientOptions.deadline_s=inf"),
    ({"attach_deadline_s": float("nan")}, ValueError, "ClientOptions.attach_deadline_s=nan"),
    ({"reattach_backoff_s": -0.1}, ValueError, "ClientOptions.reattach_backoff_s=-0.1 must be"),
    ({"target": None}, TypeError, "ClientOptions.target=None"),
    ({"target": ""}, TypeError, "ClientOptions.target=''"),
    ({"fail_open": "yes"}, TypeError, "ClientOptions.fail_open='yes' is not a bool"),
    ({"traceparent": "00-abc\n-01"}, ValueError, "is not a W3C traceparent"),
    ({"traceparent": 5}, TypeError, "ClientOptions.traceparent=5"),
    ({"on_fallback": 5}, TypeError, "ClientOptions.on_fallback=5 is not callable"),
])
def test_client_options_a_client_cannot_run_with_are_refused(fields, error, message) -> None:
    with pytest.raises(error) as e:
        ClientOptions(**fields)
    assert message in str(e.value)


def test_valid_client_options_are_kept() -> None:
    tp = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    options = ClientOptions(deadline_s=1, reattach_backoff_s=0, traceparent=tp)
    assert options.deadline_s == 1.0 and options.traceparent == tp
    assert ClientOptions(attach_deadline_s=3600).attach_deadline_s == 3600.0
    assert valid_traceparent(tp) and not valid_traceparent(tp.upper())
    assert not valid_traceparent("00-" + "0" * 32 + "-b7ad6b7169203331-01")
    assert not valid_traceparent("ff" + tp[2:]) and not valid_traceparent(tp + "-x")
    assert valid_traceparent("01" + tp[2:] + "-later")


@pytest.mark.parametrize(("name", "value", "error", "message"), [
    ("deadline_s", None, TypeError, "ClientOptions.deadline_s=None is not a number"),
    ("deadline_s", 1e10, ValueError, "ClientOptions.deadline_s=10000000000.0 must be in"),
    ("use_stream", 1, TypeError, "ClientOptions.use_stream=1 is not a bool"),
    ("on_fallback", 5, TypeError, "ClientOptions.on_fallback=5 is not callable"),
    ("target", None, TypeError, "ClientOptions.target=None"),
])
def test_client_options_are_checked_when_a_field_is_set_later(name, value, error,
                                                               message) -> None:
    # They were checked at construction only: deadline_s = None set afterwards reached
    # select_pages, which raised TypeError out of a fail-open step.
    options = ClientOptions()
    before = getattr(options, name)
    with pytest.raises(error) as e:
        setattr(options, name, value)
    assert message in str(e.value)
    assert getattr(options, name) == before  # the old value is kept


def test_client_options_take_a_checked_value_and_refuse_a_name_that_is_no_field() -> None:
    options = ClientOptions()
    options.deadline_s = 2  # type: ignore[assignment]
    assert options.deadline_s == 2.0 and type(options.deadline_s) is float
    with pytest.raises(AttributeError, match="ClientOptions has no field 'deadline'"):
        options.deadline = 0.05  # type: ignore[attr-defined]


def test_client_options_defaults_are_the_documented_ones(monkeypatch) -> None:
    # docs/integration/python-client.md, "Defaults"; api-failures.md §5.4 names the back-off.
    monkeypatch.delenv("EPS_TARGET", raising=False)
    o = ClientOptions()
    assert (o.target, o.deadline_s, o.attach_deadline_s, o.reattach_backoff_s) == (
        "unix:///tmp/epsd.sock", 0.100, 0.5, 0.05)
    assert (o.fail_open, o.use_stream, o.traceparent, o.on_fallback) == (True, True, None, None)
    monkeypatch.setenv("EPS_TARGET", "unix:///run/eps/epsd.sock")
    assert ClientOptions().target == "unix:///run/eps/epsd.sock"


def test_an_eps_error_survives_pickling_and_copying_with_its_code_and_message() -> None:
    # A failed call raised in a worker process crosses to the parent by pickling (a
    # ProcessPoolExecutor, multiprocessing); EpsError could not be rebuilt from its args.
    import copy
    import pickle

    import grpc

    from eps_client import EpsError

    error = EpsError(grpc.StatusCode.NOT_FOUND, "session s-1 is not attached")
    for again in (pickle.loads(pickle.dumps(error)), copy.copy(error)):
        assert type(again) is EpsError
        assert (again.code, again.message, str(again)) == (error.code, error.message,
                                                           str(error))
