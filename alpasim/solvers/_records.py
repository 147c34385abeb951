"""Typed, frozen records with a validated JSON form: the pieces a plan is made of.

A plan file is read by other tools and written by older and newer versions of this
one, so its parts are records with named, typed fields rather than string-keyed
dicts: a typo is an AttributeError where it is written, not a `KeyError` (or a silent
`.get` default) far away where it is read. `Record` gives each one

* `to_json()`: the fields by name (nested records, tuples as lists; an optional field
  that is None left out, unless the record sets `omit_none` False), then the keys of
  `extra`, so a file round-trips exactly;
* `from_json(data, where)`: every field checked against its annotation (`int`,
  `float`, `str`, `bool`, `X | None`, `tuple[T, ...]`, fixed tuples, `dict[str, T]`,
  nested records, `Any`), a missing field without a default or a wrong type raising
  `PlanFormatError` with its path (``plan.json: stages[2].time_s: expected a number,
  got 'fast'``), and keys no field names kept in `extra` when the record has one (what
  a newer writer added survives a read and a write), refused otherwise.

Only the annotation is trusted: JSON's integers are accepted where a float is
declared (and converted); booleans are never numbers.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from collections.abc import Mapping
from typing import Any, ClassVar


class PlanFormatError(ValueError):
    """A plan file that is not valid JSON, has the wrong schema or a bad field."""


class Record:
    """Base of the plan's records (module doc). Subclasses are frozen dataclasses; one
    that declares `extra: dict[str, Any]` keeps unknown keys there."""

    __slots__ = ()

    # An optional field (default None) that is None is left out of the JSON, as older
    # files have it; a record whose readers expect every key says False.
    omit_none: ClassVar[bool] = True

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "extra" or (value is None and f.default is None and self.omit_none):
                continue
            out[f.name] = _to_json(value)
        out.update(getattr(self, "extra", {}))
        return out

    @classmethod
    def from_json(cls, data: Any, where: str = "") -> Record:
        where = where or cls.__name__
        here = where.rstrip(":")          # the record's own path in messages (`_join`)
        if not isinstance(data, Mapping):
            raise PlanFormatError(f"{here}: expected a JSON object, got {_shown(data)}")
        hints = _hints(cls)
        kwargs: dict[str, Any] = {}
        names = set()
        for f in dataclasses.fields(cls):
            if f.name == "extra":
                continue
            names.add(f.name)
            if f.name in data:
                kwargs[f.name] = _convert(data[f.name], hints[f.name], _join(where, f.name))
            elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise PlanFormatError(f"{here}: missing field {f.name!r}")
        unknown = {k: v for k, v in data.items() if k not in names}
        if "extra" in hints:
            kwargs["extra"] = unknown
        elif unknown:
            raise PlanFormatError(f"{here}: unknown field {next(iter(unknown))!r}")
        try:
            return cls(**kwargs)
        except (TypeError, ValueError) as e:
            raise PlanFormatError(f"{here}: {e}") from None


def _join(where: str, name: str) -> str:
    """A field's path: ``plan.json: stages[0].time_s`` (a `where` ending in ':' is the file)."""
    return f"{where} {name}" if where.endswith(":") else f"{where}.{name}"


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _to_json(value: Any) -> Any:
    if isinstance(value, Record):
        return value.to_json()
    if isinstance(value, (tuple, list)):
        return [_to_json(v) for v in value]
    if isinstance(value, Mapping):
        return {k: _to_json(v) for k, v in value.items()}
    return value


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _convert(value: Any, hint: Any, where: str) -> Any:
    """`value` (parsed JSON) as `hint` says, or PlanFormatError naming `where`."""
    if hint is Any:
        return value
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None:
            if type(None) in args:
                return None
            raise PlanFormatError(f"{where}: must not be null")
        rest = [a for a in args if a is not type(None)]
        errors = []
        for a in rest:
            try:
                return _convert(value, a, where)
            except PlanFormatError as e:
                errors.append(e)
        raise errors[0]
    if isinstance(hint, type) and issubclass(hint, Record):
        return hint.from_json(value, where)
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise PlanFormatError(f"{where}: expected true or false, got {_shown(value)}")
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise PlanFormatError(f"{where}: expected an integer, got {_shown(value)}")
    if hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise PlanFormatError(f"{where}: expected a number, got {_shown(value)}")
    if hint is str:
        if isinstance(value, str):
            return value
        raise PlanFormatError(f"{where}: expected a string, got {_shown(value)}")
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise PlanFormatError(f"{where}: expected a list, got {_shown(value)}")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_convert(v, args[0], f"{where}[{i}]") for i, v in enumerate(value))
        if len(value) != len(args):
            raise PlanFormatError(f"{where}: expected {len(args)} entries, got {len(value)}")
        return tuple(_convert(v, a, f"{where}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
    if origin in (dict, Mapping, typing.Mapping) or hint is dict:
        if not isinstance(value, Mapping):
            raise PlanFormatError(f"{where}: expected a JSON object, got {_shown(value)}")
        inner = args[1] if len(args) == 2 else Any
        return {str(k): _convert(v, inner, _join(where, str(k))) for k, v in value.items()}
    raise TypeError(f"{where}: no JSON conversion for {hint!r}")
