"""The lists in tests/conftest.py (slow, resources, time limits) name files and tests that
exist: a renamed test would otherwise drop out of them silently (and slow the fast subset
down, run under no marker, or lose its time limit)."""

import ast
from pathlib import Path

import conftest
import pytest

TESTS = Path(__file__).resolve().parent


def defined_tests(name: str) -> set[str]:
    tree = ast.parse((TESTS / name).read_text())
    return {node.name for node in tree.body if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}


def test_every_listed_file_and_test_exists():
    entries = {f"{name}::{test}" for name, tests in conftest.SLOW_TESTS.items() for test in tests}
    entries |= conftest.SLOW_FILES | set(conftest.TIME_LIMITS)
    entries |= {entry for listed in conftest.RESOURCES.values() for entry in listed}
    missing = []
    for entry in sorted(entries):
        name, _, test = entry.partition("::")
        if not (TESTS / name).is_file() or (test and test not in defined_tests(name)):
            missing.append(entry)
    assert missing == []


class Item:
    """What the hook reads of a collected test: its file, its function's name, its markers."""

    def __init__(self, path: str, originalname: str, *marks: pytest.MarkDecorator) -> None:
        self.fspath, self.originalname, self.name = TESTS / path, originalname, originalname
        self.marks = [mark.mark for mark in marks]

    def add_marker(self, marker: str | pytest.MarkDecorator) -> None:
        self.marks.append(getattr(pytest.mark, marker).mark if isinstance(marker, str) else marker.mark)

    def get_closest_marker(self, name: str):
        return next((mark for mark in self.marks if mark.name == name), None)

    @property
    def markers(self) -> list[str]:
        return [mark.name for mark in self.marks if mark.name != "timeout"]

    @property
    def timeout(self) -> float | None:
        mark = self.get_closest_marker("timeout")
        return mark.args[0] if mark else None


def test_the_hook_marks_listed_files_and_tests_only(pytestconfig):
    items = [Item("test_trainer.py", "test_anything"), Item("test_sft.py", "test_the_sft_recipe_runs"),
             Item("test_sft.py", "test_bad_lines_name_file_and_line"), Item("test_loss.py", "test_the_sft_recipe_runs"),
             Item("test_launch.py", "test_every_flag_arbor_passes_is_one_sglang_parses"),
             Item("test_two_nodes.py", "test_a_real_sglang_server_on_the_other_node")]
    conftest.pytest_collection_modifyitems(items)
    assert [item.markers for item in items] == [["slow", "ray"], ["slow"], [], [], ["slow", "sglang"],
                                                ["slow", "ray", "sglang", "netns"]]
    markers = "\n".join(pytestconfig.getini("markers"))  # registered: no unknown-marker warning
    assert all(f"{name}:" in markers for name in ["slow", *conftest.RESOURCES])


def test_time_limits_a_tests_own_entry_over_its_files_and_a_mark_in_the_file_over_both():
    items = [Item("test_loss.py", "test_anything"), Item("test_sglang_runs.py", "test_anything"),
             Item("test_sglang_runs.py", "test_quickstart_async_on_sglang_then_arbor_eval"),
             Item("test_sglang_runs.py", "test_anything", pytest.mark.timeout(42))]
    conftest.pytest_collection_modifyitems(items)
    assert [item.timeout for item in items] == [None, 900, 1860, 42]


def test_a_test_past_its_limit_fails_by_name_with_every_threads_stack(tmp_path):
    """pytest-timeout's thread method through conftest's hook, on a test hung in a subprocess."""
    import subprocess
    import sys

    (tmp_path / "conftest.py").write_text(  # tests/conftest.py's hook, loaded under another name
        "import importlib.util\n"
        f"spec = importlib.util.spec_from_file_location('suite_conftest', {str(TESTS / 'conftest.py')!r})\n"
        "suite = importlib.util.module_from_spec(spec)\nspec.loader.exec_module(suite)\n"
        "pytest_timeout_set_timer = suite.pytest_timeout_set_timer\n")
    (tmp_path / "test_hang.py").write_text(
        "import subprocess, sys, threading, time\nimport pytest\n\n"
        "@pytest.mark.timeout(2)\ndef test_hangs():\n"
        "    threading.Thread(target=time.sleep, args=(30,), name='a-helper', daemon=True).start()\n"
        "    subprocess.run([sys.executable, '-c', 'import time; time.sleep(30)'])\n")
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-c", str(TESTS.parent / "pyproject.toml"),
                           "--rootdir", str(tmp_path), str(tmp_path / "test_hang.py")],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 1, done.stdout[-3000:]
    assert "test_hang.py::test_hangs ran past its time limit of 2 s" in done.stdout, done.stdout[-3000:]
    stacks = done.stdout.split("+ Timeout +")[1]
    assert "Stack of a-helper" in stacks and "Stack of MainThread" in stacks and "in test_hangs" in stacks
