"""Write docs/configuration.md from the config schema in arbor/config.py.

    python3 scripts/gen_config_docs.py            # rewrite docs/configuration.md
    python3 scripts/gen_config_docs.py --check    # exit 1 if the file is stale

Every key is listed as ``section.key`` with its type (the annotation as written), its
default (read from a default-built config, so factories and properties agree with what a
run gets) and its meaning: the comment lines directly above the field plus the comment
trailing it, read from the source with ``tokenize``. A key without a comment is an error
naming it: the comment is the key's documentation, so a new key cannot land undocumented.
tests/test_config_docs.py fails when the committed page differs from what this writes.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import io
import re
import sys
import tokenize
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
CONFIG_SOURCE = REPO / "arbor" / "config.py"
OUTPUT = REPO / "docs" / "configuration.md"
COMMAND = "python3 scripts/gen_config_docs.py"

# Overrides the page shows, each with what it sets; tests/test_config_docs.py loads every one.
OVERRIDE_EXAMPLES = [
    ("run.steps=10", "a value"),
    ("'engine.extra_args=[--context-length, \"4096\"]'", "a whole list, in YAML flow syntax (`[]`: empty)"),
    ("'reward.functions=[{fn: rewards/math.py:boxed_format, weight: 0.5}]'",
     "a whole list of records, each item a `{key: value, ...}` mapping"),
    ("'reward.functions[0].fn=rewards/math.py:boxed_format'",
     "one key of one item: `[i]` counts from 0; the list's length adds an item"),
    ("rollout.agent_args.max_tool_calls=2", "one key of a mapping"),
]


@dataclass(frozen=True)
class Key:
    name: str  # section.key, e.g. "loss.clip_high"; list items as "reward.functions[i].fn"
    type: str  # the annotation's source text
    default: Any
    meaning: str


class UndocumentedKeys(Exception):
    """Config fields without a comment; the message names every one."""


def _comments(source: str) -> dict[int, tuple[str, bool]]:
    """Line number -> (comment text without '#', whether the line holds only the comment)."""
    out: dict[int, tuple[str, bool]] = {}
    lines = source.splitlines()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            row, col = tok.start
            alone = not lines[row - 1][:col].strip()
            out[row] = (tok.string.lstrip("#").strip(), alone)
    return out


def _field_meaning(node: ast.AnnAssign, comments: dict[int, tuple[str, bool]]) -> str:
    """The comment lines right above the field (no blank line between) and its trailing one."""
    above = []
    row = node.lineno - 1
    while row in comments and comments[row][1]:
        above.append(comments[row][0])
        row -= 1
    trailing = [comments[r][0] for r in range(node.lineno, node.end_lineno + 1)
                if r in comments and not comments[r][1]]
    # The trailing comment is the short definition; the lines above, when present, add to it.
    parts = [" ".join(trailing), " ".join(reversed(above))]
    return " ".join(part if part[-1] in ".:;!?" else part + "." for part in parts if part)


def _class_fields(tree: ast.Module) -> dict[str, list[ast.AnnAssign]]:
    """Class name -> its annotated fields in source order (properties and methods skipped)."""
    return {
        cls.name: [s for s in cls.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
                   and not ast.unparse(s.annotation).startswith(("ClassVar", "typing.ClassVar"))]
        for cls in tree.body
        if isinstance(cls, ast.ClassDef)
    }


def _class_docs(tree: ast.Module) -> dict[str, str]:
    return {cls.name: " ".join((ast.get_docstring(cls) or "").split())
            for cls in tree.body if isinstance(cls, ast.ClassDef)}


def collect_keys(source: str, defaults: Any) -> tuple[list[tuple[str, str]], list[Key]]:
    """The sections (name, class docstring) and every key of ``source``'s ``Config``.

    ``defaults`` is a default-built ``Config``: defaults are read from it. Raises
    :class:`UndocumentedKeys` naming every field that has no comment.
    """
    tree = ast.parse(source)
    fields = _class_fields(tree)
    docs = _class_docs(tree)
    comments = _comments(source)
    aliases = _type_aliases(tree)
    sections: list[tuple[str, str]] = []
    keys: list[Key] = []
    missing: list[str] = []

    def walk(cls_name: str, prefix: str, instance: Any) -> None:
        for node in fields[cls_name]:
            name = node.target.id
            full = f"{prefix}{name}"
            annotation = _expand_aliases(ast.unparse(node.annotation), aliases)
            item_cls = _list_item_class(node.annotation, fields)
            meaning = _field_meaning(node, comments)
            if not meaning:
                missing.append(full)
            value = getattr(instance, name)
            if annotation in fields:  # a nested record (algorithm.distill): its keys, each documented
                walk(annotation, f"{full}.", value)
                continue
            keys.append(Key(full, annotation, value, meaning))
            if item_cls is not None:  # a list of records (reward.functions): document their keys
                item = value[0] if value else None
                walk(item_cls, f"{full}[i].", item if item is not None else _default_of(item_cls))

    for node in fields["Config"]:
        section_cls = ast.unparse(node.annotation)
        if section_cls not in fields:  # not a section (Config.source: where it was loaded from)
            continue
        section = node.target.id
        sections.append((section, docs.get(section_cls, "")))
        walk(section_cls, f"{section}.", getattr(defaults, section))
    if missing:
        raise UndocumentedKeys(
            f"{CONFIG_SOURCE.relative_to(REPO)}: these config keys have no comment saying what "
            f"they mean (add one on the line above the field): {', '.join(missing)}"
        )
    return sections, keys


def _type_aliases(tree: ast.Module) -> dict[str, str]:
    """Module-level ``Name = Literal[...]`` (or another subscripted type): name -> its text."""
    return {
        stmt.targets[0].id: ast.unparse(stmt.value)
        for stmt in tree.body
        if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1
        and isinstance(stmt.targets[0], ast.Name) and isinstance(stmt.value, ast.Subscript)
    }


def _expand_aliases(annotation: str, aliases: dict[str, str]) -> str:
    """``Dtype`` -> ``Literal['auto', ...]``: the reader sees the allowed values."""
    return re.sub(r"\b\w+\b", lambda m: aliases.get(m.group(0), m.group(0)), annotation)


def _list_item_class(annotation: ast.expr, fields: dict[str, list[ast.AnnAssign]]) -> str | None:
    """``list[X]`` where X is a config record of the same file: X's name."""
    if (isinstance(annotation, ast.Subscript) and isinstance(annotation.value, ast.Name)
            and annotation.value.id == "list" and isinstance(annotation.slice, ast.Name)
            and annotation.slice.id in fields):
        return annotation.slice.id
    return None


def _default_of(cls_name: str) -> Any:
    import arbor.config

    return getattr(arbor.config, cls_name)()


def _plain(value: Any) -> Any:
    """Config records as plain data (dataclasses, or pydantic models via model_dump)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    if hasattr(value, "model_dump"):
        return value.model_dump()
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def show_default(value: Any) -> str:
    """A default as it would be written in the YAML file, e.g. ``null``, ``[0.9, 0.999]``."""
    text = yaml.safe_dump(_plain(value), default_flow_style=True, width=10_000, allow_unicode=True)
    return text.strip().removesuffix("...").strip()


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render(sections: list[tuple[str, str]], keys: list[Key]) -> str:
    out = [
        "# Configuration reference",
        "",
        "<!-- Generated by `" + COMMAND + "` from arbor/config.py: edit the comments there, "
        "not this file. -->",
        "",
        "A run is one YAML file of these sections; any key can be overridden on the command line as",
        "`section.key=value` (`arbor config FILE KEY=VALUE ...` prints the resolved config). Unknown",
        "keys, wrong types and invalid combinations are refused before any work starts, naming the",
        "key and the file line or override it came from. A documented full example:",
        "[`configs/math.yaml`](../configs/math.yaml).",
        "",
        "Values are YAML. Lists, their items and nested keys:",
        "",
        "| override | sets |",
        "|---|---|",
        *(f"| `{example}` | {what} |" for example, what in OVERRIDE_EXAMPLES),
        "",
        "Quote an override holding `[`, `{` or a space, as above, so that the shell passes it as it is.",
        "Below, `reward.functions[i].fn` is the key `fn` of each item of the list `reward.functions`.",
        "",
        "Sections: " + ", ".join(f"[`{name}`](#{name})" for name, _ in sections) + ".",
    ]
    for section, doc in sections:
        out += ["", f"## {section}", ""]
        if doc:
            out += [doc, ""]
        out += ["| key | type | default | meaning |", "|---|---|---|---|"]
        for key in keys:
            if key.name.split(".")[0] != section:
                continue
            out.append(f"| `{key.name}` | `{_cell(key.type)}` | `{_cell(show_default(key.default))}` "
                       f"| {_cell(key.meaning)} |")
    return "\n".join(out) + "\n"


def generate() -> str:
    """The text docs/configuration.md should hold now."""
    import arbor.config

    sections, keys = collect_keys(CONFIG_SOURCE.read_text(), arbor.config.Config())
    return render(sections, keys)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/configuration.md is stale")
    args = parser.parse_args(argv)
    try:
        text = generate()
    except UndocumentedKeys as e:
        print(f"gen_config_docs: {e}", file=sys.stderr)
        return 1
    if args.check:
        if not OUTPUT.exists() or OUTPUT.read_text() != text:
            print(f"{OUTPUT.relative_to(REPO)} is stale: run `{COMMAND}`", file=sys.stderr)
            return 1
        return 0
    OUTPUT.parent.mkdir(parents=True, exist_ok=True)
    OUTPUT.write_text(text)
    print(f"wrote {OUTPUT.relative_to(REPO)} ({sum(1 for line in text.splitlines() if line.startswith('| `'))} keys)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
