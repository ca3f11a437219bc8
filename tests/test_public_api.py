"""The public API: ``arbor.__all__`` imports, stays cheap to import, is what the bundled
agents, rewards and configs use, and ``docs/api.md`` describes it as it is."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from script_loader import load_script

import arbor

REPO = Path(__file__).resolve().parents[1]
REQUIRED = {  # the names users' code is promised
    "RolloutTree", "Node", "sample_trees", "RolloutConfig", "load_config", "compute_advantages", "pack_trees",
    "policy_loss", "score_batch", "ToolPool", "prompt_messages", "SGLangClient", "WeightSync",
    "GenerateRequest", "GenerateOutput", "SamplingParams",
}


@pytest.mark.parametrize("name", sorted(set(arbor.__all__) - {"__version__"}))
def test_every_public_name_imports_from_its_module(name):
    if arbor._EXPORTS[name].startswith("arbor.rollout.adapters."):  # needs its optional extra (CI has them all)
        from adapter_packages import require

        package = {"reasoning_gym": "reasoning_gym", "textarena": "textarena", "mcp": "mcp", "verifiers": "verifiers",
                   "openenv": "openenv"}.get(arbor._EXPORTS[name].rsplit(".", 1)[1])
        if package is not None:
            require(package, package.replace("_", "-"))
    module = importlib.import_module(arbor._EXPORTS[name])
    assert getattr(arbor, name) is getattr(module, name)


def test_the_promised_names_and_every_config_section_are_public():
    sections = {f.type for f in dataclasses.fields(arbor.Config) if str(f.type).endswith("Config")}
    assert sections, "Config's fields are its sections"
    assert REQUIRED | sections <= set(arbor.__all__)


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'pack_tree'"):
        arbor.pack_tree  # noqa: B018


def test_type_checkers_see_the_same_names_as_the_lazy_table():
    """The ``if TYPE_CHECKING:`` imports of arbor/__init__.py list exactly ``_EXPORTS``."""
    tree = ast.parse((REPO / "arbor" / "__init__.py").read_text())
    block = next(n for n in tree.body if isinstance(n, ast.If) and getattr(n.test, "id", "") == "TYPE_CHECKING")
    seen = {alias.name: node.module for node in block.body if isinstance(node, ast.ImportFrom) for alias in node.names}
    assert seen == arbor._EXPORTS


def test_import_arbor_loads_no_heavy_dependency():
    """The CLI and every Ray worker import arbor: it must not pull torch, ray or aiohttp in."""
    code = "import sys, arbor; print(sorted(m for m in ('torch', 'ray', 'aiohttp', 'yaml', 'transformers') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    assert out.stdout.strip() == "[]"


def arbor_imports(path: Path, root: Path = REPO) -> list[str]:
    """``path``'s imports of arbor modules other than ``arbor`` itself, as ``file:line: module``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        modules = [a.name for a in node.names] if isinstance(node, ast.Import) else (
            [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
        found += [f"{path.relative_to(root)}:{node.lineno}: {m}" for m in modules if m.startswith("arbor.")]
    return found


def test_arbor_imports_finds_an_internal_import(tmp_path):
    plugin = tmp_path / "probe.py"
    plugin.write_text("from arbor import ToolPool\nfrom arbor.rollout.tools import ToolResult\nimport arbor.data\n")
    assert arbor_imports(plugin, tmp_path) == ["probe.py:2: arbor.rollout.tools", "probe.py:3: arbor.data"]


def test_bundled_agents_and_rewards_use_only_the_public_api():
    files = sorted((REPO / "agents").glob("*.py")) + sorted((REPO / "rewards").glob("*.py"))
    assert files
    assert [hit for f in files for hit in arbor_imports(f)] == []


def plugin_strings(node: object) -> list[str]:
    if isinstance(node, dict):
        return [s for v in node.values() for s in plugin_strings(v)]
    if isinstance(node, list):
        return [s for v in node for s in plugin_strings(v)]
    return [node] if isinstance(node, str) and re.fullmatch(r"[\w./-]+:\w+", node) else []


def test_bundled_configs_name_no_internal_module():
    specs = [s for path in sorted((REPO / "configs").glob("*.yaml")) for s in plugin_strings(yaml.safe_load(path.read_text()))]
    assert specs, "the configs name reward functions"
    assert [s for s in specs if s.startswith("arbor.")] == []


def test_docs_api_page_is_fresh():
    """docs/api.md is what scripts/api_docs.py writes (run it after changing the API)."""
    api_docs = load_script("api_docs")
    assert (REPO / "docs" / "api.md").read_text() == api_docs.page()


def test_the_page_names_every_public_name_with_its_signature():
    api_docs = load_script("api_docs")
    text = api_docs.page()
    assert "def compute_advantages(trees: Sequence[RolloutTree], estimator: str, *," in text
    assert "class RolloutEngine(Protocol):\n    async def generate(self, request: GenerateRequest)" in text
    for name in set(arbor.__all__) - {"__version__"}:
        assert f"### `{name}`" in text
