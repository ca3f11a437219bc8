"""The slow list in tests/conftest.py names files and tests that exist: a renamed test would
otherwise drop out of it silently and slow the fast subset down."""

import ast
from pathlib import Path

import conftest

TESTS = Path(__file__).resolve().parent


def test_every_listed_file_and_test_exists():
    missing = [name for name in conftest.SLOW_FILES | set(conftest.SLOW_TESTS) if not (TESTS / name).is_file()]
    for name, tests in conftest.SLOW_TESTS.items():
        if (TESTS / name).is_file():
            tree = ast.parse((TESTS / name).read_text())
            defined = {node.name for node in tree.body if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}
            missing += [f"{name}::{test}" for test in sorted(tests - defined)]
    assert missing == []


class Item:
    """What the hook reads of a collected test: its file, its function's name, its markers."""

    def __init__(self, path: str, originalname: str) -> None:
        self.fspath, self.originalname, self.name, self.markers = TESTS / path, originalname, originalname, []

    def add_marker(self, marker) -> None:
        self.markers.append(marker.name)


def test_the_hook_marks_listed_files_and_tests_only(pytestconfig):
    items = [Item("test_trainer.py", "test_anything"), Item("test_sft.py", "test_the_sft_recipe_runs"),
             Item("test_sft.py", "test_bad_lines_name_file_and_line"), Item("test_loss.py", "test_the_sft_recipe_runs")]
    conftest.pytest_collection_modifyitems(items)
    assert [item.markers for item in items] == [["slow"], ["slow"], [], []]
    assert "slow:" in "\n".join(pytestconfig.getini("markers"))  # registered: no unknown-marker warning
