"""arbor's modules import one another without a cycle (docs/development.md, Layout).

Every import counts, also one inside a function or under ``if TYPE_CHECKING:``: a cycle
moved out of sight is still a cycle (the reader, and the next refactor, meet it). The
graph is read from the source with ``ast``, so nothing is imported to check it.
"""

from __future__ import annotations

import ast
from pathlib import Path

ARBOR = Path(__file__).resolve().parents[1] / "arbor"


def module_name(path: Path) -> str:
    parts = path.relative_to(ARBOR.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, modules: set[str]) -> set[str]:
    """The arbor modules ``path`` imports (``from arbor.x import y`` names ``arbor.x.y`` if that is a module)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from .x import y
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            found |= {f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names}
        elif lazy := lazy_exports(node):  # arbor/__init__.py's name -> module table imports on first use
            found |= set(lazy.values())
    return {m for m in found if m in modules and m != name}


def lazy_exports(node: ast.AST) -> dict[str, str]:
    """``_EXPORTS = {"name": "arbor.module", ...}`` (a lazy import table) as a dict, else empty."""
    if isinstance(node, ast.AnnAssign | ast.Assign) and isinstance(node.value, ast.Dict):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        if any(isinstance(t, ast.Name) and t.id == "_EXPORTS" for t in targets):
            return {ast.literal_eval(k): ast.literal_eval(v) for k, v in zip(node.value.keys, node.value.values) if k}
    return {}


def import_graph() -> dict[str, set[str]]:
    paths = sorted(ARBOR.rglob("*.py"))
    modules = {module_name(p) for p in paths}
    return {module_name(p): imported_modules(p, modules) for p in paths}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a path ``[a, b, ..., a]``, or None (depth-first, three colours)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_find_cycle_finds_one_and_only_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"a"}}) == ["a", "a"]


def test_the_graph_sees_every_kind_of_import():
    graph = import_graph()
    assert "arbor.run.phases" in graph["arbor.run.trainer"]  # from arbor.run import phases
    assert "arbor.engines.connect" in graph["arbor.run.phases"]  # from arbor.engines.connect import ...
    assert "arbor.train.learner" in graph["arbor.run.learner_group"]  # inside a function
    assert "arbor.train.packed_loss" in graph["arbor"]  # arbor/__init__.py's lazy table


def test_a_lazy_table_is_read_as_imports():
    table, other = ast.parse('_EXPORTS: dict[str, str] = {"pack_trees": "arbor.train.packing"}\nOTHER = {"a": "b"}').body
    assert lazy_exports(table) == {"pack_trees": "arbor.train.packing"}
    assert lazy_exports(other) == {}


def test_no_import_cycle_among_arbors_modules():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


# The stages, in pipeline order. A stage may import the shared records at the top of the
# package (config, its loader, parser and overrides, data, tree, errors, plugins) and the engine protocol; rollout and train are
# independent of each other and of the run that drives them, and the engines serve any caller.
STAGES = ("rollout", "train", "run", "engines")
FORBIDDEN = {
    "rollout": {"train", "run"},
    "train": {"rollout", "run"},
    "engines": {"rollout", "train", "run"},
    "run": set(),
}
TOP_RECORDS = {"arbor.config", "arbor.config_load", "arbor.config_override", "arbor.config_parse", "arbor.data", "arbor.dataset_files", "arbor.dataset_sources", "arbor.tree", "arbor.errors", "arbor.plugins"}


def stage_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 and parts[1] in STAGES else None


def layering_violations(graph: dict[str, set[str]]) -> list[str]:
    found = []
    for module, imports in sorted(graph.items()):
        stage = stage_of(module)
        for target in sorted(imports):
            target_stage = stage_of(target)
            if stage is not None and target_stage in FORBIDDEN[stage]:
                found.append(f"{module} imports {target} ({stage} must not import {target_stage})")
            if module in TOP_RECORDS and target_stage is not None:
                found.append(f"{module} imports {target} (a shared record must not import a stage)")
    return found


def test_layering_check_finds_a_violation():
    graph = {"arbor.train.learner": {"arbor.rollout.sampler"}, "arbor.tree": {"arbor.train.packing"},
             "arbor.run.trainer": {"arbor.train.learner", "arbor.rollout.sampler"}}
    assert layering_violations(graph) == [
        "arbor.train.learner imports arbor.rollout.sampler (train must not import rollout)",
        "arbor.tree imports arbor.train.packing (a shared record must not import a stage)",
    ]


def test_every_module_lives_in_a_stage_or_is_a_shared_record():
    top = {m for m in import_graph() if stage_of(m) is None and m.count(".") == 1} - {f"arbor.{s}" for s in STAGES}
    entry_points = {"arbor.cli", "arbor.__main__", "arbor.viewer"}
    assert top <= TOP_RECORDS | entry_points, sorted(top - TOP_RECORDS - entry_points)


def test_stages_respect_the_layering():
    assert layering_violations(import_graph()) == []


def test_the_engines_never_reach_into_the_run_layer():
    """Control flows down: an engine client reports a dead server, the run decides to restart
    it (arbor.run.recovery); no module of engines/ imports run/, not even for a type."""
    graph = import_graph()
    engines = [m for m in graph if stage_of(m) == "engines"]
    assert "arbor.engines.client" in engines
    assert [(m, t) for m in engines for t in sorted(graph[m]) if stage_of(t) == "run"] == []
