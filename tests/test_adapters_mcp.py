"""The tools of a stdio MCP server as an environment (arbor.rollout.adapters.mcp), against the
real MCP SDK and tests/mcp_notes_server.py: tools listed in the chat template's format, calls
and failures answered as tool messages, forks that replay only the side effects."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from adapter_packages import require

require("mcp", "mcp")
from arbor.rollout.adapters.mcp import MCPTools  # noqa: E402 (needs mcp)
from arbor.rollout.adapters.tool_calls import ToolCall, parse_tool_calls  # noqa: E402
from arbor.rollout.environments import Step, load_env  # noqa: E402

SERVER = [sys.executable, str(Path(__file__).with_name("mcp_notes_server.py"))]


def calls(*calls: tuple[str, dict]) -> list[dict]:
    """A model turn making these calls, the Hermes way."""
    text = "".join(f'<tool_call>{json.dumps({"name": n, "arguments": a})}</tool_call>' for n, a in calls)
    return [{"role": "assistant", "content": "Let me see. " + text}]


def answers(step: Step) -> list[str]:
    return [m["content"] for m in step.messages]


@pytest.fixture
def envs():
    made: list[MCPTools] = []

    def make(**kwargs) -> MCPTools:
        made.append(MCPTools(SERVER, **kwargs))
        return made[-1]

    yield make
    for env in made:
        env.close()


def test_tool_calls_are_read_the_hermes_way():
    text = ('<tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call> and '
            '<tool_call>{"name": "b", "arguments": "{\\"y\\": 2}"}</tool_call><tool_call>{"name": 3}</tool_call>'
            "<tool_call>not json</tool_call>")
    a, b, bad_shape, not_json = parse_tool_calls(text)
    assert (a, b) == (ToolCall("a", {"x": 1}), ToolCall("b", {"y": 2}))
    assert "must be" in bad_shape.error and "not JSON" in not_json.error
    assert parse_tool_calls("no call here") == []


def test_the_servers_tools_in_the_chat_templates_format_and_their_answers(envs):
    env = envs()
    assert env.reset({"id": "p", "prompt": "Take notes."}, seed=0) == [{"role": "user", "content": "Take notes."}]
    tools = {t["function"]["name"]: t for t in env.tools}
    assert {"add_note", "count_notes", "read_note", "roll", "fail"} <= set(tools)
    assert tools["add_note"]["type"] == "function"
    assert tools["add_note"]["function"]["description"].startswith("Add a note")
    assert tools["add_note"]["function"]["parameters"]["required"] == ["text"]
    step = env.step(calls(("add_note", {"text": "milk"}), ("read_note", {"index": 0})))
    assert step == Step([{"role": "tool", "content": "1 notes", "error": False},
                         {"role": "tool", "content": "milk", "error": False}])
    failed = env.step(calls(("fail", {"reason": "no"}), ("no_such_tool", {}), ("read_note", {"index": 5})))
    assert [m["error"] for m in failed.messages] == [True, True, True]
    assert "no" in failed.messages[0]["content"] and "no_such_tool" in failed.messages[1]["content"]
    assert env.step([{"role": "assistant", "content": "The note says milk."}]) == Step([], done=True)


def test_the_episode_ends_after_max_tool_turns(envs):
    env = envs(max_tool_turns=2)
    env.reset({"prompt": "p"}, 0)
    assert not env.step(calls(("count_notes", {}))).done
    assert env.step(calls(("count_notes", {}))).done


def test_a_fork_replays_only_the_side_effects_and_siblings_stay_apart(envs):
    env = envs()
    env.reset({"prompt": "p"}, 0)
    env.step(calls(("add_note", {"text": "a"}), ("count_notes", {}), ("read_note", {"index": 0})))
    twin = env.copy()
    env.step(calls(("add_note", {"text": "only in the first branch"})))
    # The twin's own server got add_note("a") replayed (1 call), not the read-only calls.
    assert answers(twin.step(calls(("calls_made", {}), ("count_notes", {})))) == ["1", "1 notes"]
    twin.step(calls(("add_note", {"text": "only in the twin"})))
    assert answers(env.step(calls(("read_note", {"index": 1})))) == ["only in the first branch"]
    assert answers(twin.step(calls(("read_note", {"index": 1})))) == ["only in the twin"]


def test_a_copy_made_before_any_side_effect_starts_fresh_and_unused_copies_start_nothing(envs):
    env = envs()
    env.reset({"prompt": "p"}, 0)
    env.step(calls(("count_notes", {})))
    unused, fresh = env.copy(), env.copy()
    assert answers(fresh.step(calls(("calls_made", {})))) == ["0"]
    assert unused._session is None
    unused.close()
    fresh.close()


def test_a_fork_of_a_server_whose_side_effects_differ_on_replay_raises_naming_the_call(envs):
    env = envs()
    env.reset({"prompt": "p"}, 0)
    env.step(calls(("roll", {})))
    twin = env.copy()
    with pytest.raises(RuntimeError, match=r"replaying side effect 1 of 1 \(roll .*not deterministic.*fork: none"):
        twin.step(calls(("count_notes", {})))
    twin.close()


def test_the_server_gets_the_allow_listed_environment_and_env(envs, monkeypatch):
    monkeypatch.setenv("ARBOR_TEST_SECRET", "do not pass")
    env = envs(env={"NOTES_DIR": "/tmp/notes"})
    env.reset({"prompt": "p"}, 0)
    got = answers(env.step(calls(("environ", {"name": "ARBOR_TEST_SECRET"}), ("environ", {"name": "NOTES_DIR"}))))
    assert got == ["", "/tmp/notes"]


def test_a_server_that_does_not_start_is_a_clear_error_with_its_stderr(envs):
    env = MCPTools([sys.executable, "-c", "import sys; sys.stderr.write('ModuleNotFoundError: No module named "
                                          "mcp_helper\\n'); sys.exit(3)"])
    # The server's own words, not anyio's "unhandled errors in a TaskGroup".
    with pytest.raises(RuntimeError, match=r"did not start: .*its stderr:\n    ModuleNotFoundError: No module named "
                                           r"mcp_helper"):
        env.reset({"prompt": "p"}, 0)
    env.close()
    with pytest.raises(ValueError, match="must be a list"):
        MCPTools("python3 server.py")  # type: ignore[arg-type]


def test_a_bare_python_is_arbors_own_interpreter():
    """configs/env_mcp.yaml launches `python3`: from an un-activated venv (`.venv/bin/arbor`) PATH's
    python3 is the system's, without the venv's packages. A bare python, python3 or python3.N is
    sys.executable; a path is left alone."""
    from arbor.rollout.commands import command_argv

    for name in ("python", "python3", "python3.11"):
        assert MCPTools([name, "server.py"]).params.command == sys.executable
        assert command_argv([name, "-m", "x"]) == [sys.executable, "-m", "x"]
    assert command_argv(["/usr/bin/python3", "s.py"]) == ["/usr/bin/python3", "s.py"]
    assert command_argv(["python3-config"]) == ["python3-config"] and command_argv(["node", "s.js"]) == ["node", "s.js"]


def test_it_loads_as_rollout_env_and_may_refuse_forks_after_a_step():
    source = load_env("arbor.rollout.adapters.mcp:MCPTools", kwargs={"command": SERVER, "fork": "none"})
    assert not source.gives_reward  # the reward functions judge the episode
    env = source.make()
    assert env.fork == "none"
    env.close()


def test_two_rl_steps_of_arbor_train_with_the_servers_tools(tmp_path, monkeypatch):
    """configs/env_mcp.yaml as shipped (`command: [python3, envs/lookup_tools.py]`) for two steps,
    with PATH's first python3 one that has no `mcp` (a bare venv's: what an un-activated
    `.venv/bin/arbor` sees): the server runs under arbor's own interpreter. The prompt shows the
    tool in the template's format, every tool turn in the trees is what a fresh server answers
    to the same calls, every reward the reward function's; the trees fork after tool turns."""
    import subprocess
    import venv

    from adapter_runs import REPO, check_episodes, train_steps
    from transformers import AutoTokenizer

    bare = tmp_path / "bare"
    venv.create(bare, with_pip=False)  # its python3 imports only the standard library
    assert subprocess.run([bare / "bin" / "python3", "-c", "import mcp"], capture_output=True).returncode != 0
    monkeypatch.setenv("PATH", f"{bare / 'bin'}:{os.environ['PATH']}")
    monkeypatch.chdir(REPO)  # the config's envs/lookup_tools.py is relative to the repository
    history, trees = train_steps(tmp_path, "configs/env_mcp.yaml", "rollout.width=4")
    server = [sys.executable, str(REPO / "envs" / "lookup_tools.py")]
    tokenizer = AutoTokenizer.from_pretrained(REPO / "models" / "tiny-env")
    sys.path.insert(0, str(REPO / "envs"))
    from lookup_tools import boxed_value

    tree = trees[1][0]
    assert '"name": "lookup"' in tokenizer.decode(tree.prompt_ids)  # the tool, as the template lists tools
    turns, forks = check_episodes(trees, lambda: MCPTools(server, max_tool_turns=2), tokenizer, boxed_value)
    assert turns > 0 and forks > 0
    assert len(history) == 2 and history[-1]["env/live"] == 0
    assert all(step["failures/total"] == 0 for step in history)  # no server failed to start
