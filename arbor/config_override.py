"""Command-line overrides of a config: ``section.key=value``, with list items by index.

    raw = {"reward": {"functions": [{"fn": "rewards/math.py:boxed_accuracy"}]}}
    apply_override(raw, "run.steps=10", Config)                         # a scalar
    apply_override(raw, "reward.functions[0].fn=my.py:score", Config)   # one key of one item
    apply_override(raw, "reward.functions=[{fn: my.py:score, weight: 1.0}]", Config)  # a whole list

The value is YAML (``10`` is an int, ``[a, b]`` a list, ``{k: v}`` a mapping); the key is
dotted names, where a name may be followed by ``[i]`` to reach a list's item ``i`` (``i``
equal to the list's length adds an item). A list the file does not set is indexed from its
default (``reward.functions[0]`` is the default reward term). A wrong guess, such as
``reward.functions.0.fn`` or a plain string for a list, is a :class:`ConfigError` that shows
the working syntax: :func:`override_syntax`.
"""

from __future__ import annotations

import dataclasses
import json
import re
import typing
from typing import Any

import yaml

from arbor.errors import ConfigError

_PART = re.compile(r"([^.\[\]]+)((?:\[\d+\])*)")  # a name and its [i] indices
_PLAIN = re.compile(r"[\w./:+-]+")  # a string that YAML's flow syntax reads as itself


def key_path(key: str, item: str) -> list[str | int]:
    """``reward.functions[0].fn`` -> ``["reward", "functions", 0, "fn"]``."""
    path: list[str | int] = []
    for part in key.split("."):
        match = _PART.fullmatch(part)
        if match is None:
            raise ConfigError(f"override {item!r}: expected section.key=value (list items as "
                              "section.key[0].field=value)")
        path.append(match.group(1))
        path.extend(int(i) for i in re.findall(r"\d+", match.group(2)))
    return path


def apply_override(raw: dict[str, Any], item: str, schema: type) -> str:
    """Set the value of ``item`` (``key=value``) in ``raw``, the file's mapping; returns the key.

    ``schema`` is the config's dataclass: it gives the default of a list the file leaves out
    and tells a list from a section, so that a wrong guess can be answered with the syntax.
    """
    key, sep, value = item.partition("=")
    if not sep or not key or key.startswith(".") or key.endswith("."):
        raise ConfigError(f"override {item!r}: expected section.key=value")
    try:
        parsed = yaml.safe_load(value) if value.strip() else ""
    except yaml.YAMLError:
        parsed = value  # not YAML: keep the string, the type check decides
    path = key_path(key, item)
    node: Any = raw
    tp: Any = schema
    for i, part in enumerate(path):
        last = i == len(path) - 1
        here = _show_key(path[:i])
        if isinstance(part, int):
            if not isinstance(node, list):
                raise ConfigError(f"override {item!r}: {here} is not a list")
            if part > len(node):
                raise ConfigError(f"override {item!r}: {here} has {len(node)} item(s), so its indices are "
                                  f"0 to {len(node) - 1}; [{len(node)}] adds an item")
            if part == len(node):
                node.append(parsed if last else {})
            elif last:
                node[part] = parsed
            node, tp = node[part], _list_item(tp)
            continue
        if isinstance(node, list) or _is_list(tp):
            raise ConfigError(f"override {item!r}: {here} is a list, not a section; "
                              + _list_advice(here, tp, path[i:], value))
        if not isinstance(node, dict):
            raise ConfigError(f"override {item!r}: {here} is not a section")
        if last:
            node[part] = parsed
            break
        child_tp = _field_type(tp, part)
        if part not in node:
            node[part] = _default(tp, part) if _is_list(child_tp) else {}
        node, tp = node[part], child_tp
    return key


def override_syntax(key: str, tp: Any, given: Any = None) -> str:
    """How to override ``key`` (annotated ``tp``) on the command line, as examples; a string
    the user ``given`` fills the first text field of a record.

        override_syntax("reward.functions", list[RewardTermConfig], "my.py:score")
        # "'reward.functions=[{fn: my.py:score, weight: 1.0}]' (the whole list, YAML flow syntax)
        #  or 'reward.functions[0].fn=my.py:score' (one key of one item)"
    """
    whole, one = _examples(key, tp, given)
    return f"{whole} or {one}"


def _examples(key: str, tp: Any, given: Any = None) -> tuple[str, str]:
    """Two overrides of ``key``: its whole value, and one part of it."""
    item_tp = _list_item(tp)
    if _is_record(item_tp):
        # Its first two keys (reward.functions: fn, weight); the rest keep their defaults.
        example = {f.name: getattr(item_tp(), f.name) for f in dataclasses.fields(item_tp)[:2]}
        first = next(iter(example))
        if isinstance(given, str) and isinstance(example[first], str):
            example[first] = given
        return (f"'{key}=[{_flow(example)}]' (the whole list, YAML flow syntax)",
                f"'{key}[0].{first}={_flow(example[first])}' (one key of one item)")
    if item_tp is not None:
        return f"'{key}=[a, b]' (the whole list, YAML flow syntax; [] for none)", f"'{key}[0]=a' (one item)"
    if _is_record(tp):
        fields = [f.name for f in dataclasses.fields(tp)]
        return f"'{key}={{{', '.join(f'{name}: ...' for name in fields)}}}'", f"'{key}.{fields[0]}=...'"
    return f"'{key}=VALUE'", f"'{key}=VALUE'"


# -- the schema, walked alongside the raw mapping -------------------------------------------


def _field_type(tp: Any, name: str) -> Any:
    """The annotation of field ``name`` of the record ``tp`` (None: unknown, or not a record)."""
    if not _is_record(tp):
        return None
    return typing.get_type_hints(tp).get(name)


def _default(tp: Any, name: str) -> Any:
    """The default of record ``tp``'s field ``name`` as plain data (what the file would hold)."""
    value = getattr(tp(), name)
    if isinstance(value, list):
        return [dataclasses.asdict(v) if dataclasses.is_dataclass(v) and not isinstance(v, type) else v for v in value]
    return value


def _list_item(tp: Any) -> Any:
    """The item type X of ``list[X]`` (also inside a union such as ``list[X] | None``); else None."""
    if typing.get_origin(tp) is list:
        return typing.get_args(tp)[0]
    for arg in typing.get_args(tp) if typing.get_origin(tp) is not None else ():
        if typing.get_origin(arg) is list:
            return typing.get_args(arg)[0]
    return None


def _is_list(tp: Any) -> bool:
    return _list_item(tp) is not None


def _is_record(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _show_key(path: list[str | int]) -> str:
    return "".join(f"[{p}]" if isinstance(p, int) else f"{'.' if i else ''}{p}" for i, p in enumerate(path))


def _list_advice(here: str, tp: Any, rest: list[str | int], value: str) -> str:
    """What to write instead of ``here.rest=value`` (``rest`` starting with a name, not an index)."""
    first = rest[0]
    whole, one = _examples(here, tp, value)
    if isinstance(first, str) and first.isdigit():  # reward.functions.0.fn: the index goes in brackets
        fixed = _show_key([here, int(first), *rest[1:]])
        return f"write '{fixed}={value}' (items are indexed in brackets), or {whole}"
    return f"override it as {whole} or {one}"


def _flow(value: Any) -> str:
    """``value`` in YAML flow syntax without single quotes (the example goes inside them)."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_flow(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(_flow(v) for v in value) + "]"
    if isinstance(value, str):
        return value if _PLAIN.fullmatch(value) else json.dumps(value)
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)
