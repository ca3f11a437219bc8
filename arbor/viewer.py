"""`arbor view`: a saved rollout tree as one self-contained HTML page.

    arbor view runs/math/trees/step-000010.jsonl                 # all trees, with a selector
    arbor view runs/math/trees/step-000010.jsonl --index 2 --tokenizer models/tiny-arith
    arbor view tree.json --color advantage --out /tmp/tree.html

PATH holds one ``RolloutTree.to_json()`` per line (what ``arbor train`` writes every
``run.save_trees_every`` steps) or a single tree as JSON. The page needs no network: the
tree is laid out here, in Python, and drawn as inline SVG; a little inline JS shows a
node's text on hover and its whole root-to-node path on click. Text is decoded with the
tokenizer of the run that wrote PATH (``model.path`` in its ``config.yaml``, else its
``hf/``), or ``--tokenizer``'s; ``--token-ids`` shows the ids.

Layout, left to right: the prompt, then each segment as a box whose width grows with its
token count; every leaf has a row of its own (depth-first order, so edges never cross)
and a parent sits level with the middle of its children. Boxes are coloured by leaf
reward or by TreePO advantage (whitened over the trees of the file); an inner node takes
the mean over the leaves below it. Every leaf ends in a violet mark (``data-leaf``).
"""

from __future__ import annotations

import argparse
import html
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from arbor.tree import Node, RolloutTree

# Geometry, in SVG pixels.
ROW = 26  # vertical pitch: one row per leaf
BOX_H = 18
GAP = 22  # horizontal room for the edge between a parent and its children
MIN_W = 8  # a one-token segment stays visible
PROMPT_W = 84
MAX_PX_PER_TOKEN = 6.0
TARGET_W = 900  # widest path, when tokens allow
MARK_W = 10  # the leaf mark
MARGIN = 8

LEAF_COLOR = "#7c3aed"  # the leaf mark; no colour scale below comes near it
NO_VALUE = "#d1d5db"  # node without a reward (or advantage) below it
LOW, MID, HIGH = (215, 48, 39), (254, 224, 139), (26, 152, 80)  # red → yellow → green


class ViewError(ValueError):
    """Bad input for `arbor view`; the message says where (file, line, index)."""


# -- input -------------------------------------------------------------------------------


def load_trees(path: Path) -> list[RolloutTree]:
    """Trees from a JSON-lines file (one per line) or a file holding one tree as JSON."""
    try:
        text = path.read_text()
    except OSError as e:
        raise ViewError(f"cannot read {path}: {e.strerror or e}") from None
    # A single, possibly pretty-printed, tree parses as a whole; JSON lines do not
    # (unless there is only one line, which means the same thing).
    try:
        whole = json.loads(text)
    except json.JSONDecodeError:
        whole = None
    if isinstance(whole, dict):
        return [_tree_from(whole, f"{path}")]
    trees = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}, line {number}"
        try:
            data = json.loads(line)
        except json.JSONDecodeError as e:
            raise ViewError(f"{where}: not JSON ({e.msg} at column {e.colno})") from None
        trees.append(_tree_from(data, where))
    if not trees:
        raise ViewError(f"{path}: no trees in the file")
    return trees


def _tree_from(data: Any, where: str) -> RolloutTree:
    if not isinstance(data, dict):
        raise ViewError(f"{where}: expected a tree object, got {type(data).__name__}")
    try:
        return RolloutTree.from_dict(data)
    except KeyError as e:
        raise ViewError(f"{where}: not a rollout tree (missing key {e})") from None
    except (TypeError, ValueError) as e:
        raise ViewError(f"{where}: not a rollout tree ({e})") from None


def leaf_advantages(trees: list[RolloutTree]) -> list[list[float] | None]:
    """TreePO advantages (whitened over the trees with rewards), per tree per leaf.

    None for a tree with a leaf that has no reward; such trees take no part.
    """
    from arbor.train.advantage import compute_advantages

    scored = [i for i, t in enumerate(trees) if t.leaves() and all(leaf.reward is not None for leaf in t.leaves())]
    out: list[list[float] | None] = [None] * len(trees)
    if scored:
        values = compute_advantages([trees[i] for i in scored], "treepo")
        for i, adv in zip(scored, values):
            out[i] = [float(a) for a in cast(list[float], adv)]  # treepo: one float per leaf
    return out


# -- layout ------------------------------------------------------------------------------


@dataclass
class Box:
    x: float
    y: float  # top
    w: float


def layout(tree: RolloutTree) -> tuple[dict[int, Box], float, float]:
    """Boxes by node id (the root is the prompt box), and the drawing's width and height."""
    stats = tree.stats()
    longest = max((leaf.end for leaf in tree.leaves()), default=0)
    room = TARGET_W - PROMPT_W - stats.max_depth * (MIN_W + GAP)
    px_per_token = min(MAX_PX_PER_TOKEN, max(room, 100) / max(longest, 1))

    boxes: dict[int, Box] = {}
    next_row = 0

    def place(node: Node, x: float) -> float:
        """Lay out the subtree of ``node`` with its box at ``x``; return the box's centre y."""
        nonlocal next_row
        w = PROMPT_W if node.parent is None else max(MIN_W, len(node.token_ids) * px_per_token)
        if node.children:
            centres = [place(c, x + w + GAP) for c in node.children]
            cy = (centres[0] + centres[-1]) / 2
        else:
            cy = next_row * ROW + ROW / 2
            next_row += 1
        boxes[node.id] = Box(x, cy - BOX_H / 2, w)
        return cy

    place(tree.root, MARGIN)
    # Leaves carry a mark and a label to their right.
    width = max((b.x + b.w for b in boxes.values()), default=0) + MARK_W + 220
    return boxes, width, max(next_row, 1) * ROW + MARGIN


# -- colour ------------------------------------------------------------------------------


def node_values(tree: RolloutTree, leaf_values: list[float | None]) -> dict[int, float | None]:
    """Per node id: the mean of ``leaf_values`` over the leaves below (None if none known)."""
    sums: dict[int, list[float]] = {}
    for leaf, value in zip(tree.leaves(), leaf_values):
        if value is None:
            continue
        node: Node | None = leaf
        while node is not None:
            sums.setdefault(node.id, []).append(value)
            node = node.parent
    return {n.id: (sum(sums[n.id]) / len(sums[n.id]) if n.id in sums else None) for n in _all(tree)}


def colour(value: float | None, lo: float, hi: float) -> str:
    """``lo`` → red, midpoint → yellow, ``hi`` → green; grey for no value."""
    if value is None:
        return NO_VALUE
    t = 0.5 if hi <= lo else min(max((value - lo) / (hi - lo), 0.0), 1.0)
    a, b, u = (LOW, MID, 2 * t) if t < 0.5 else (MID, HIGH, 2 * t - 1)
    return "#" + "".join(f"{round(x + (y - x) * u):02x}" for x, y in zip(a, b))


def value_range(values: list[float], kind: str) -> tuple[float, float]:
    """Colour scale bounds: rewards span at least [0, 1]; advantages are symmetric about 0."""
    if kind == "advantage":
        bound = max((abs(v) for v in values), default=1.0) or 1.0
        return -bound, bound
    return min([0.0, *values]), max([1.0, *values])


# -- rendering ---------------------------------------------------------------------------


def _all(tree: RolloutTree) -> list[Node]:
    return [tree.root, *tree.nodes()]


def _fmt(x: float | None, signed: bool = False) -> str:
    if x is None:
        return "–"
    return f"{x:+.2f}" if signed else f"{x:.2f}"


def render_svg(tree: RolloutTree, index: int, fills: dict[int, str], labels: dict[int, str]) -> str:
    """The tree as an SVG element; ``labels`` gives each leaf's text beside its mark."""
    boxes, width, height = layout(tree)
    edges, shapes = [], []
    leaf_number = {leaf.id: k for k, leaf in enumerate(tree.leaves())}
    for node in _all(tree):
        box = boxes[node.id]
        cy = box.y + BOX_H / 2
        for child in node.children:
            c = boxes[child.id]
            x0, x1, y1 = box.x + box.w, c.x, c.y + BOX_H / 2
            xm = (x0 + x1) / 2
            edges.append(
                f'<path class="edge" d="M{x0:.1f},{cy:.1f} C{xm:.1f},{cy:.1f} {xm:.1f},{y1:.1f} {x1:.1f},{y1:.1f}"/>'
            )
        attrs = f'class="node" id="t{index}-n{node.id}" data-node="{node.id}"'
        if node.id in leaf_number:
            attrs += f' data-leaf="{leaf_number[node.id]}"'
        n_tokens = len(tree.prompt_ids) if node.parent is None else len(node.token_ids)
        inner = f'<rect x="{box.x:.1f}" y="{box.y:.1f}" width="{box.w:.1f}" height="{BOX_H}" rx="3" fill="{fills[node.id]}"/>'
        caption = f"prompt {n_tokens}" if node.parent is None else str(n_tokens)
        if box.w >= 7 * len(caption) + 4:  # only where the caption fits
            inner += f'<text x="{box.x + box.w / 2:.1f}" y="{cy + 4:.1f}" text-anchor="middle">{caption}</text>'
        if node.id in leaf_number:
            mx = box.x + box.w + 4
            inner += (
                f'<rect class="leaf-mark" x="{mx:.1f}" y="{box.y:.1f}" width="{MARK_W}" '
                f'height="{BOX_H}" rx="2" fill="{LEAF_COLOR}"/>'
                f'<text class="leaf-label" x="{mx + MARK_W + 4:.1f}" y="{cy + 4:.1f}">'
                f"{html.escape(labels[node.id])}</text>"
            )
        shapes.append(f"<g {attrs}>{inner}</g>")
    return (
        # No xmlns: inline SVG in HTML needs none, and the page names no URL at all.
        f'<svg width="{width:.0f}" height="{height:.0f}" '
        f'viewBox="0 0 {width:.0f} {height:.0f}">' + "".join(edges) + "".join(shapes) + "</svg>"
    )


def node_texts(tree: RolloutTree, tokenizer: Any | None) -> dict[int, str]:
    """Per node id (the root: the prompt), its decoded text, or its token ids without a tokenizer."""

    def show(ids: list[int]) -> str:
        if tokenizer is None:
            return " ".join(str(t) for t in ids)
        return tokenizer.decode(ids, skip_special_tokens=False)

    return {n.id: show(tree.prompt_ids if n.parent is None else n.token_ids) for n in _all(tree)}


def _node_record(
    node: Node,
    tree: RolloutTree,
    text: str,
    value: float | None,
    advantage: float | None,
    leaves_below: int,
) -> dict[str, Any]:
    """What the page's JS shows for one node (hover and click)."""
    lps = node.logprobs or []
    return {
        "parent": None if node.parent is None else node.parent.id,
        "depth": node.depth,
        "start": node.start,
        "tokens": len(tree.prompt_ids) if node.parent is None else len(node.token_ids),
        "text": text,
        "reward": node.reward,
        "advantage": advantage,
        "value": value,
        "finish": node.finish_reason,
        "weights": node.weight_version,
        "mean_logprob": sum(lps) / len(lps) if lps else None,
        "leaves": leaves_below,
    }


def render_section(
    tree: RolloutTree,
    index: int,
    texts: dict[int, str],
    advantages: list[float] | None,
    color: str,
    scale: tuple[float, float],
    visible: bool,
    decoded: bool,
) -> tuple[str, dict[str, Any]]:
    """One tree's stats panel and drawing, and the data its JS needs."""
    leaves = tree.leaves()
    rewards = [leaf.reward for leaf in leaves]
    unknown: list[float | None] = [None] * len(leaves)
    per_leaf: list[float | None] = list(rewards if color == "reward" else advantages or unknown)
    values = node_values(tree, per_leaf)
    fills = {nid: colour(v, *scale) for nid, v in values.items()}
    adv_of = dict(zip((leaf.id for leaf in leaves), advantages or []))
    labels = {}
    for leaf in leaves:
        parts = [f"R {_fmt(leaf.reward)}"]
        if leaf.id in adv_of:
            parts.append(f"A {_fmt(adv_of[leaf.id], signed=True)}")
        if leaf.finish_reason not in (None, "stop"):
            parts.append(str(leaf.finish_reason))
        labels[leaf.id] = " · ".join(parts)
    counts = tree.leaf_counts()
    data = {
        # Token ids (no tokenizer) need a space between segments; decoded text has its own.
        "separator": "" if decoded else " ",
        "nodes": {
            n.id: _node_record(n, tree, texts[n.id], values[n.id], adv_of.get(n.id), counts[n.id])
            for n in _all(tree)
        },
    }
    s = tree.stats()
    known = [r for r in rewards if r is not None]
    rows = [
        ("problem", tree.problem_id),
        ("leaves", s.leaves),
        ("nodes", s.nodes),
        ("max depth", s.max_depth),
        ("prompt tokens", s.prompt_tokens),
        ("response tokens, unique", s.unique_response_tokens),
        ("response tokens, linearised", s.linearised_response_tokens),
        ("tokens, unique / linearised", f"{s.unique_tokens} / {s.linearised_tokens}"),
        ("sharing ratio", f"{s.sharing_ratio:.2f}×"),
        ("response sharing ratio", f"{s.response_sharing_ratio:.2f}×"),
        ("mean reward", _fmt(sum(known) / len(known)) if known else "–"),
    ]
    stats = "".join(f"<dt>{html.escape(k)}</dt><dd>{html.escape(str(v))}</dd>" for k, v in rows)
    section = (
        f'<section class="tree" data-tree="{index}"{"" if visible else " hidden"}>'
        f'<aside><h2>Tree {index}</h2><dl class="stats">{stats}</dl></aside>'
        f'<div class="drawing">{render_svg(tree, index, fills, labels)}</div>'
        f'<div class="details">Click a box for its text and path; hover for a summary.</div>'
        "</section>"
    )
    return section, data


# The page's style and script, inline in every page: arbor/viewer.css, arbor/viewer.js (dependency-free:
# hover shows a node's summary, click its root-to-node path).
CSS = "\n" + (Path(__file__).parent / "viewer.css").read_text()
JS = "\n" + (Path(__file__).parent / "viewer.js").read_text()


def render_html(
    trees: list[RolloutTree],
    indices: list[int],
    title: str,
    tokenizer: Any | None = None,
    color: str = "reward",
    advantages: list[list[float] | None] | None = None,
) -> str:
    """The page for ``trees`` (numbered by ``indices``); ``advantages`` per tree, per leaf."""
    advantages = advantages or [None] * len(trees)
    if color == "reward":
        scale_values = [leaf.reward for t in trees for leaf in t.leaves() if leaf.reward is not None]
    else:
        scale_values = [a for adv in advantages for a in adv or []]
    scale = value_range(scale_values, color)
    sections, data = [], {}
    for k, (tree, index, adv) in enumerate(zip(trees, indices, advantages)):
        section, data[index] = render_section(tree, index, node_texts(tree, tokenizer), adv, color, scale,
                                              visible=k == 0, decoded=tokenizer is not None)
        sections.append(section)
    selector = ""
    if len(trees) > 1:
        options = "".join(
            f'<option value="{i}">tree {i}: problem {html.escape(t.problem_id)}, '
            f"{len(t.leaves())} leaves</option>"
            for t, i in zip(trees, indices)
        )
        selector = f'<label>Tree <select id="tree-select">{options}</select></label>'
    lo, hi = scale
    what = "reward" if color == "reward" else "TreePO advantage"
    legend = (
        '<div class="legend">'
        f"<span>{what}: {_fmt(lo)} "
        f'<span class="bar" style="background: linear-gradient(to right, {colour(lo, lo, hi)}, '
        f'{colour((lo + hi) / 2, lo, hi)}, {colour(hi, lo, hi)})"></span> {_fmt(hi)}</span>'
        f'<span><span class="swatch" style="background: {NO_VALUE}"></span>no {color}</span>'
        f'<span><span class="swatch" style="background: {LEAF_COLOR}"></span>leaf</span>'
        "<span>inner box: mean over the leaves below · width ∝ tokens</span>"
        "</div>"
    )
    # "<" escaped so that no text in the data can close the script element.
    payload = json.dumps(data).replace("<", "\\u003c")
    return (
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
        f"<title>{html.escape(title)}</title><style>{CSS}</style></head><body>"
        f"<header><h1>{html.escape(title)}</h1>{selector}{legend}</header>"
        + "".join(sections)
        + '<div id="tip"></div>'
        f'<script type="application/json" id="arbor-data">{payload}</script>'
        f"<script>{JS}</script></body></html>"
    )


# -- command line ------------------------------------------------------------------------


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="arbor view",
                                     description="Render saved rollout trees as a self-contained HTML page.")
    parser.add_argument("path", type=Path, help="trees as JSON lines (arbor train's trees/*.jsonl), one tree as "
                        "JSON, or a run directory (its latest trees file)")
    parser.add_argument("--out", type=Path, help="HTML file to write (default: PATH with .html)")
    parser.add_argument(
        "--tokenizer",
        help="model directory whose tokenizer decodes the tokens (default: the run's, named by "
        "model.path in the config.yaml of the run that wrote PATH, else its hf/)",
    )
    parser.add_argument("--token-ids", action="store_true", help="show token ids instead of text")
    parser.add_argument("--index", type=int,
                        help="render only the tree on this line (0-based; default: all, with a selector)")
    parser.add_argument("--color", choices=("reward", "advantage"), default="reward",
                        help="colour boxes by leaf reward or TreePO advantage")
    return parser.parse_args(argv)


def load_tokenizer(model_dir: str, **kwargs: Any) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_dir, **kwargs)
    except (OSError, ValueError) as e:
        raise ViewError(f"--tokenizer {model_dir}: cannot load a tokenizer ({e})") from None


def run_tokenizer(path: Path) -> tuple[Any | None, str]:
    """The tokenizer of the run that wrote ``path`` (``RUN/trees/step-N.jsonl``): ``model.path``
    of ``RUN/config.yaml``, else the exported ``RUN/hf``; and a line saying which, or why none."""
    import yaml

    run = next((d for d in (path.parent.parent, path.parent) if (d / "config.yaml").is_file()), None)
    if run is None:
        return None, f"showing token ids: no run's config.yaml next to {path}; pass --tokenizer MODEL_DIR"
    try:
        model = yaml.safe_load((run / "config.yaml").read_text())["model"]
        name, remote = str(model["path"]), bool(model.get("trust_remote_code", False))
    except (OSError, yaml.YAMLError, KeyError, TypeError) as e:
        return None, f"showing token ids: cannot read model.path from {run / 'config.yaml'} ({e!r})"
    reasons = []
    for candidate in (name, str(run / "hf")):
        try:  # a hub id is taken from the local cache only: no network wait
            tokenizer = load_tokenizer(candidate, trust_remote_code=remote,
                                       local_files_only=not Path(candidate).is_dir())
        except ViewError as e:
            reasons.append(str(e).removeprefix("--tokenizer "))
            continue
        return tokenizer, f"decoded with the tokenizer of {candidate} (the run's, {run / 'config.yaml'})"
    return None, f"showing token ids: {'; '.join(reasons)}; pass --tokenizer MODEL_DIR"


def latest_trees(path: Path) -> Path:
    """``path``, or for a run directory (or its ``trees/``) the trees file of its latest step."""
    if not path.is_dir():
        return path
    folder = path / "trees" if (path / "trees").is_dir() else path
    steps = sorted(folder.glob("step-*.jsonl"), key=lambda p: int(p.stem.split("-")[1]) if p.stem.split("-")[1].isdigit() else -1)
    if not steps:
        raise ViewError(f"{path} is a directory without saved trees (trees/step-N.jsonl: run.save_trees_every)")
    return steps[-1]


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    try:
        if args.path.is_dir():
            args.path = latest_trees(args.path)
            print(f"arbor view: {args.path}", file=sys.stderr)
        trees = load_trees(args.path)
        advantages = leaf_advantages(trees)  # over the whole file: it is the batch we have
        indices = list(range(len(trees)))
        if args.index is not None:
            if not 0 <= args.index < len(trees):
                raise ViewError(f"--index {args.index} is out of range: {args.path} holds {len(trees)} tree(s)")
            indices = [args.index]
        if args.color == "advantage" and all(advantages[i] is None for i in indices):
            raise ViewError("--color advantage needs trees whose leaves all have rewards")
        note = ""
        if args.token_ids:
            tokenizer = None
        elif args.tokenizer:
            tokenizer = load_tokenizer(args.tokenizer)
        else:
            tokenizer, note = run_tokenizer(args.path)
        page = render_html([trees[i] for i in indices], indices, f"arbor view: {args.path.name}", tokenizer=tokenizer,
                           color=args.color, advantages=[advantages[i] for i in indices])
        suffix = "" if args.index is None else f"-{args.index}"
        out = args.out or args.path.with_name(f"{args.path.stem}{suffix}.html")
        try:
            out.write_text(page, encoding="utf-8")
        except OSError as e:
            raise ViewError(f"cannot write {out}: {e.strerror or e}") from None
    except ViewError as e:
        print(f"arbor view: error: {e}", file=sys.stderr)
        return 2
    if note:
        print(f"arbor view: {note}", file=sys.stderr)
    print(out)
    return 0
