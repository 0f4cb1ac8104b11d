"""SelectOptions in Python and on the wire: every policy field survives the round trip,
and a name the server does not know is refused before any call."""

from __future__ import annotations

import pytest

from eps_client import SelectOptions
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


def test_an_unknown_method_is_refused_with_the_known_names() -> None:
    with pytest.raises(ValueError, match="questclt"):
        SelectOptions(method="questbound").to_proto()  # type: ignore[arg-type]


def test_an_unknown_mass_scope_is_refused_with_the_known_names() -> None:
    with pytest.raises(ValueError, match="'head', 'list'"):
        SelectOptions(budget="mass", mass_scope="layer").to_proto()  # type: ignore[arg-type]
