"""The protocol dataclasses to and from their protobuf messages, field by field, by name.

No generated stubs are imported here: messages are passed in and read through their
descriptor, so the server and `trainer_bridge` share one codec and neither mirrors a type.
The rules: an unset proto3 `optional` scalar is the dataclass default (None for optional
fields), repeated fields are lists (an empty one is None where the dataclass default is
None; repeated messages are lists of dataclasses), maps are dicts, nested messages are
dataclasses, and an unset nested message is the dataclass default.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from typing import Any, TypeVar

_T = TypeVar("_T")


def to_message(obj: Any, message: Any) -> Any:
    """Fill `message` (a protobuf message) from dataclass `obj`; returns `message`."""
    fields = message.DESCRIPTOR.fields_by_name
    for field in _wire_fields(obj):
        value = getattr(obj, field.name)
        descriptor = fields[field.name]
        if value is None:
            continue  # unset: the receiver takes its default
        target = getattr(message, field.name) if descriptor.is_repeated else None
        if _is_map(descriptor):
            for key, item in value.items():
                if dataclasses.is_dataclass(item):
                    to_message(item, target[key])
                else:
                    target[key] = item
        elif descriptor.is_repeated and descriptor.message_type is not None:
            for item in value:
                to_message(item, target.add())
        elif descriptor.is_repeated:
            target.extend(value)
        elif descriptor.message_type is not None:
            to_message(value, getattr(message, field.name))
        else:
            setattr(message, field.name, value)
    return message


def from_message(message: Any, cls: type[_T]) -> _T:
    """A `cls` (a protocol dataclass) from a protobuf message; `cls` validates the values."""
    fields = message.DESCRIPTOR.fields_by_name
    hints = _type_hints(cls)
    kwargs: dict[str, Any] = {}
    for field in _wire_fields(cls):
        descriptor = fields[field.name]
        if descriptor.has_presence and not message.HasField(field.name):
            continue  # an unset optional scalar or nested message
        value = getattr(message, field.name)
        if _is_map(descriptor):
            item_cls = typing.get_args(hints[field.name])[1]
            is_nested = dataclasses.is_dataclass(item_cls)
            value = {k: from_message(v, item_cls) if is_nested else v for k, v in value.items()}
        elif descriptor.is_repeated:
            if not value and field.default is None:
                continue
            if descriptor.message_type is not None:
                item_cls = typing.get_args(_without_none(hints[field.name]))[0]
                value = [from_message(item, item_cls) for item in value]
            else:
                value = list(value)
        elif descriptor.message_type is not None:
            value = from_message(value, _without_none(hints[field.name]))
        kwargs[field.name] = value
    return cls(**kwargs)


def _wire_fields(obj_or_cls: Any) -> list[dataclasses.Field]:
    """The fields that travel: not those marked `metadata={"wire": False}` (views built on
    one side, such as a parsed chat message)."""
    return [f for f in dataclasses.fields(obj_or_cls) if f.metadata.get("wire", True)]


def _is_map(descriptor: Any) -> bool:
    message_type = descriptor.message_type
    return message_type is not None and message_type.GetOptions().map_entry


def _without_none(hint: Any) -> Any:
    """`X` of `X | None`; other hints (`list[X]` included) as they are."""
    if typing.get_origin(hint) not in (typing.Union, types.UnionType):
        return hint
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if len(args) == 1 else hint


@functools.cache
def _type_hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)
