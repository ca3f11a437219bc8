"""Extension specs (`module:attr`, `path.py:attr`) resolve or fail naming the config key."""

import pytest

from arbor.errors import ConfigError
from arbor.plugins import default_search_dirs, load_object


def test_dotted_module():
    assert load_object("os.path:join", "reward.functions[0].fn") is __import__("os").path.join


def test_file_spec_relative_to_search_dirs(tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "score.py").write_text("def fn(problem, completion):\n    return 1.0\n")
    fn = load_object("mine/score.py:fn", "k", [str(tmp_path)])
    assert fn({}, "x") == 1.0
    # The same file gives the same module object (shared state, no double import).
    assert load_object(f"{tmp_path}/mine/score.py:fn", "k") is fn


def test_dotted_module_found_in_config_dir(tmp_path):
    (tmp_path / "cfg").mkdir()
    (tmp_path / "my_agents_pkg_xyz").mkdir()
    (tmp_path / "my_agents_pkg_xyz" / "a.py").write_text("class Agent:\n    pass\n")
    dirs = default_search_dirs(tmp_path / "cfg" / "run.yaml")
    assert str(tmp_path) in dirs
    assert load_object("my_agents_pkg_xyz.a:Agent", "rollout.agent", dirs).__name__ == "Agent"


@pytest.mark.parametrize(
    "spec, message",
    [
        ("nocolon", "expected 'module:attr'"),
        ("a:b:c", "expected 'module:attr'"),
        (":attr", "expected 'module:attr'"),
        ("no_such_module_xyz:fn", "cannot import module 'no_such_module_xyz'"),
        ("os.path:no_such_attr", "has no attribute 'no_such_attr'"),
        ("missing/file.py:fn", "file 'missing/file.py' not found"),
    ],
)
def test_errors_name_the_key(spec, message):
    with pytest.raises(ConfigError) as err:
        load_object(spec, "reward.functions[1].fn")
    assert str(err.value).startswith("reward.functions[1].fn:") and message in str(err.value)


def test_module_that_raises_at_import(tmp_path):
    (tmp_path / "broken.py").write_text("raise RuntimeError('boom')\n")
    with pytest.raises(ConfigError, match=r"rollout.agent: loading .*broken.py.* RuntimeError: boom"):
        load_object("broken.py:x", "rollout.agent", [str(tmp_path)])
