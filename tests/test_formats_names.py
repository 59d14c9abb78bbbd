"""Name mapping between our slash paths, dotted state-dict names and TF object keys."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from parallelvars.formats import NAME_STYLES, component_key, from_key, parse_component_key, to_key


@pytest.mark.parametrize(
    ("path", "names", "key"),
    [
        ("model/dense/kernel", "slash", "model/dense/kernel"),
        ("model/dense/kernel", "dotted", "model.dense.kernel"),
        ("layers/0/attn/q/weight", "dotted", "layers.0.attn.q.weight"),
        ("model/dense/kernel", "tf", "model/dense/kernel/.ATTRIBUTES/VARIABLE_VALUE"),
        ("save_counter", "tf", "save_counter/.ATTRIBUTES/VARIABLE_VALUE"),
        ("a.b/c", "tf", "a..b/c/.ATTRIBUTES/VARIABLE_VALUE"),
    ],
)
def test_table(path: str, names: str, key: str) -> None:
    assert to_key(path, names) == key
    assert from_key(key, names) == path


@pytest.mark.parametrize(
    ("names", "key"),
    [
        ("slash", "m/w/parallel_component_2"),
        ("dotted", "m.w/parallel_component_2"),
        ("tf", "m/w/.ATTRIBUTES/parallel_component_2"),
    ],
)
def test_component_keys(names: str, key: str) -> None:
    assert component_key("m/w", 2, names) == key
    assert parse_component_key(key, names) == ("m/w", 2)
    assert parse_component_key(to_key("m/w", names), names) == ("m/w", 0)


def test_tf_optimizer_slots() -> None:
    key = to_key("opt/slots/model/w/m", "tf", slot_of="model/w", slot_name="m")
    assert key == "model/w/.OPTIMIZER_SLOT/opt/m/.ATTRIBUTES/VARIABLE_VALUE"
    assert from_key(key, "tf") == "opt/slots/model/w/m"
    # a slot whose path does not follow our convention keeps its own path
    assert (
        to_key("elsewhere/m", "tf", slot_of="model/w", slot_name="m")
        == "elsewhere/m/.ATTRIBUTES/VARIABLE_VALUE"
    )


def test_tf_escapes_and_name_based_keys() -> None:
    assert from_key("a.Sb/.ATTRIBUTES/VARIABLE_VALUE", "tf") == "a/b"
    assert from_key("dense/kernel", "tf") == "dense/kernel"  # TF1 Saver keys
    assert from_key("x/.ATTRIBUTES/OBJECT_CONFIG_JSON", "tf") == "x/OBJECT_CONFIG_JSON"


def test_unknown_style() -> None:
    with pytest.raises(ValueError, match="unknown name style"):
        to_key("a", "camel")


_segment = st.text(alphabet="abcxyz_019-", min_size=1, max_size=6)
_paths = st.lists(_segment, min_size=1, max_size=5).map("/".join)


@given(path=_paths, names=st.sampled_from(NAME_STYLES), component=st.integers(0, 5))
def test_round_trip(path: str, names: str, component: int) -> None:
    key = to_key(path, names, component=component)
    assert parse_component_key(key, names) == (path, component)
    if component == 0:
        assert from_key(key, names) == path


@given(segments=st.lists(st.text(alphabet="ab.", min_size=1, max_size=4), min_size=1, max_size=4))
def test_tf_round_trip_with_dots(segments: list[str]) -> None:
    path = "/".join(segments)
    assert from_key(to_key(path, "tf"), "tf") == path
