"""The framework examples of agents/ (OpenAI Agents SDK; LangGraph with langchain-openai)
against arbor's endpoint: a tool-call round trip through each framework is token-exact, and
each trains 2 `arbor train` steps on the quickstart model with the embedded engine (the
real-SGLang runs are in tests/test_sglang_runs.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_programs import TOOL_CALL, ScriptedEngine, run
from transformers import AutoTokenizer

from arbor.config_load import load_config
from arbor.plugins import load_object
from arbor.run.trainer import train

REPO = Path(__file__).resolve().parents[1]
PROGRAMS = ["agents/openai_tool.py:program", "agents/openai_agents_sdk.py:program", "agents/langgraph_tool.py:program"]


@pytest.mark.parametrize("spec", PROGRAMS)
def test_a_framework_sends_the_tool_call_back_token_exact(spec: str) -> None:
    tokenizer = AutoTokenizer.from_pretrained(REPO / "models" / "tiny-arith")
    engine = ScriptedEngine(tokenizer, [TOOL_CALL, "35 \\\\boxed{35}", "35", "35"])
    program = load_object(spec, "rollout.program", [str(REPO)])
    tree, stats = run(engine, program, tokenizer, width=2, branch=2)
    assert stats.program_errors == 0 and stats.program_diverged == 0
    assert stats.program_retokenized == 0 and stats.program_offpath_calls == 0
    # The tool call, its answer, then follow-ups: three calls per run (openai_tool), or four.
    assert stats.program_calls in (2 * 3, 2 * 4)
    for leaf in tree.leaves():
        path = tree.path(leaf)
        answers = [tokenizer.decode(n.token_ids, skip_special_tokens=True) for n in path if n.loss_mask is None]
        assert answers == [TOOL_CALL, "35 \\\\boxed{35}", "35", "35"][: stats.program_calls // 2]
        context = [tokenizer.decode(n.token_ids) for n in path if n.loss_mask is not None]
        assert "<|im_start|>tool\n35<|im_end|>" in context[0]  # the calculator's answer, as context


@pytest.mark.parametrize("spec", PROGRAMS[1:])
def test_a_framework_program_trains_two_steps(tmp_path, spec: str) -> None:
    history = train(load_config(REPO / "configs" / "program_openai.yaml", [
        f"run.output_dir={tmp_path}", f"rollout.program={spec}", "data.prompts_per_step=2", "run.steps=2",
        "run.cpu_threads=1"]))
    assert len(history) == 2
    for metrics in history:
        assert metrics["program/replayed_calls"] > 0 and metrics["program/retokenized"] == 0
        assert metrics["program/errors"] == 0 and metrics["program/diverged"] == 0
        assert metrics["mismatch/kl"] <= 1e-4
