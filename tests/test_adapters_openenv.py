"""An OpenEnv environment server driven through its client (arbor.rollout.adapters.openenv),
against the real package and envs/keypad_openenv.py served by uvicorn on this machine
(no Docker): sessions per episode, the observation and reward it returns, replays that
agree (or visibly do not)."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import pytest
from adapter_packages import require

REPO = Path(__file__).resolve().parents[1]

require("openenv", "openenv")
sys.path.insert(0, str(REPO / "envs"))
from keypad_openenv import Keypad  # noqa: E402 (needs openenv)

from arbor.rollout.adapters.openenv import OpenEnvClient, _served  # noqa: E402
from arbor.rollout.environments import Step, load_env  # noqa: E402

APP = f"{REPO / 'envs' / 'keypad_openenv.py'}:app"
ARGS = {"app": APP, "action_field": "guess", "observation_field": "feedback"}


def guess(text: str) -> list[dict]:
    return [{"role": "assistant", "content": text}]


def code(seed: int) -> str:
    keypad = Keypad()
    keypad.reset(seed=seed)
    return keypad.code


@pytest.fixture
def envs():
    made: list[OpenEnvClient] = []

    def make(**kwargs) -> OpenEnvClient:
        made.append(OpenEnvClient(**{**ARGS, **kwargs}))
        return made[-1]

    yield make
    for env in made:
        env.close()


def test_an_episode_through_the_servers_client(envs):
    env = envs()
    start = env.reset({"id": "p", "prompt": "Open the keypad.", "seed": 4}, seed=0)
    assert start == [{"role": "user", "content": "Open the keypad.\n\nFind the 2-digit code. Guess like 12."}]
    assert env.reward() == 0.0  # no step, no reward from the server: unfinished_reward
    secret = code(4)
    wrong = secret[0] + str((int(secret[1]) + 1) % 10)
    assert env.step(guess(wrong)) == Step([{"role": "user", "content": "1 right in place."}])
    assert env.step(guess(secret)) == Step([{"role": "user", "content": "Open!"}], done=True)
    assert env.reward() == 1.0


def test_sessions_are_apart_and_a_running_server_is_reached_by_url(envs):
    first = envs()
    first.reset({"prompt": "", "seed": 1}, 0)
    url = _served(APP, 60)
    second = envs(app=None, url=url)
    second.reset({"prompt": "", "seed": 2}, 0)
    assert second.step(guess(code(2))).done and not first.step(guess(code(2) if code(1) != code(2) else "xx")).done


def test_the_observation_as_json_and_the_last_reward(envs):
    env = envs(observation_field=None, reward="last", unfinished_reward=None)
    (start,) = env.reset({"prompt": "", "seed": 3}, 0)
    assert env.reward() is None
    assert json.loads(start["content"]) == {"feedback": "Find the 2-digit code. Guess like 12."}
    env.step(guess("00"))
    env.step(guess(code(3)))
    assert env.reward() == 1.0


def test_replays_agree_unless_the_environment_reads_the_clock(envs):
    def run(reset_args: dict) -> list[Step]:
        env = envs()
        env.reset({"prompt": "", "seed": 7, "reset_args": reset_args}, 0)
        return [env.step(guess(g)) for g in ("11", "22", "33")]

    assert run({}) == run({})  # what arbor's replay fork checks, turn by turn
    assert run({"jitter": True}) != run({"jitter": True})  # a replay would diverge, and be dropped


@pytest.mark.parametrize("jitter", [False, True])
def test_arbors_replay_check_drops_the_forks_of_a_server_that_reads_the_clock(jitter, caplog):
    """The real client and server in a sampled tree: forks after a turn replay the guesses on a
    new session; with the clock in the feedback every replay differs, is counted and dropped."""
    from adapter_runs import check_replays, sample_a_tree

    caplog.set_level(logging.INFO)  # per-branch lines go to a run's arbor.log, not the console
    problem = {"id": "keypad", "prompt": "", "seed": 7, "reset_args": {"jitter": jitter}}
    tree, stats = sample_a_tree("arbor.rollout.adapters.openenv:OpenEnvClient", ARGS, problem)
    check_replays(tree, stats, diverge=jitter)
    assert ("'keypad': replaying the environment for a new branch diverged at turn" in caplog.text) == jitter


def test_bad_arguments_and_servers_are_clear_errors(envs, tmp_path):
    with pytest.raises(ValueError, match="one of url"):
        OpenEnvClient()
    with pytest.raises(ValueError, match="'sum' or 'last'"):
        OpenEnvClient(url="http://x", reward="mean")  # type: ignore[arg-type]
    (tmp_path / "broken.py").write_text("raise SystemExit('no app here')\n")
    with pytest.raises(RuntimeError, match="exited with code"):
        envs(app=f"{tmp_path / 'broken.py'}:app").reset({"prompt": ""}, 0)
    env = envs(observation_field="screen")
    with pytest.raises(ValueError, match="has only \\['feedback', 'metadata'\\]"):
        env.reset({"prompt": ""}, 0)


def test_it_loads_as_rollout_env_forked_by_replay():
    source = load_env("arbor.rollout.adapters.openenv:OpenEnvClient", kwargs=ARGS)
    assert source.gives_reward and source.make().fork == "replay"


def test_two_rl_steps_of_arbor_train_replay_to_the_trees_and_rewards(tmp_path):
    """configs/env_openenv.yaml for two steps (the keypad served by uvicorn): every server turn
    in the trees is what a new session answers to the same guesses, every reward the server's;
    the trees fork after server turns (by replay)."""
    from adapter_runs import check_episodes, train_steps
    from transformers import AutoTokenizer

    history, trees = train_steps(tmp_path, "configs/env_openenv.yaml", "rollout.width=4",
                                 f"rollout.env_args={{app: '{APP}', action_field: guess, observation_field: feedback}}")
    tokenizer = AutoTokenizer.from_pretrained(REPO / "models" / "tiny-env")
    turns, forks = check_episodes(trees, lambda: OpenEnvClient(**ARGS), tokenizer)
    assert turns > 0 and forks > 0
    assert len(history) == 2 and history[-1]["env/live"] == 0
