"""Reading JSON documents strictly: one parser and one schema check for every JSON input.

Every JSON document a user gives meshplan (a ModelSpec JSON or HF ``config.json``, a cluster, a
calibration, a plan file; the runtime's run reports and job descriptions) is read with
``load_json_document`` (a file) or ``parse_json_document`` (text) and checked against a
``Schema`` with ``check_object``. A schema is derived from the dataclass the document builds
(``schema_of``: keys are the field names, JSON types come from the field annotations, required
keys are the fields without a default), plus the named ``Limit`` of each value that has one.

Each problem is one line of ``ValueError``: the document (``origin``), the key, and what would
be accepted, e.g. ``model.json: 'num_layers': 1e+30 is not accepted; num_layers must be a
positive integer up to 4096 (MAX_LAYERS)``. What is checked:

* the text is JSON (Python's ``json`` also reads ``NaN``, ``Infinity`` and numbers that
  overflow to infinity; those are refused, naming the key), the document is one object, no
  object repeats a key;
* unknown keys (unless the schema tolerates extras, as an HF ``config.json`` must) and missing
  required keys, named;
* JSON types: a string where a number goes, a fraction where an integer goes, ``true`` where a
  number goes (``bool`` is an ``int`` in Python, never here);
* values: the ``Limit`` of each key (``> 0`` for sizes, a named upper bound on counts, a set of
  choices).

Checks that relate several keys (heads divide the width, a plan's degrees match its GPUs) stay
in the dataclasses' ``__post_init__`` and in the readers that build them.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import types
import typing
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Literal

Kind = Literal["int", "float", "bool", "str", "list", "object", "union", "any"]
MAX_SHOWN_CHARS = 60
"""An offending value longer than this (as ``repr``) is cut in messages (keeps them one line)."""


# ----- schemas -----------------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class Limit:
    """The values a number or string may take, with the name of the bound for messages."""

    minimum: float | None = None
    maximum: float | None = None
    exclusive_minimum: bool = False
    """``minimum`` itself is refused (``> 0`` rather than ``>= 0``)."""
    name: str = ""
    """Name of the upper bound's constant (``MAX_LAYERS``), shown next to it."""
    choices: tuple[Any, ...] = ()
    """The only values accepted, when given."""


POSITIVE = Limit(minimum=0, exclusive_minimum=True)
"""A size, a bandwidth, a rate: > 0."""
NON_NEGATIVE = Limit(minimum=0)
"""A latency, an overhead, a byte count that may be zero: >= 0."""
FRACTION = Limit(minimum=0, maximum=1)
"""An overlap or a probability: in [0, 1]."""
EFFICIENCY = Limit(minimum=0, exclusive_minimum=True, maximum=1)
"""An achieved fraction of a peak: in (0, 1]."""


def count(maximum: int, name: str) -> Limit:
    """A positive integer up to ``maximum`` (the constant called ``name``)."""
    return Limit(minimum=1, maximum=maximum, name=name)


@dataclass(frozen=True, kw_only=True)
class Rule:
    """What one JSON value may be."""

    kind: Kind
    nullable: bool = False
    limit: Limit = Limit()
    items: "Rule | None" = None
    """Rule of each item of a list, or of each value of an object used as a map."""
    keys: tuple[str, ...] = ()
    """The keys a map (object with ``items``) may have; any when empty."""
    schema: "Schema | None" = None
    """Fixed keys of an object (a nested dataclass)."""
    alternatives: tuple["Rule", ...] = ()
    """For ``union``: the value matches one of these."""
    item_label: str = ""
    """For a list of objects with a ``schema``: problems inside item i are reported as
    ``<origin>: <item_label> i: ...`` rather than by a key path."""


@dataclass(frozen=True, kw_only=True)
class Schema:
    """The keys of one JSON object and the rule of each."""

    name: str
    """What the object is (``ModelSpec``, ``plan file``), for messages."""
    rules: Mapping[str, Rule]
    required: frozenset[str]
    extra_keys: bool = False
    """Tolerate keys without a rule (HF ``config.json``, the ``predicted`` estimate document)."""
    cls: type | None = None
    """The dataclass the schema was derived from; an instance of it passes as already checked."""

    def replace(self, **changes: Any) -> "Schema":
        return dataclasses.replace(self, **changes)


def schema_of(cls: type, *, name: str | None = None, limits: Mapping[str, Limit] | None = None,
              rules: Mapping[str, Rule] | None = None, required: Iterable[str] | None = None,
              exclude: Iterable[str] = (), extra_keys: bool = False) -> Schema:
    """The schema of a JSON object holding the fields of the dataclass ``cls``.

    Each field's rule comes from its annotation (``int``, ``float``, ``bool``, ``str``,
    ``Literal[...]`` as choices, ``X | None`` as nullable, ``tuple[X, ...]`` and ``list[X]`` as
    lists, ``dict[str, X]`` as maps, a dataclass as a nested object), narrowed by ``limits``
    (for a list or map: of its items). ``rules`` replaces or adds rules (keys that are no field,
    like a plan file's ``schema_version``). Required keys are the fields without a default
    unless ``required`` lists them; ``exclude`` leaves fields out.
    """
    hints = typing.get_type_hints(cls)
    limits, rules = dict(limits or {}), dict(rules or {})
    skip = set(exclude)
    derived: dict[str, Rule] = {}
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        rule = rules.pop(f.name, None) or rule_of_type(hints[f.name])
        derived[f.name] = with_limit(rule, limits.pop(f.name)) if f.name in limits else rule
    derived.update(rules)
    unused = sorted(set(limits) - set(derived))
    if unused:
        raise TypeError(f"schema_of({cls.__name__}): limits for unknown keys {unused}")
    if required is None:
        required = [f.name for f in dataclasses.fields(cls) if f.name not in skip
                    and f.default is dataclasses.MISSING
                    and f.default_factory is dataclasses.MISSING]
    return Schema(name=name or cls.__name__, rules=derived, required=frozenset(required),
                  extra_keys=extra_keys, cls=cls)


def rule_of_type(hint: Any) -> Rule:
    """The rule of a JSON value holding a Python value of type ``hint`` (see ``schema_of``)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        options = [a for a in args if a is not type(None)]
        nullable = len(options) < len(args)
        if len(options) == 1:
            return dataclasses.replace(rule_of_type(options[0]), nullable=nullable)
        return Rule(kind="union", nullable=nullable,
                    alternatives=tuple(rule_of_type(a) for a in options))
    if origin is Literal:
        kinds = {rule_of_type(type(a)).kind for a in args}
        if len(kinds) != 1:
            raise TypeError(f"no JSON rule for mixed Literal {hint!r}")
        return Rule(kind=kinds.pop(), limit=Limit(choices=tuple(args)))
    if origin in (tuple, list):
        if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):
            raise TypeError(f"no JSON rule for fixed-length {hint!r}; use tuple[X, ...]")
        return Rule(kind="list", items=rule_of_type(args[0]))
    if origin is dict:
        return Rule(kind="object", items=rule_of_type(args[1]))
    if hint is Any:
        return Rule(kind="any")
    if dataclasses.is_dataclass(hint):
        return Rule(kind="object", schema=schema_of(hint))
    simple = {bool: "bool", int: "int", float: "float", str: "str", dict: "object",
              list: "list"}
    if hint in simple:
        return Rule(kind=simple[hint])
    raise TypeError(f"no JSON rule for the type {hint!r}")


def with_limit(rule: Rule, limit: Limit) -> Rule:
    """``rule`` with ``limit`` on its value, or on its items for a list or a map."""
    if rule.kind in ("list", "object") and rule.items is not None:
        return dataclasses.replace(rule, items=with_limit(rule.items, limit))
    if rule.kind == "union":
        return dataclasses.replace(rule, alternatives=tuple(with_limit(a, limit)
                                                            for a in rule.alternatives))
    return dataclasses.replace(rule, limit=limit)


# ----- checking ----------------------------------------------------------------------------------

def check_object(data: Any, schema: Schema, *, origin: str, path: str = "") -> None:
    """ValueError (one line, starting ``origin: ``) unless ``data`` is an object of ``schema``.

    ``path`` is where the object sits in its document (``gpu``, ``predicted.memory``); empty
    for the document itself.
    """
    where = f" in {path}" if path else ""
    if not isinstance(data, Mapping):
        raise ValueError(f"{origin}: expected a JSON object{where} ({schema.name}), got "
                         f"{_json_type(data)}")
    if not schema.extra_keys:
        unknown = sorted((k for k in data if k not in schema.rules), key=str)
        if unknown:
            raise ValueError(f"{origin}: unknown {schema.name} key(s) {unknown}{where}; "
                             f"accepted keys: {', '.join(schema.rules)}")
    missing = [k for k in schema.rules if k in schema.required and k not in data]
    if missing:
        required = [k for k in schema.rules if k in schema.required]
        raise ValueError(f"{origin}: missing required {schema.name} key(s) {missing}{where}; "
                         f"required: {', '.join(required)}")
    for key, rule in schema.rules.items():
        if key in data:
            check_value(data[key], rule, origin=origin, path=f"{path}.{key}" if path else key)


def check_value(value: Any, rule: Rule, *, origin: str, path: str) -> None:
    """ValueError naming ``origin``, ``path`` and what ``rule`` accepts, unless ``value`` fits."""
    if value is None:
        if not rule.nullable:
            _refuse(value, rule, origin=origin, path=path)
        return
    if rule.kind == "union":
        for alternative in rule.alternatives:
            if _fits(value, alternative):
                check_value(value, alternative, origin=origin, path=path)
                return
        _refuse(value, rule, origin=origin, path=path)
    if rule.kind == "any":
        return
    if not _is_kind(value, rule):
        _refuse(value, rule, origin=origin, path=path)
    if rule.kind == "list":
        _check_items(value, rule, origin=origin, path=path)
    elif rule.kind == "object":
        _check_members(value, rule, origin=origin, path=path)
    elif not _within(value, rule.limit):
        _refuse(value, rule, origin=origin, path=path)


def _check_items(value: list, rule: Rule, *, origin: str, path: str) -> None:
    if rule.items is None:
        return
    for index, item in enumerate(value):
        if rule.item_label and rule.items.schema is not None:
            if not _is_instance(item, rule.items.schema):
                check_object(item, rule.items.schema, origin=f"{origin}: {rule.item_label} "
                                                             f"{index}")
        else:
            check_value(item, rule.items, origin=origin, path=f"{path}[{index}]")


def _check_members(value: Mapping, rule: Rule, *, origin: str, path: str) -> None:
    if rule.schema is not None:
        if not _is_instance(value, rule.schema):
            check_object(value, rule.schema, origin=origin, path=path)
        return
    if rule.items is None:
        return
    for key, item in value.items():
        if not isinstance(key, str) or (rule.keys and key not in rule.keys):
            accepted = (f"one of {', '.join(json.dumps(k) for k in rule.keys)}" if rule.keys
                        else "a string")
            raise ValueError(f"{origin}: key {key!r} in {path} is not accepted; each key of "
                             f"{path} must be {accepted}")
        check_value(item, rule.items, origin=origin, path=f"{path}.{key}")


def _is_instance(value: Any, schema: Schema) -> bool:
    return schema.cls is not None and isinstance(value, schema.cls)


def _is_kind(value: Any, rule: Rule) -> bool:
    if rule.kind == "bool":
        return isinstance(value, bool)
    if rule.kind == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    if rule.kind == "float":
        return (isinstance(value, (int, float)) and not isinstance(value, bool)
                and math.isfinite(value))
    if rule.kind == "str":
        return isinstance(value, str)
    if rule.kind == "list":
        return isinstance(value, (list, tuple))
    if rule.kind == "object":
        return isinstance(value, Mapping) or (rule.schema is not None
                                              and _is_instance(value, rule.schema))
    return True


def _fits(value: Any, rule: Rule) -> bool:
    """``value`` has the JSON type of ``rule`` (a union picks the alternative to check)."""
    return (value is None and rule.nullable) or _is_kind(value, rule)


def _within(value: Any, limit: Limit) -> bool:
    if limit.choices and value not in limit.choices:
        return False
    if limit.minimum is not None and (value < limit.minimum or
                                      (limit.exclusive_minimum and value == limit.minimum)):
        return False
    return limit.maximum is None or value <= limit.maximum


def _refuse(value: Any, rule: Rule, *, origin: str, path: str) -> typing.NoReturn:
    raise ValueError(f"{origin}: {path!r}: {_shown(value)} is not accepted; {path} must be "
                     f"{describe(rule)}")


def describe(rule: Rule) -> str:
    """What ``rule`` accepts, in words (``a positive integer up to 4096 (MAX_LAYERS)``)."""
    text = _describe(rule)
    return f"null or {text}" if rule.nullable else text


def _describe(rule: Rule) -> str:
    limit = rule.limit
    if rule.kind == "union":
        return " or ".join(_describe(a) for a in rule.alternatives)
    if limit.choices:
        return f"one of {', '.join(json.dumps(c) for c in limit.choices)}"
    if rule.kind == "bool":
        return "true or false"
    if rule.kind == "str":
        return "a string"
    if rule.kind == "any":
        return "any JSON value"
    if rule.kind == "list":
        return "a list" + (f", each item {describe(rule.items)}" if rule.items else "")
    if rule.kind == "object":
        if rule.schema is not None:
            return f"an object with the {rule.schema.name} keys"
        return "an object" + (f", each value {describe(rule.items)}" if rule.items else "")
    return _describe_number(rule.kind, limit)


def _describe_number(kind: str, limit: Limit) -> str:
    noun = "an integer" if kind == "int" else "a number"
    low, high = limit.minimum, limit.maximum
    if kind == "int" and low in (0, 1) and limit.exclusive_minimum == (low == 0):
        text = "a positive integer"
    elif low is not None and high is not None:
        return (f"{noun} in {'(' if limit.exclusive_minimum else '['}{_number(low)}, "
                f"{_number(high)}]" + (f" ({limit.name})" if limit.name else ""))
    elif low is not None:
        text = f"{noun} {'>' if limit.exclusive_minimum else '>='} {_number(low)}"
    else:
        text = "an integer" if kind == "int" else "a finite number"
    if high is not None:
        text += f" up to {_number(high)}" + (f" ({limit.name})" if limit.name else "")
    return text


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() and abs(value) < 1e16 else repr(value)


def _shown(value: Any) -> str:
    """``value`` as a message shows it: ``repr``, with JSON's spelling of true, false, null."""
    text = {True: "true", False: "false"}[value] if isinstance(value, bool) else \
        "null" if value is None else repr(value)
    return text if len(text) <= MAX_SHOWN_CHARS else text[:MAX_SHOWN_CHARS - 3] + "..."


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, (list, tuple)):
        return "a list"
    return type(value).__name__


# ----- parsing -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class _NonFinite:
    """A ``NaN``, ``Infinity`` or overflowing number while parsing, kept to name its key."""

    text: str

    def __repr__(self) -> str:
        return self.text


class _DuplicateKey(Exception):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    data: dict[str, Any] = {}
    for key, value in pairs:
        if key in data:
            raise _DuplicateKey(key)
        data[key] = value
    return data


def _parse_float(text: str) -> float | _NonFinite:
    value = float(text)
    return value if math.isfinite(value) else _NonFinite(text)


def parse_json_document(text: str, *, origin: str, schema: Schema | None = None) -> dict[str, Any]:
    """The JSON object in ``text``, checked against ``schema`` when given.

    ValueError (one line, starting ``origin: ``) when ``text`` is not JSON, holds ``NaN`` or
    ``Infinity`` or a number too large for a float, repeats a key in an object, is not an
    object, or does not fit ``schema``.
    """
    try:
        data = json.loads(text, parse_constant=_NonFinite, parse_float=_parse_float,
                          object_pairs_hook=_unique_keys)
    except json.JSONDecodeError as err:
        raise ValueError(f"{origin}: not valid JSON: {err.msg} at line {err.lineno} column "
                         f"{err.colno} (char {err.pos})") from None
    except _DuplicateKey as err:
        raise ValueError(f"{origin}: the key {err.key!r} appears twice in one JSON object; "
                         f"give each key once") from None
    except RecursionError:
        raise ValueError(f"{origin}: not valid JSON for meshplan: nested too deeply") from None
    except ValueError as err:  # int(): an integer literal beyond sys.get_int_max_str_digits()
        if "digits" not in str(err):
            raise
        raise ValueError(f"{origin}: not valid JSON for meshplan: a number has more than "
                         f"{sys.get_int_max_str_digits()} digits") from None
    _refuse_non_finite(data, origin=origin, path="")
    if not isinstance(data, dict):
        raise ValueError(f"{origin}: expected a JSON object, got {type(data).__name__}")
    if schema is not None:
        check_object(data, schema, origin=origin)
    return data


_NON_FINITE_WORDS = ("NaN", "Infinity", "-Infinity")
"""What Python's ``json`` reads as non-finite numbers (``parse_constant``)."""


def _refuse_non_finite(value: Any, *, origin: str, path: str) -> None:
    if isinstance(value, _NonFinite):
        why = ("JSON has no NaN or Infinity" if value.text in _NON_FINITE_WORDS
               else "it is beyond the largest float")
        raise ValueError(f"{origin}: {path or 'the document'!r}: {value.text} is not accepted; "
                         f"{path or 'the document'} must be a finite number ({why})")
    if isinstance(value, dict):
        for key, item in value.items():
            _refuse_non_finite(item, origin=origin, path=f"{path}.{key}" if path else key)
    elif isinstance(value, list):
        for index, item in enumerate(value):
            _refuse_non_finite(item, origin=origin, path=f"{path}[{index}]")


def load_json_document(path: str | Path, *, what: str,
                       schema: Schema | None = None) -> dict[str, Any]:
    """The JSON object in the file ``path``, parsed and checked as ``parse_json_document``
    does; messages start with the file name (``what``, e.g. ``cluster`` or ``run report``,
    names the kind of file when it does not exist)."""
    file = Path(path)
    if file.is_dir():
        raise ValueError(f"{what} file {str(path)!r} is a directory; give a JSON file")
    if not file.is_file():
        raise ValueError(f"{what} file {str(path)!r} does not exist")
    return parse_json_document(file.read_text(encoding="utf-8"), origin=str(path),
                               schema=schema)


def read_package_json(name: str) -> dict[str, Any]:
    """A data file shipped in ``costmodel/data``, strictly parsed."""
    text = resources.files("meshplan.costmodel.data").joinpath(name).read_text(encoding="utf-8")
    return parse_json_document(text, origin=f"costmodel/data/{name}")
