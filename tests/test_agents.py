"""Agents: loading with errors naming the key, and tool turns appended as template ids."""

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from arbor.errors import ConfigError
from arbor.rollout.agents import continuation_ids, load_agent

REPO = Path(__file__).resolve().parents[1]


def test_the_default_agent_loads_and_ends_after_one_turn():
    agent = load_agent("agents/single_turn.py:SingleTurn", search_dirs=[str(REPO)])
    problem = {"id": "p", "prompt": "What is 2+2?", "answer": "4"}
    assert agent.start(problem) == [{"role": "user", "content": "What is 2+2?"}]
    assert agent.step(problem, [{"role": "assistant", "content": "4"}]) is None


def test_invalid_agents_fail_naming_the_key(tmp_path):
    (tmp_path / "bad.py").write_text(
        "class NoStep:\n    def start(self, problem):\n        return []\n"
        "class NeedsArgs:\n    def __init__(self, x):\n        pass\n"
        "def start(problem):\n    return []\n"
    )
    for spec, message in (("bad.py:NoStep", "has no step method"),
                          ("bad.py:NeedsArgs", "cannot be built without arguments"),
                          ("bad.py:Nothing", "has no attribute"),
                          ("nowhere.py:X", "rollout.agent")):
        with pytest.raises(ConfigError, match="rollout.agent") as info:
            load_agent(spec, search_dirs=[str(tmp_path)])
        assert message in str(info.value), (spec, str(info.value))


def test_tool_turns_are_appended_as_the_templates_ids():
    tokenizer = AutoTokenizer.from_pretrained(REPO / "models" / "tiny-arith")  # ChatML, EOS <|im_end|>
    tool = [{"role": "tool", "content": "x = 5"}]
    ids = continuation_ids(tokenizer, tool)
    # After the model's own <|im_end|>: the template's newline, the tool turn, the next prompt.
    assert tokenizer.decode(ids) == "\n<|im_start|>tool\nx = 5<|im_end|>\n<|im_start|>assistant\n"
    # Appending to a real conversation gives exactly what the template renders for it.
    turn = [{"role": "user", "content": "What is 2+3?"}]
    prompt = tokenizer.apply_chat_template(turn, add_generation_prompt=True, tokenize=True)["input_ids"]
    answer = tokenizer.encode("2+3=5 \\boxed{5}", add_special_tokens=False) + [tokenizer.eos_token_id]
    rendered = tokenizer.apply_chat_template(
        turn + [{"role": "assistant", "content": "2+3=5 \\boxed{5}"}] + tool, add_generation_prompt=True,
        tokenize=True)["input_ids"]
    assert list(prompt) + answer + ids == list(rendered)


def test_templates_that_rewrite_history_are_refused(tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(REPO / "models" / "tiny-arith")
    # Renders only the last message: adding one changes what came before.
    tokenizer.chat_template = "{{ messages[-1]['content'] }}{% if add_generation_prompt %}>{% endif %}"
    with pytest.raises(ValueError, match="rewrites earlier turns"):
        continuation_ids(tokenizer, [{"role": "tool", "content": "x"}])


def test_python_tool_runs_the_last_code_block_and_reports_errors():
    agent = load_agent("agents/python_tool.py:PythonTool", search_dirs=[str(REPO)])
    problem = {"id": "p", "prompt": "What is 6*7?", "answer": "42"}
    assert "```python" in agent.start(problem)[0]["content"]
    history = agent.start(problem) + [{"role": "assistant", "content": "```python\nprint(6*7)\n```"}]
    assert agent.step(problem, history) == [{"role": "tool", "content": "42\n"}]
    crash = agent.start(problem) + [{"role": "assistant", "content": "```python\nraise ValueError('no')\n```"}]
    (message,) = agent.step(problem, crash)
    assert message["error"] is True and "ValueError: no" in message["content"]
    done = history + [{"role": "tool", "content": "42\n"}, {"role": "assistant", "content": "\\boxed{42}"}]
    assert agent.step(problem, done) is None  # no code: the episode ends


def test_agent_args_from_the_config_build_the_class(tmp_path):
    from arbor.config_load import load_config

    config = tmp_path / "agent.yaml"
    config.write_text(
        "rollout:\n  agent: agents/python_tool.py:PythonTool\n"
        "  agent_args: {max_tool_calls: 1, timeout_s: 2.5}\n"
    )
    cfg = load_config(config, ["rollout.agent_args.max_output_chars=300"])
    assert cfg.rollout.agent_args == {"max_tool_calls": 1, "timeout_s": 2.5, "max_output_chars": 300}
    agent = load_agent(cfg.rollout.agent, search_dirs=[str(REPO)], kwargs=cfg.rollout.agent_args)
    assert (agent.max_tool_calls, agent.timeout_s, agent.max_output_chars) == (1, 2.5, 300)
    with pytest.raises(ConfigError, match="cannot be built with rollout.agent_args .*max_tools"):
        load_agent(cfg.rollout.agent, search_dirs=[str(REPO)], kwargs={"max_tools": 1})
    (tmp_path / "inst.py").write_text(
        "class A:\n    def start(self, p):\n        return []\n    def step(self, p, h):\n        return None\n"
        "agent = A()\n"
    )
    with pytest.raises(ConfigError, match="rollout.agent_args: 'inst.py:agent' is an object"):
        load_agent("inst.py:agent", search_dirs=[str(tmp_path)], kwargs={"x": 1})
    config.write_text("rollout:\n  agent_args: [1, 2]\n")
    with pytest.raises(ConfigError, match="rollout.agent_args must be a mapping"):
        load_config(config)


def test_python_tool_agent_without_a_sandbox_fails_at_start_up(tmp_path, monkeypatch, capsys):
    """`arbor train` of the tool config on a machine that can run neither bubblewrap nor
    a network namespace stops before any work, saying why, at each step:
    `rollout.agent_args.allow_unsandboxed=true` then `allow_network=true` opt out."""
    from arbor.cli import main

    monkeypatch.chdir(REPO)
    monkeypatch.setenv("PATH", str(tmp_path))  # no `bwrap`, no `unshare` reachable
    assert main(["train", "configs/agent_math.yaml", "--dry-run"]) == 2
    report = capsys.readouterr().out
    assert "FAIL  tool sandbox: cannot run tools in bubblewrap here (no `bwrap`" in report
    unsandboxed = "rollout.agent_args.allow_unsandboxed=true"
    assert main(["train", "configs/agent_math.yaml", "--dry-run", unsandboxed]) == 2
    assert "FAIL  tool sandbox: cannot cut tools off the network here (no `unshare`" in capsys.readouterr().out
    assert main(["train", "configs/agent_math.yaml", "--dry-run", unsandboxed, "rollout.agent_args.allow_network=true"]) == 0
    assert "ok    rollout.agent: agents/python_tool.py:PythonTool: the agent builds" in capsys.readouterr().out


def test_a_tool_messages_error_flag_never_reaches_the_chat_template():
    """``error`` is arbor's field (the tool-error metric), not the chat format's: a template
    that would render it (here one that prints every message's ``error``) gets the message without it."""
    tokenizer = AutoTokenizer.from_pretrained(REPO / "models" / "tiny-arith")
    tokenizer.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m.role }}{% if m.error is defined %} failed{% endif %}\n"
        "{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    failed = continuation_ids(tokenizer, [{"role": "tool", "content": "Traceback", "error": True}])
    assert failed == continuation_ids(tokenizer, [{"role": "tool", "content": "Traceback"}])
    assert "failed" not in tokenizer.decode(failed)
