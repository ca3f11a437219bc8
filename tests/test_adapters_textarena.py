"""TextArena's single-player games as environments (arbor.rollout.adapters.textarena), against
the real package: the game's own prompt, hints and reward; forks by copy that carry the
random state the game draws from, isolated from their siblings and from other games."""

from __future__ import annotations

import random
import threading

from adapter_packages import require

require("textarena", "textarena")
from arbor.rollout.adapters.textarena import TextArenaGame  # noqa: E402 (needs textarena)
from arbor.rollout.environments import Step, load_env  # noqa: E402


def move(text: str) -> list[dict]:
    return [{"role": "assistant", "content": text}]


def test_the_game_prompts_answers_and_rewards_the_player():
    game = TextArenaGame("GuessTheNumber-v0-raw")
    (prompt,) = game.reset({"id": "g", "seed": 3}, seed=99)  # the problem's seed wins
    assert prompt["role"] == "user" and "Guess The Number" in prompt["content"]
    assert game.step(move("I say [10]")) == Step([{"role": "user", "content": "The target number is lower."}])
    invalid = game.step(move("ten"))
    assert "invalid move" in invalid.messages[0]["content"] and not invalid.done
    assert game.reward() == 0.0  # unfinished: unfinished_reward
    assert game.step(move("[8]")).done and game.reward() == 1.0  # seed 3 hides 8


def test_the_seed_makes_the_game():
    def secret(seed: int) -> int:
        game = TextArenaGame("GuessTheNumber-v0-raw")
        game.reset({}, seed)
        return game._env.game_number

    assert secret(3) == secret(3) == 8 and len({secret(s) for s in range(8)}) > 1


def test_a_copy_carries_the_random_state_and_siblings_stay_apart():
    """2048 draws a new tile from Python's global random after every move: a copy must go on
    drawing what the original would, whatever else uses random meanwhile."""
    game = TextArenaGame("2048-v0-raw")
    game.reset({}, seed=5)
    game.step(move("[up]"))
    outside = random.getstate()
    twin = game.copy()
    left = game.step(move("[left]"))
    random.seed(1234)  # someone else's draws between the calls
    random.random()
    assert twin.step(move("[left]")) == left  # the same tile in the same place
    sibling = game.copy()
    sibling.step(move("[down]"))
    sibling.step(move("[right]"))
    assert game.step(move("[up]")) == twin.step(move("[up]"))  # the sibling's moves reached neither
    random.setstate(outside)


def test_game_calls_leave_the_process_random_state_alone_and_games_in_threads_apart():
    random.seed(7)
    expected = random.random()
    random.seed(7)
    game = TextArenaGame("2048-v0-raw")
    game.reset({}, seed=1)
    game.step(move("[up]"))
    assert random.random() == expected

    def play(out: list) -> None:
        g = TextArenaGame("2048-v0-raw")
        g.reset({}, seed=2)
        out.extend(g.step(move(m)) for m in ["[up]", "[left]", "[down]", "[right]"] * 3)

    runs: list[list] = [[], [], []]
    threads = [threading.Thread(target=play, args=(out,)) for out in runs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert runs[0] == runs[1] == runs[2] and len(runs[0]) == 12


def test_it_loads_as_rollout_env_with_its_reward():
    source = load_env("arbor.rollout.adapters.textarena:TextArenaGame", kwargs={"game": "Mastermind-v0-raw"})
    assert source.gives_reward
    game = source.make()
    (prompt,) = game.reset({}, seed=0)
    assert "Mastermind" in prompt["content"]
    assert "peg" in game.step(move("[1 2 3 4]")).messages[0]["content"]
    game.close()


def test_two_rl_steps_of_arbor_train_replay_to_the_trees_and_rewards(tmp_path):
    """configs/env_textarena.yaml for two steps: every game turn in the trees is what the game
    answered (replayed move by move on a fresh game) and every reward is the game's; the trees
    fork after game turns (copies of the game, its random state carried)."""
    from adapter_runs import REPO, check_episodes, train_steps
    from transformers import AutoTokenizer

    history, trees = train_steps(tmp_path, "configs/env_textarena.yaml", "rollout.width=4")
    tokenizer = AutoTokenizer.from_pretrained(REPO / "models" / "tiny-env")
    turns, forks = check_episodes(trees, lambda: TextArenaGame("GuessTheNumber-v0-raw"), tokenizer)
    assert turns > 0 and forks > 0
    assert len(history) == 2 and history[-1]["env/live"] == 0
