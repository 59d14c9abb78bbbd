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


# One definition of component names serves our HDF5 layout, the flat key styles and TF keys.
def test_component_names_are_one_definition() -> None:
    from parallelvars.checkpoint.registry import component_index, component_name
    from parallelvars.formats.testing import component_attribute, parse_key

    assert [component_name(i) for i in range(3)] == [
        "primary", "parallel_component_1", "parallel_component_2"
    ]  # fmt: skip
    for i in range(1, 4):
        assert component_index(component_name(i)) == i
        assert parse_component_key(component_key("m/w", i, "dotted"), "dotted") == ("m/w", i)
        parsed = parse_key(f"m/w/.ATTRIBUTES/{component_attribute(i)}")
        assert parsed is not None and (parsed.path, parsed.component) == ("m/w", i)
    assert component_index("primary") == 0


# The registry's copy took any str.isdigit() tail: "parallel_component_01" was component 1 and
# "parallel_component_\u00b2" raised a bare ValueError; the formats' copies took canonical names only.
@pytest.mark.parametrize(
    "name", ["parallel_component_0", "parallel_component_01", "parallel_component_\u00b2",
             "parallel_component_", "parallel_component_1x", "Primary"]
)  # fmt: skip
def test_non_canonical_component_names_are_not_components(name: str) -> None:
    from parallelvars.checkpoint.registry import component_index

    assert component_index(name) is None
    assert parse_component_key(f"m/w/{name}") == (f"m/w/{name}", 0)
