"""The docs a user clones stand on their own: every relative link of the README, the
changelog and docs/ reaches a file (and a heading, when it names one), no file points to
notes outside the repository, the README and docs/ state facts rather than narrate work
history, and the README stays a front page."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", REPO / "CHANGELOG.md", *sorted((REPO / "docs").glob("*.md"))]

# Developer notes that live outside the repository: a user cannot follow a reference to them.
OUTSIDE_NOTES = re.compile(r"\b(ALGORITHMS|ARCHITECTURE|ENVIRONMENT|STYLE)\.md\b|\.\./shared\b")
CHECKED_FOR_NOTES = ["README.md", "CHANGELOG.md", "docs", "arbor", "scripts", "configs", "agents", "rewards"]

FENCE = re.compile(r"^(```|~~~)[^`\n]*\n.*?^\1\s*$", re.S | re.M)  # a fence line holds no other backticks
INLINE_CODE = re.compile(r"(`+).*?\1", re.S)
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.M)


def links(text: str) -> list[str]:
    """Targets of the Markdown links in ``text``, code blocks and code spans left out."""
    return LINK.findall(INLINE_CODE.sub("", FENCE.sub("", text)))


def anchor(heading: str) -> str:
    """GitHub's id for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]{2,}|`", "", heading).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    return {anchor(h) for h in HEADING.findall(FENCE.sub("", path.read_text()))}


def broken_links(page: Path) -> list[str]:
    problems = []
    for target in links(page.read_text()):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ...
            continue
        path_part, _, fragment = target.partition("#")
        dest = (page.parent / path_part).resolve() if path_part else page
        if not dest.exists():
            problems.append(f"{page.relative_to(REPO)}: link to {target} (no such file)")
            continue
        if fragment and dest.suffix == ".md" and fragment not in anchors(dest):
            problems.append(f"{page.relative_to(REPO)}: link to {target} (no heading '{fragment}' there)")
    return problems


def test_link_and_anchor_parsing_by_hand():
    text = "see [a](docs/a.md#x-y) and ![fig](f.png) `[not](code.md)`\n```\n[nor](this.md)\n```\n"
    assert links(text) == ["docs/a.md#x-y", "f.png"]
    assert anchor("Chain of thought: `configs/cot.yaml` (CPU)") == "chain-of-thought-configscotyaml-cpu"
    assert anchor("On a GPU: one H100") == "on-a-gpu-one-h100"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_reach_files_and_headings(page):
    assert broken_links(page) == []


def test_no_reference_to_notes_outside_the_repository():
    found = []
    for name in CHECKED_FOR_NOTES:
        root = REPO / name
        files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file() and p.suffix in
                                                     {".py", ".md", ".yaml", ".yml", ".txt", ".toml"})
        for path in files:
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if OUTSIDE_NOTES.search(line):
                    found.append(f"{path.relative_to(REPO)}:{number}: {line.strip()}")
    assert found == [], "references to developer notes a user cannot read:\n" + "\n".join(found)


def test_no_issue_numbers_in_the_readme_and_docs():
    pattern = re.compile(r"\bissues? #?\d+|(?<![\w&/])#\d{1,4}\b", re.I)
    found = [f"{page.relative_to(REPO)}: {m.group(0)}" for page in PAGES if page.name != "CHANGELOG.md"
             for m in pattern.finditer(page.read_text())]
    assert found == []


# Words that narrate how the work went rather than state what holds: history belongs in
# CHANGELOG.md (and commit messages); a figure says the date it was measured instead.
NARRATION = re.compile(
    r"\b(this|previous|next|earlier) round\b|\bround's changes\b|\b(this|that|previous|last|one|the same) session\b|"
    r"\b(the|this) (restructure|refactor(ing)?|rewrite)\b|\brestructur(e|ed|ing)\b|\bthis (PR|pull request|commit)\b|"
    r"\b(in|before|after) this change\b|\bno longer\b|\bas of this\b",
    re.I,
)


def test_narration_words_are_caught_by_hand():
    caught = ["1.4 s before this round's changes", "The restructure left it alone", "one session had a GPU",
              "it no longer skips", "measured in the previous session", "after this change"]
    kept = ["The last round's copies go to the paths", "each round's path budget", "SGLang's session rules",
            "a segment round", "rounds repeat until width"]
    assert [t for t in caught if not NARRATION.search(t)] == []
    assert [t for t in kept if NARRATION.search(t)] == []


def test_readme_and_docs_do_not_narrate_work_history():
    found = [f"{page.relative_to(REPO)}:{number}: {m.group(0)!r}" for page in PAGES if page.name != "CHANGELOG.md"
             for number, line in enumerate(page.read_text().splitlines(), 1) for m in NARRATION.finditer(line)]
    assert found == [], "history narration (say what holds, with dates; history goes in CHANGELOG.md):\n" + \
        "\n".join(found)


def test_readme_is_a_front_page():
    lines = (REPO / "README.md").read_text().count("\n")
    assert lines < 220, f"README.md has {lines} lines: move user-guide text into docs/"
