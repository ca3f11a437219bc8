"""verifiers environments (the classic MultiTurnEnv / ToolEnv API) run by arbor
(arbor.rollout.adapters.verifiers), against the real package and tests/verifiers_envs.py:
the environment's own rollout loop, arbor's turns as its client, its rubric as the reward."""

from __future__ import annotations

import asyncio
import logging

import pytest
from adapter_packages import require

require("verifiers", "verifiers")
from arbor.rollout.adapters.verifiers import VerifiersEnv, load_environment  # noqa: E402 (needs verifiers)
from arbor.rollout.environments import Step, load_env  # noqa: E402

LOOKUP = "verifiers_envs:load_lookup_env"
COUNTDOWN = "verifiers_envs:load_countdown_env"


def said(text: str) -> list[dict]:
    return [{"role": "assistant", "content": text}]


def call(key: str) -> list[dict]:
    return said(f'Looking it up. <tool_call>{{"name": "lookup", "arguments": {{"key": "{key}"}}}}</tool_call>')


@pytest.fixture(scope="module")
def lookup_rows():
    """The environment's own dataset, as `env.get_dataset().to_json(...)` exports it."""
    return [{"id": f"k{i}", **row} for i, row in enumerate(load_environment(LOOKUP, "{}").get_dataset().to_list())]


def episode(env_spec: str, problem: dict, turns: list[list[dict]], args: dict | None = None) -> tuple:
    """Reset, step through ``turns`` (stopping when done), read the reward, close."""
    async def run():
        env = VerifiersEnv(env_spec, args)
        try:
            start = await env.reset(problem, seed=0)
            steps = []
            for turn in turns:
                steps.append(await env.step(turn))
                if steps[-1].done:
                    break
            return start, env.tools, steps, await env.reward()
        finally:
            await env.close()

    return asyncio.run(run())


def test_a_tool_env_episode_its_tools_answers_and_rubric(lookup_rows):
    problem = lookup_rows[3]  # k3 holds v1
    start, tools, steps, reward = episode(LOOKUP, problem, [call("k3"), said("It is v1.")])
    assert start == [{"role": "system", "content": "Call tools with <tool_call>{...}</tool_call>."},
                     {"role": "user", "content": "What is stored under k3? Use the lookup tool."}]
    (tool,) = tools
    assert tool["function"]["name"] == "lookup" and tool["function"]["parameters"]["required"] == ["key"]
    assert steps == [Step([{"role": "tool", "content": "v1"}]), Step([], done=True)]  # no call: ToolEnv stops
    assert reward == 1.0
    assert episode(LOOKUP, problem, [call("k3"), said("It is v9.")])[3] == 0.0


def test_a_failing_tool_call_is_answered_as_the_environment_formats_it(lookup_rows):
    _, _, steps, _ = episode(LOOKUP, lookup_rows[0], [call("nope")])
    assert steps[0].messages[0]["role"] == "tool" and "nope" in steps[0].messages[0]["content"]


def test_a_multi_turn_env_answers_each_turn_until_its_stop_condition():
    problem = {"id": "c", "prompt": "Count.", "answer": ""}
    _, tools, steps, reward = episode(COUNTDOWN, problem, [said("one"), said("two"), said("three"), said("four")],
                                      {"turns": 3})
    assert tools == []
    assert steps == [Step([{"role": "user", "content": "2 turns left. You said: one"}]),
                     Step([{"role": "user", "content": "1 turns left. You said: two"}]),
                     Step([], done=True)]  # max_turns=3 reached
    assert reward == 3.0  # the rubric counted the 3 turns


def test_an_episode_arbor_ends_first_is_scored_on_the_turns_the_environment_saw():
    _, _, steps, reward = episode(COUNTDOWN, {"id": "c", "prompt": "Count.", "answer": ""}, [said("one")],
                                  {"turns": 5})
    assert not steps[-1].done and reward == 1.0


def test_replays_of_an_episode_answer_alike(lookup_rows):
    """What arbor's replay fork checks: a fresh instance stepped with the same turns says the same."""
    runs = [episode(LOOKUP, lookup_rows[5], [call("k5"), call("k1"), said("v5")]) for _ in range(2)]
    assert runs[0] == runs[1]


@pytest.mark.parametrize(("environment", "diverge"), [(COUNTDOWN, False), ("verifiers_envs:load_clock_env", True)])
def test_arbors_replay_check_drops_the_forks_of_an_environment_that_reads_the_clock(environment, diverge, caplog):
    """The real adapter and the environment's own loop in a sampled tree: forks after a turn
    replay its turns on a new instance; answers that read the clock differ, counted and dropped."""
    from adapter_runs import check_replays, sample_a_tree

    caplog.set_level(logging.INFO)  # per-branch lines go to a run's arbor.log, not the console
    problem = {"id": "count", "prompt": "Count.", "answer": ""}
    tree, stats = sample_a_tree("arbor.rollout.adapters.verifiers:VerifiersEnv",
                                {"environment": environment, "args": {"turns": 4}}, problem)
    check_replays(tree, stats, diverge=diverge)
    assert ("'count': replaying the environment for a new branch diverged at turn" in caplog.text) == diverge


def test_closing_mid_episode_cancels_the_rollout(lookup_rows):
    async def run():
        env = VerifiersEnv(LOOKUP)
        await env.reset(lookup_rows[0], 0)
        task = env._rollout
        await env.close()
        return task

    task = asyncio.run(run())
    assert task.cancelled()


def test_environments_load_once_and_must_be_verifiers_environments():
    assert load_environment(LOOKUP, "{}") is load_environment(LOOKUP, "{}")
    with pytest.raises(TypeError, match="not a verifiers Environment"):
        VerifiersEnv("verifiers_envs:TABLE")
    source = load_env("arbor.rollout.adapters.verifiers:VerifiersEnv", kwargs={"environment": LOOKUP})
    assert source.gives_reward and source.make().fork == "replay"


def test_two_rl_steps_of_arbor_train_run_the_environments_loop(tmp_path):
    """configs/env_verifiers.yaml for two steps (envs/lookup_tools.py's ToolEnv): the prompt
    shows its tool_defs, every environment turn in the trees is what the environment's own loop
    answers to the same turns (replayed), every reward its rubric's; forks by replay after them."""
    from adapter_runs import REPO, check_episodes, train_steps
    from transformers import AutoTokenizer

    environment = f"{REPO / 'envs' / 'lookup_tools.py'}:load_environment"
    history, trees = train_steps(tmp_path, "configs/env_verifiers.yaml", "rollout.width=4",
                                 f"rollout.env_args={{environment: '{environment}', args: {{max_turns: 3}}}}")
    tokenizer = AutoTokenizer.from_pretrained(REPO / "models" / "tiny-env")
    assert '"name": "lookup"' in tokenizer.decode(trees[1][0].prompt_ids)
    turns, forks = check_episodes(trees, lambda: VerifiersEnv(environment, {"max_turns": 3}), tokenizer)
    assert turns > 0 and forks > 0
    assert len(history) == 2 and history[-1]["env/live"] == 0
