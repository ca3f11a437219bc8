"""TextArena's single-player games as arbor environments (``pip install 'arbor[textarena]'``).

    rollout:
      env: arbor:TextArenaGame
      env_args: {game: GuessTheNumber-v0-raw}
    reward:
      functions: []              # the game's own reward (reward.env_weight x env.reward())

An episode is one game: ``reset`` makes it (``textarena.make``) and starts it with the
problem's ``seed`` column (else arbor's seed for the tree) and returns the game's prompt as
the first user message; each model turn is the player's action, the whole assistant message
(TextArena's games look for their own move format in it, e.g. ``[5]``); what the game
answers (hints, the board, an invalid move's reason) is the next user message. A problem
row may name its own ``game``. Use the ``-raw`` ids: the default wrappers repeat the whole
history in every observation, which the conversation already holds.

The reward is the game's when it ended (TextArena's ``close()``: 1 for a win, partial
credit for some games), ``unfinished_reward`` when the episode stopped first (arbor's length
budget, ``max_turns`` of the game not reached).

Forking is by ``copy``: a deepcopy of the game *and* of the random state it draws from.
TextArena games use Python's global ``random`` (``State`` seeds it in ``reset``; games like
2048 draw a tile every move), which a deepcopy does not carry and which every game in the
process shares. So each instance keeps its own state of ``random`` (and of ``numpy.random``)
and swaps it in, under a lock, for each call into the game: sibling branches draw the
same numbers their parent would have, and concurrent episodes never draw each other's.
Games that download NLTK data when they start (Wordle, Hangman, SpellingBee, WordLadder,
Crosswords, ...) need network on first use; GuessTheNumber, Mastermind, TowerOfHanoi,
FrozenLake, Minesweeper, Sokoban, LightsOut and 2048 need none.
"""

from __future__ import annotations

import copy
import random
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import textarena

from arbor.rollout.agents import Message
from arbor.rollout.environments import Step

_RANDOM = threading.Lock()  # the process's global random states are swapped under it


class TextArenaGame:
    """One TextArena single-player game per episode (see the module doc)."""

    fork = "copy"

    def __init__(self, game: str = "GuessTheNumber-v0-raw", unfinished_reward: float = 0.0) -> None:
        self.game = game
        self.unfinished_reward = float(unfinished_reward)
        self._env: Any = None  # the textarena environment, made by reset
        self._random: tuple[Any, Any] | None = None  # (random's state, numpy.random's state)

    def reset(self, problem: dict, seed: int) -> list[Message]:
        game = str(problem.get("game", self.game))
        seed = int(problem.get("seed", seed))
        with self._own_random(seed):
            env = textarena.make(game)
            env.reset(num_players=1, seed=seed)
            player, observation = env.get_observation()
        if player != 0:
            raise ValueError(f"{game}: not a single-player game (player {player} moves first)")
        self._env = env
        return [{"role": "user", "content": _text(observation)}]

    def step(self, history: list[Message]) -> Step:
        if self._env is None:
            raise RuntimeError("TextArenaGame.step before reset")
        action = history[-1]["content"]
        with self._own_random():
            done, _ = self._env.step(action=action)
            _, observation = self._env.get_observation()
        return Step([{"role": "user", "content": _text(observation)}], done=bool(done))

    def reward(self) -> float | None:
        if self._env is None:
            return None
        with self._own_random():
            rewards, _ = self._env.close()
        return self.unfinished_reward if rewards is None else float(rewards[0])

    def copy(self) -> TextArenaGame:
        twin = TextArenaGame(self.game, self.unfinished_reward)
        with _RANDOM:  # a call of this instance in another thread does not move it meanwhile
            twin._env, twin._random = copy.deepcopy(self._env), copy.deepcopy(self._random)
        return twin

    def close(self) -> None:
        self._env = None

    @contextmanager
    def _own_random(self, seed: int | None = None) -> Iterator[None]:
        """This instance's ``random`` / ``numpy.random`` states (fresh from ``seed``, given one)
        as the global ones, for the duration of a call into the game."""
        with _RANDOM:
            outside = random.getstate(), np.random.get_state()
            if seed is not None:
                random.seed(seed)
                np.random.seed(seed % 2**32)
            elif self._random is not None:
                random.setstate(self._random[0])
                np.random.set_state(self._random[1])
            try:
                yield
            finally:
                self._random = random.getstate(), np.random.get_state()
                random.setstate(outside[0])
                np.random.set_state(outside[1])


def _text(observation: list[tuple[int, str, Any]]) -> str:
    """The game's messages to the player, without the echo of the player's own action."""
    return "\n".join(message for sender, message, kind in observation
                     if not (sender == 0 and kind == textarena.ObservationType.PLAYER_ACTION))
