"""A config file's text to typed dataclasses: YAML with the line of every key, ``section.key=value``
overrides, and a type check of every value against its field's annotation.

    raw, where = read_yaml("configs/math.yaml")      # where("loss.clip_high") -> "configs/math.yaml:41"
    where.add_override(apply_override(raw, "run.steps=10", Config), "run.steps=10")  # arbor.config_override
    cfg = build(Config, raw, "", where)               # arbor.config_load.load_config does these, then validates

Errors are :class:`~arbor.errors.ConfigError` naming the key and ``file:line`` (or the
override); an unknown key suggests the closest known one. Only dataclasses, ``Literal``,
``X | None``, ``list``, ``dict`` and the scalar types are supported: the config's own
annotations (:mod:`arbor.config`).
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml

from arbor.config_override import override_syntax
from arbor.errors import ConfigError

_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")


class KeySources:
    """Where each key came from, for error messages: ``file:line`` or the override.

    A key an override set, or that lies inside one (``reward.functions[0].fn`` inside
    ``reward.functions=[...]``), is the override's; else the line of the key or of the
    nearest enclosing key the file holds.
    """

    def __init__(self, path: str | None) -> None:
        self.path = path or "<defaults>"
        self.lines: dict[str, int] = {}
        self.overrides: dict[str, str] = {}

    def add_override(self, key: str, item: str) -> None:
        """``item`` set ``key``: it replaces what earlier overrides set inside it."""
        for inner in [k for k in self.overrides if key in _enclosing(k)]:
            del self.overrides[inner]
        self.overrides[key] = item

    def override_of(self, key: str) -> str | None:
        """The override that set ``key`` or a key enclosing it (None: none did)."""
        return next((self.overrides[k] for k in _enclosing(key) if k in self.overrides), None)

    def __call__(self, key: str) -> str:
        item = self.override_of(key)
        if item is not None:
            return f"override {item!r}"
        line = next((self.lines[k] for k in _enclosing(key) if k in self.lines), None)
        return self.path if line is None else f"{self.path}:{line}"


def _enclosing(key: str) -> list[str]:
    """``reward.functions[0].fn`` -> itself, ``reward.functions[0]``, ``reward.functions``, ``reward``."""
    out = [key]
    while True:
        cut = max(key.rfind("."), key.rfind("["))
        if cut <= 0:
            return out
        key = key[:cut]
        out.append(key)


def key_lines(node: yaml.Node, prefix: str, out: dict[str, int]) -> None:
    """Record the 1-based line of every mapping key under ``node`` as ``section.key``."""
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            key = f"{prefix}{key_node.value}"
            out[key] = key_node.start_mark.line + 1
            key_lines(value_node, key + ".", out)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            out[f"{prefix[:-1]}[{i}]"] = item.start_mark.line + 1
            key_lines(item, f"{prefix[:-1]}[{i}].", out)


def read_yaml(path: str | Path | None) -> tuple[dict[str, Any], KeySources]:
    """The raw mapping of a config file (empty for None) and the line of each of its keys."""
    where = KeySources(None if path is None else str(path))
    if path is None:
        return {}, where
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror}") from None
    try:
        raw = yaml.safe_load(text) or {}
        node = yaml.compose(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: invalid YAML: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections")
    if node is not None:
        key_lines(node, "", where.lines)
    return raw, where


def build(cls: type, raw: Any, prefix: str, where: KeySources) -> Any:
    if not isinstance(raw, dict):
        key = prefix.rstrip(".")
        # A list's item (reward.functions[0]): show the list's syntax, else the section's.
        owner, tp = (key.rpartition("[")[0], list[cls]) if key.endswith("]") else (key, cls)  # type: ignore[valid-type]
        raise ConfigError(f"{where(key)}: {key or 'config'} must be a mapping, got {_show(raw)}"
                          + _syntax_hint(owner, tp, where, raw))
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.name != "source"}
    unknown = [k for k in raw if k not in fields]
    if unknown:
        key = f"{prefix}{unknown[0]}"
        raise ConfigError(
            f"{where(key)}: unknown key '{key}'" + _suggest(str(unknown[0]), list(fields))
            + f" (allowed in {prefix.rstrip('.') or 'the top level'}: {', '.join(fields)})"
        )
    values = {name: coerce(raw[name], hints[name], f"{prefix}{name}", where) for name in raw}
    return cls(**values)


def coerce(value: Any, tp: Any, key: str, where: KeySources) -> Any:
    """Check ``value`` against the annotation ``tp``; return it (ints widen to floats)."""
    origin = typing.get_origin(tp)
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return build(tp, value, key + ".", where)
    if origin is typing.Union or origin is types.UnionType:
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return coerce(value, arg, key, where)
            except ConfigError as e:
                errors.append(e)
        raise errors[0]
    if origin is Literal:
        allowed = typing.get_args(tp)
        if value not in allowed:
            raise ConfigError(
                f"{where(key)}: {key} must be one of {', '.join(map(repr, allowed))}; got {_show(value)}"
            )
        return value
    if origin is dict:
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise ConfigError(f"{where(key)}: {key} must be a mapping of names to values, got {_show(value)}")
        return dict(value)  # values are the consumer's to check (e.g. a class's arguments)
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{where(key)}: {key} must be a list, got {_show(value)}"
                              + _syntax_hint(key, tp, where, value))
        (item_tp,) = typing.get_args(tp)
        return [coerce(v, item_tp, f"{key}[{i}]", where) for i, v in enumerate(value)]
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where(key)}: {key} must be true or false, got {_show(value)}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where(key)}: {key} must be an integer, got {_show(value)}")
        return value
    if tp is float:
        if isinstance(value, str) and _FLOAT.fullmatch(value.strip()):
            # PyYAML follows YAML 1.1, where `1e-6` (no dot) is a string, not a number.
            return float(value)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where(key)}: {key} must be a number, got {_show(value)}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where(key)}: {key} must be a string, got {_show(value)}")
        return value
    raise TypeError(f"config field {key} has an unsupported annotation {tp!r}")  # our bug


def _syntax_hint(key: str, tp: Any, where: KeySources, given: Any) -> str:
    """For a value an override gave: how to write it on the command line (with ``given`` in it)."""
    return f"; on the command line: {override_syntax(key, tp, given)}" if where.override_of(key) else ""


def _show(value: Any) -> str:
    text = repr(value)
    return f"{text[:60]}… ({type(value).__name__})" if len(text) > 60 else f"{text} ({type(value).__name__})"


def _suggest(name: str, options: list[str]) -> str:
    import difflib

    close = difflib.get_close_matches(name, options, n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""
