"""SelectOptions in Python and on the wire: every policy field survives the round trip,
and a name the server does not know is refused before any call."""

from __future__ import annotations

import pytest

from eps_client import MassSetting, SelectOptions
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
