"""`arbor view`: layout and colours by hand, the page's self-containment, the command's
exits, and a screenshot in headless Chromium that shows every leaf."""

import json
import re
import shutil
import struct
import subprocess
import zlib
from pathlib import Path

import numpy as np
import pytest
from ci_rule import unavailable

from arbor.train.advantage import compute_advantages
from arbor.tree import RolloutTree
from arbor.viewer import (
    LEAF_COLOR,
    ROW,
    colour,
    layout,
    load_trees,
    main,
    node_values,
    render_html,
    value_range,
)

REPO = Path(__file__).resolve().parents[1]


def sixteen_leaves() -> RolloutTree:
    """Four binary forks of 2-token segments, then a leaf segment each: 16 leaves, depth 5."""
    responses = []
    for k in range(16):
        bits = [(k >> (3 - level)) & 1 for level in range(4)]
        responses.append(
            [t for level, b in enumerate(bits) for t in (10 * level + b,) * 2] + [100 + k]
        )
    rewards = [float(k % 3 == 0) for k in range(16)]
    return RolloutTree.from_sequences(
        [1, 2, 3], responses, rewards, segment_tokens=2, problem={"id": "p16"}
    )


def write_jsonl(path: Path, trees: list[RolloutTree]) -> Path:
    path.write_text("".join(t.to_json() + "\n" for t in trees))
    return path


# -- pure parts ----------------------------------------------------------------------------


def test_layout_gives_each_leaf_a_row_and_centres_parents():
    #   root ─ a[5, 6] ─┬─ b[7, 7]                 (leaf, row 0)
    #                   └─ c[8, 8, 8, 8, 8, 8] ─ d[11]   (leaf, row 1)
    tree = RolloutTree([1])
    a = tree.add_segment(tree.root, [5, 6])
    b = tree.add_segment(a, [7, 7])
    c = tree.add_segment(a, [8] * 6)
    d = tree.add_segment(c, [11])
    boxes, width, height = layout(tree)
    assert boxes[b.id].y + 9 == ROW / 2 and boxes[d.id].y + 9 == ROW + ROW / 2
    assert boxes[a.id].y == (boxes[b.id].y + boxes[d.id].y) / 2  # parent between its children
    assert boxes[c.id].y == boxes[d.id].y  # one child: level with it
    assert boxes[c.id].w == 3 * boxes[b.id].w  # width ∝ tokens (6 px each here)
    assert boxes[d.id].w == 8  # one token: the minimum width
    assert boxes[b.id].x == boxes[c.id].x > boxes[a.id].x + boxes[a.id].w  # edge room
    assert height == 2 * ROW + 8 and width > boxes[d.id].x + boxes[d.id].w


def test_colours_and_inner_values():
    assert colour(0.0, 0.0, 1.0) == "#d73027"  # red
    assert colour(0.5, 0.0, 1.0) == "#fee08b"  # yellow
    assert colour(1.0, 0.0, 1.0) == "#1a9850"  # green
    assert colour(7.0, 0.0, 1.0) == "#1a9850"  # clipped
    assert colour(None, 0.0, 1.0) == "#d1d5db"  # no value: grey
    assert value_range([0.0, 1.0], "reward") == (0.0, 1.0)
    assert value_range([2.0], "reward") == (0.0, 2.0)
    assert value_range([-0.5, 2.0], "advantage") == (-2.0, 2.0)
    tree = RolloutTree.from_sequences([1], [[2, 3], [2, 4], [5, 6]], segment_tokens=1)
    values = node_values(tree, [1.0, 0.0, None])
    shared = tree.leaves()[0].parent
    assert values[shared.id] == 0.5 and values[tree.root.id] == 0.5  # the None leaf is left out
    assert values[tree.leaves()[2].id] is None


def test_page_is_self_contained_with_one_element_per_leaf():
    tree = sixteen_leaves()
    page = render_html(
        [tree], [0], "t", color="advantage", advantages=compute_advantages([tree], "treepo")
    )
    assert not re.search(r"https?://", page)  # no CDN, no external resource, no namespace URL
    assert "<link" not in page and "<script src" not in page
    assert len(re.findall(r'data-leaf="\d+"', page)) == 16
    assert page.count('class="leaf-mark"') == 16
    data = json.loads(re.search(r'id="arbor-data">(.*?)</script>', page).group(1))
    leaf = tree.leaves()[3]
    expected = compute_advantages([tree], "treepo")[0][3]
    assert data["0"]["nodes"][str(leaf.id)]["advantage"] == pytest.approx(expected)


def test_text_cannot_break_out_of_the_page():
    tree = RolloutTree([1], problem={"id": "</script><b>"})
    tree.add_segment(tree.root, [2]).reward = 1.0

    class Tok:  # decodes every segment to markup
        def decode(self, ids, skip_special_tokens=False):
            return "</script><script>alert(1)</script>"

    page = render_html([tree], [0], "t", tokenizer=Tok())
    assert page.count("<script") == 2 and page.count("</script>") == 2


# -- the command -----------------------------------------------------------------------------


def test_cli_writes_the_page_next_to_the_input_and_prints_its_path(tmp_path, capsys):
    src = write_jsonl(tmp_path / "step-000004.jsonl", [sixteen_leaves(), sixteen_leaves()])
    assert main([str(src)]) == 0
    out = tmp_path / "step-000004.html"
    assert capsys.readouterr().out.strip() == str(out)
    page = out.read_text()
    assert 'id="tree-select"' in page and page.count("<section") == 2
    assert main([str(src), "--index", "1", "--color", "advantage"]) == 0
    single = tmp_path / "step-000004-1.html"
    assert capsys.readouterr().out.strip() == str(single)
    assert 'id="tree-select"' not in single.read_text()
    # A single tree as (pretty-printed) JSON, written where --out says.
    one = tmp_path / "tree.json"
    one.write_text(json.dumps(sixteen_leaves().to_dict(), indent=2))
    assert main([str(one), "--out", str(tmp_path / "x.html")]) == 0
    assert (tmp_path / "x.html").exists()


def test_tokenizer_decodes_the_text(tmp_path):
    tok = REPO / "models/tiny-arith"
    tree = RolloutTree([1])
    tree.add_segment(tree.root, [2, 3]).reward = 1.0
    src = write_jsonl(tmp_path / "t.jsonl", [tree])
    assert main([str(src), "--tokenizer", str(tok)]) == 0
    from transformers import AutoTokenizer

    text = AutoTokenizer.from_pretrained(tok).decode([2, 3])
    data = json.loads(
        re.search(r'id="arbor-data">(.*?)</script>', (tmp_path / "t.html").read_text()).group(1)
    )
    assert data["0"]["nodes"]["1"]["text"] == text


def page_texts(page: Path) -> dict[str, str]:
    data = json.loads(re.search(r'id="arbor-data">(.*?)</script>', page.read_text()).group(1))
    return {nid: node["text"] for nid, node in data["0"]["nodes"].items()}


def test_the_runs_tokenizer_decodes_by_default(tmp_path, capsys):
    """A run's trees/step-N.jsonl: the tokenizer of model.path in the run's config.yaml, else
    the run's hf/; without a run (or with --token-ids), token ids and a line saying why."""
    from transformers import AutoTokenizer

    model = REPO / "models/tiny-arith"
    text = AutoTokenizer.from_pretrained(model).decode([2, 3])
    tree = RolloutTree([1])
    tree.add_segment(tree.root, [2, 3]).reward = 1.0
    run = tmp_path / "run"
    (run / "trees").mkdir(parents=True)
    src = write_jsonl(run / "trees" / "step-000010.jsonl", [tree])
    (run / "config.yaml").write_text(f"model:\n  path: {model}\n  trust_remote_code: false\n")
    assert main([str(src)]) == 0
    assert page_texts(run / "trees" / "step-000010.html")["1"] == text
    assert f"decoded with the tokenizer of {model}" in capsys.readouterr().err
    # The model moved away: the run's exported hf/ (which holds the tokenizer) decodes.
    (run / "config.yaml").write_text("model:\n  path: /nonexistent/model\n")
    shutil.copytree(model, run / "hf", ignore=shutil.ignore_patterns("*.safetensors"))
    assert main([str(src)]) == 0
    assert page_texts(run / "trees" / "step-000010.html")["1"] == text
    assert f"decoded with the tokenizer of {run / 'hf'}" in capsys.readouterr().err
    assert main([str(src), "--token-ids"]) == 0
    assert page_texts(run / "trees" / "step-000010.html")["1"] == "2 3"
    capsys.readouterr()
    loose = write_jsonl(tmp_path / "loose.jsonl", [tree])  # no run around it
    assert main([str(loose)]) == 0
    assert page_texts(tmp_path / "loose.html")["1"] == "2 3"
    assert "showing token ids: no run's config.yaml next to" in capsys.readouterr().err


def test_a_run_directory_shows_its_latest_trees(tmp_path, capsys):
    """`arbor view runs/quickstart`: the trees of the run's latest saved step (step 10 after 9,
    by number), decoded with the run's tokenizer; a directory without trees says what it lacks."""
    model = REPO / "models/tiny-arith"
    tree = RolloutTree([1])
    tree.add_segment(tree.root, [2, 3]).reward = 1.0
    run = tmp_path / "run"
    (run / "trees").mkdir(parents=True)
    for step in (9, 10):
        write_jsonl(run / "trees" / f"step-{step:06d}.jsonl", [tree])
    (run / "config.yaml").write_text(f"model:\n  path: {model}\n")
    assert main([str(run)]) == 0
    out = capsys.readouterr()
    assert out.out.strip() == str(run / "trees" / "step-000010.html") and "step-000010.jsonl" in out.err
    assert main([str(tmp_path / "run" / "trees")]) == 0
    (tmp_path / "empty").mkdir()
    assert main([str(tmp_path / "empty")]) == 2
    assert "is a directory without saved trees (trees/step-N.jsonl: run.save_trees_every)" in capsys.readouterr().err


@pytest.mark.parametrize(
    "content, args, message",
    [
        (None, [], "cannot read"),
        ("TREE\n{oops\n", [], "line 2: not JSON"),
        ('TREE\n{"prompt_ids": [1]}\n', [], "line 2: not a rollout tree (missing key 'nodes')"),
        ("", [], "no trees"),
        ("TREE\n", ["--index", "3"], "--index 3 is out of range"),
        ("UNSCORED\n", ["--color", "advantage"], "needs trees whose leaves all have rewards"),
        ("TREE\n", ["--tokenizer", "/nonexistent/model"], "cannot load a tokenizer"),
        ("TREE\n", ["--out", "/nonexistent/dir/x.html"], "cannot write /nonexistent/dir/x.html"),
    ],
)
def test_bad_input_exits_2_and_says_why(tmp_path, capsys, content, args, message):
    path = tmp_path / "trees.jsonl"
    if content is not None:
        unscored = RolloutTree([1])
        unscored.add_segment(unscored.root, [2])
        content = content.replace("TREE", sixteen_leaves().to_json()).replace(
            "UNSCORED", unscored.to_json()
        )
        path.write_text(content)
    assert main([str(path), *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("arbor view: error:") and message in err
    assert not (tmp_path / "trees.html").exists()


def test_load_trees_skips_blank_lines(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [sixteen_leaves()])
    path.write_text(path.read_text() + "\n\n")
    assert len(load_trees(path)) == 1


# -- in a browser ------------------------------------------------------------------------------


def read_png(path: Path) -> np.ndarray:
    """An 8-bit RGB or RGBA, non-interlaced PNG (what Chromium writes) as [H, W, C] uint8."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat = 8, b""
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        if kind == b"IHDR":
            width, height, depth, colour_type, _, _, interlace = struct.unpack(">IIBBBBB", body)
            assert depth == 8 and colour_type in (2, 6) and interlace == 0
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    bpp = 3 if colour_type == 2 else 4
    stride = width * bpp
    raw = zlib.decompress(idat)
    rows = np.zeros((height, stride), dtype=np.uint8)
    prior = np.zeros(stride, dtype=np.uint8)
    for y in range(height):
        kind, line = raw[y * (stride + 1)], raw[y * (stride + 1) + 1 : (y + 1) * (stride + 1)]
        cur = np.frombuffer(line, dtype=np.uint8).copy()
        if kind == 2:  # Up: vectorised (uint8 arithmetic wraps as PNG's mod 256)
            cur += prior
        elif kind in (1, 3, 4):  # Sub, Average, Paeth depend on the byte to the left
            up = prior.tolist()
            out = cur.tolist()
            for i in range(stride):
                left = out[i - bpp] if i >= bpp else 0
                upper_left = up[i - bpp] if i >= bpp else 0
                if kind == 1:
                    pred = left
                elif kind == 3:
                    pred = (left + up[i]) // 2
                else:
                    p = left + up[i] - upper_left
                    pa, pb, pc = abs(p - left), abs(p - up[i]), abs(p - upper_left)
                    pred = left if pa <= pb and pa <= pc else up[i] if pb <= pc else upper_left
                out[i] = (out[i] + pred) & 0xFF
            cur = np.array(out, dtype=np.uint8)
        rows[y] = prior = cur
    return rows.reshape(height, width, bpp)[:, :, :3]


def blobs(mask: np.ndarray) -> list[tuple[int, int, int, int]]:
    """Connected regions (4-neighbour) of a boolean mask as (top, left, bottom, right)."""
    todo = set(zip(*np.nonzero(mask)))
    out = []
    while todo:
        stack = [todo.pop()]
        ys, xs = [], []
        while stack:
            y, x = stack.pop()
            ys.append(y)
            xs.append(x)
            for n in ((y + 1, x), (y - 1, x), (y, x + 1), (y, x - 1)):
                if n in todo:
                    todo.remove(n)
                    stack.append(n)
        out.append((min(ys), min(xs), max(ys), max(xs)))
    return out


def chromium(page: Path, *flags: str) -> subprocess.CompletedProcess:
    """Headless Chromium on a local file, with a throwaway profile (runs as root in CI)."""
    if shutil.which("chromium") is None:  # .ci/run installs it
        unavailable("chromium is not installed (apt-get install chromium)")
    return subprocess.run(
        [
            "chromium",
            "--headless",
            "--disable-gpu",
            "--no-sandbox",
            "--hide-scrollbars",
            f"--user-data-dir={page.parent / 'profile'}",
            *flags,
            page.as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_screenshot_in_headless_chromium_shows_every_leaf(tmp_path):
    tree = sixteen_leaves()
    src = write_jsonl(tmp_path / "trees.jsonl", [tree])
    assert main([str(src)]) == 0
    shot = tmp_path / "shot.png"
    proc = chromium(tmp_path / "trees.html", f"--screenshot={shot}", "--window-size=1600,1000")
    assert shot.exists(), (
        f"chromium wrote no screenshot (exit {proc.returncode}): {proc.stderr[-2000:]}"
    )
    pixels = read_png(shot).astype(int)
    target = np.array([int(LEAF_COLOR[i : i + 2], 16) for i in (1, 3, 5)])
    regions = blobs(np.abs(pixels - target).max(axis=2) <= 6)
    # The legend shows one 12 px swatch; each leaf mark is a full box high (18 px).
    marks = sorted(r for r in regions if r[2] - r[0] + 1 >= 15)
    swatches = [r for r in regions if r[2] - r[0] + 1 < 15]
    assert len(marks) == len(tree.leaves()) == 16, regions
    assert len(swatches) == 1, regions
    # One mark per leaf row, a row apart, in depth-first order, top to bottom.
    tops = [r[0] for r in marks]
    assert [b - a for a, b in zip(tops, tops[1:])] == [ROW] * 15


def test_click_hover_and_selector_in_headless_chromium(tmp_path):
    src = write_jsonl(tmp_path / "trees.jsonl", [sixteen_leaves(), sixteen_leaves()])
    assert main([str(src)]) == 0
    page = tmp_path / "trees.html"
    # Play a user: click leaf 3, hover leaf 5, pick the second tree; then dump the DOM.
    events = """<script>
      const fire = (selector, type) => document.querySelector(selector)
        .dispatchEvent(new MouseEvent(type, {bubbles: true}));
      fire('[data-tree="0"] [data-leaf="3"] rect', 'click');
      fire('[data-tree="0"] [data-leaf="5"] rect', 'mouseover');
      const picker = document.getElementById('tree-select');
      picker.value = '1';
      picker.dispatchEvent(new Event('change'));
    </script></body>"""
    page.write_text(page.read_text().replace("</body>", events))
    proc = chromium(page, "--dump-dom")
    dom = proc.stdout
    assert "<section" in dom, proc.stderr[-2000:]
    details = re.search(r'<div class="details">(.*?)</div></section>', dom, re.S).group(1)
    # The root-to-leaf path of leaf 3 (responses k = 3: bits 0, 0, 1, 1), this leaf marked.
    assert "leaf 3 · reward 1.00" in details
    spans = re.findall(r'<span class="([a-z]*)">([^<]*)</span>', details)
    assert spans == [
        ("prompt", "1 2 3\n"),
        ("", "0 0 "),
        ("", "10 10 "),
        ("", "21 21 "),
        ("", "31 31 "),
        ("here", "103 "),
    ]
    tip = re.search(r'<div id="tip" style="display: block;">([^<]*)</div>', dom).group(1)
    assert "leaf 5 · reward 0.00" in tip and tip.endswith("105")
    assert re.search(r'<section class="tree" data-tree="0" hidden="">', dom)
    assert re.search(r'<section class="tree" data-tree="1">', dom)
