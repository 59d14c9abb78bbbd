"""The ``TrackableObjectGraph`` saved under ``_CHECKPOINTABLE_OBJECT_GRAPH``.

``tf.train.Checkpoint.restore`` matches live objects to saved values by walking this graph from
the root: each node lists its children by local name, its saved tensors (attributes, with the
bundle key of each), and, for an optimizer, its slot variables. Only the messages and fields a
bundle needs are coded here (field numbers from TensorFlow's ``trackable_object_graph.proto``):

- ``TrackableObjectGraph``: nodes=1.
- ``TrackableObject``: children=1 (``ObjectReference``: node_id=1, local_name=2),
  attributes=2 (``SerializedTensor``: name=1, full_name=2, checkpoint_key=3),
  slot_variables=3 (``SlotVariableReference``: original_variable_node_id=1, slot_name=2,
  slot_variable_node_id=3), registered_saver=4 (kept as raw bytes),
  has_checkpoint_values=5 (``google.protobuf.BoolValue``: value=1).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from ._proto import (
    _ONE_BYTE,
    DecodeError,
    as_int32,
    encode_varint,
    expect_bytes,
    expect_int,
    field_bytes,
    field_varint,
    iter_fields,
)

__all__ = [
    "ObjectReference",
    "SerializedTensor",
    "SlotVariableReference",
    "TrackableObject",
    "encode_graph",
    "encode_node",
    "encode_nodes",
    "decode_graph",
]


@dataclass(frozen=True)
class ObjectReference:
    node_id: int
    local_name: str


@dataclass(frozen=True)
class SerializedTensor:
    name: str
    full_name: str
    checkpoint_key: str


@dataclass(frozen=True)
class SlotVariableReference:
    original_variable_node_id: int
    slot_name: str
    slot_variable_node_id: int


@dataclass
class TrackableObject:
    children: list[ObjectReference] = field(default_factory=list)
    attributes: list[SerializedTensor] = field(default_factory=list)
    slot_variables: list[SlotVariableReference] = field(default_factory=list)
    registered_saver: bytes | None = None
    has_checkpoint_values: bool | None = True


def _text(data: bytes) -> str:
    return data.decode("utf-8", "surrogateescape")


def _enc(text: str) -> bytes:
    return text.encode("utf-8", "surrogateescape")


def _str_field(num: int, text: str) -> bytes:
    return field_bytes(num, _enc(text)) if text else b""


def _length(n: int) -> bytes:
    """A length's varint (one byte below 128)."""
    return _ONE_BYTE[n] if n < 0x80 else encode_varint(n)


def _int_field(num: int, value: int) -> bytes:
    return field_varint(num, value) if value else b""


def encode_node(
    children: Iterable[tuple[int, str]],
    attributes: Iterable[tuple[str, str, str | bytes]],
    slot_variables: Iterable[tuple[int, str, int]] = (),
    registered_saver: bytes | None = None,
    has_checkpoint_values: bool | None = True,
) -> bytes:
    """One serialized ``TrackableObject`` (fields in number order, defaults left out), from
    its children ``(node_id, local_name)``, attributes ``(name, full_name, checkpoint_key)``
    and slot variables ``(original_variable_node_id, slot_name, slot_variable_node_id)``: the
    fields of :class:`TrackableObject` as plain tuples (a writer of many nodes makes no
    message objects; a checkpoint key may come as its UTF-8 bytes already)."""
    # (children and attributes, most of a large graph's fields: their tags written inline,
    # the bytes those of _int_field and _str_field)
    parts = []
    for node_id, local_name in children:
        body = _int_field(1, node_id)
        if local_name:
            raw = local_name.encode("utf-8", "surrogateescape")
            body += b"\x12" + _length(len(raw)) + raw
        parts.append(b"\x0a" + _length(len(body)) + body)
    for name, full_name, key in attributes:
        body = b""
        for tag, text in ((b"\x0a", name), (b"\x12", full_name), (b"\x1a", key)):
            if text:
                raw = text if type(text) is bytes else text.encode("utf-8", "surrogateescape")  # type: ignore[union-attr]
                body += tag + _length(len(raw)) + raw
        parts.append(b"\x12" + _length(len(body)) + body)
    parts += [
        field_bytes(3, _int_field(1, original) + _str_field(2, slot_name) + _int_field(3, slot))
        for original, slot_name, slot in slot_variables
    ]
    if registered_saver is not None:
        parts.append(field_bytes(4, registered_saver))
    if has_checkpoint_values is not None:
        parts.append(field_bytes(5, _int_field(1, int(has_checkpoint_values))))
    return b"".join(parts)


def encode_nodes(nodes: Iterable[bytes]) -> bytes:
    """A serialized ``TrackableObjectGraph`` of nodes serialized by :func:`encode_node`."""
    return b"".join(field_bytes(1, node) for node in nodes)


def encode_graph(nodes: list[TrackableObject]) -> bytes:
    """Serialize a ``TrackableObjectGraph`` (fields in number order, defaults left out)."""
    return encode_nodes(
        encode_node(
            ((ref.node_id, ref.local_name) for ref in node.children),
            ((a.name, a.full_name, a.checkpoint_key) for a in node.attributes),
            (
                (s.original_variable_node_id, s.slot_name, s.slot_variable_node_id)
                for s in node.slot_variables
            ),
            node.registered_saver,
            node.has_checkpoint_values,
        )
        for node in nodes
    )


def _decode_node(data: bytes) -> TrackableObject:
    node = TrackableObject(has_checkpoint_values=None)
    for num, wire, value in iter_fields(data):
        if num == 1:
            node_id, name = 0, ""
            for f, w, v in iter_fields(expect_bytes(num, wire, value)):
                if f == 1:
                    node_id = as_int32(expect_int(f, w, v))
                elif f == 2:
                    name = _text(expect_bytes(f, w, v))
            node.children.append(ObjectReference(node_id, name))
        elif num == 2:
            strings = ["", "", ""]
            for f, w, v in iter_fields(expect_bytes(num, wire, value)):
                if 1 <= f <= 3:
                    strings[f - 1] = _text(expect_bytes(f, w, v))
            node.attributes.append(SerializedTensor(*strings))
        elif num == 3:
            orig, slot_name, slot_id = 0, "", 0
            for f, w, v in iter_fields(expect_bytes(num, wire, value)):
                if f == 1:
                    orig = as_int32(expect_int(f, w, v))
                elif f == 2:
                    slot_name = _text(expect_bytes(f, w, v))
                elif f == 3:
                    slot_id = as_int32(expect_int(f, w, v))
            node.slot_variables.append(SlotVariableReference(orig, slot_name, slot_id))
        elif num == 4:
            node.registered_saver = expect_bytes(num, wire, value)
        elif num == 5:
            flag = False
            for f, w, v in iter_fields(expect_bytes(num, wire, value)):
                if f == 1:
                    flag = bool(expect_int(f, w, v))
            node.has_checkpoint_values = flag
    return node


def decode_graph(data: bytes) -> list[TrackableObject]:
    """Parse a serialized ``TrackableObjectGraph``; raises ``DecodeError`` when malformed.

    Node references (children, slot variables) are checked to point at existing nodes.
    """
    nodes = [
        _decode_node(expect_bytes(num, wire, value))
        for num, wire, value in iter_fields(data)
        if num == 1
    ]
    n = len(nodes)
    for i, node in enumerate(nodes):
        refs = [c.node_id for c in node.children]
        for s in node.slot_variables:
            refs += [s.original_variable_node_id, s.slot_variable_node_id]
        for r in refs:
            if not 0 <= r < n:
                raise DecodeError(f"node {i} refers to node {r}, but the graph has {n} nodes")
    return nodes
