"""docs/development.md's layout holds: it names every module of arbor/ where it lives."""

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def layout_modules(text: str) -> set[str]:
    """The modules the layout block names, as paths under arbor/ (``run/trainer.py``).

    A header line (``  run/   trainer, phases,  one run...``) opens a package, indented under
    the one above it; its names run until two spaces and the description; lines below it
    continue the package. The top level's names end in ``.py``."""
    block = text[text.index("```\narbor/\n") + len("```\narbor/\n"):]
    block = block[: block.index("```")]
    named, packages = set(), []  # packages: (indent, name) of the open packages
    for line in block.splitlines():
        if not line.startswith(" "):
            break  # agents/, configs/, ...: beside arbor/
        indent = len(line) - len(line.lstrip())
        header = re.match(r"\s*(\w+)/\s+(.*)", line)
        if header:
            packages = [p for p in packages if p[0] < indent] + [(indent, header[1])]
            names = header[2]
        elif indent == 2:
            packages, names = [], line
        else:
            names = line.strip()
        if not packages:
            named |= set(re.findall(r"\b(\w+\.py)\b", names))
            continue
        prefix = "/".join(name for _, name in packages)
        names = re.split(r"\s{2,}", re.sub(r"\s*\([^)]*\)", "", names).strip())[0]  # a note, the description
        named |= {f"{prefix}/{name.strip()}.py" for name in names.split(",") if name.strip()}
    return named


def modules() -> set[str]:
    return {str(path.relative_to(REPO / "arbor")) for path in (REPO / "arbor").rglob("*.py")
            if not path.name.startswith("__")}


def test_the_layout_parser_by_hand():
    text = ("```\narbor/\n  cli.py tree.py   shared\n  run/   trainer, orchestration (Ray, placement),   one run\n"
            "         phases\n    sub/  a, b,   its own\n  train/  loss   what trains\nagents/  x\n```\n")
    assert layout_modules(text) == {"cli.py", "tree.py", "run/trainer.py", "run/orchestration.py",
                                    "run/phases.py", "run/sub/a.py", "run/sub/b.py", "train/loss.py"}


def test_the_layout_names_every_module_and_only_modules():
    named = layout_modules((REPO / "docs" / "development.md").read_text())
    assert sorted(modules() - named) == [], "modules missing from docs/development.md's layout"
    assert sorted(named - modules()) == [], "names in docs/development.md's layout that are no module"



def test_no_module_is_over_500_lines():
    """STYLE: small single-purpose files, 500 lines the cap (split by cohesion, not by count)."""
    long = {str(p.relative_to(REPO)): n for p in (REPO / "arbor").rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 500}
    assert long == {}, long
