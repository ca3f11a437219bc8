"""An OpenEnv environment: a keypad whose code the model guesses (configs/env_openenv.yaml).

    python3 -m uvicorn keypad_openenv:app --app-dir envs --port 8000   # or let arbor serve it:

    rollout:
      env: arbor.rollout.adapters.openenv:OpenEnvClient
      env_args: {app: envs/keypad_openenv.py:app, action_field: guess, observation_field: feedback}

A keypad hides a code of ``length`` digits drawn from ``reset``'s seed. An action
``{"guess": "..."}`` is answered with how many digits are right in place; the reward is 1
when the code is found (the episode ends), else 0; ``max_guesses`` guesses end it too.
``reset(jitter=True)`` makes the feedback depend on the wall clock: an environment whose
replays diverge.
"""

from __future__ import annotations

import random
import time
from typing import Any

from openenv.core.env_server import Action, Environment, Observation, State, create_app


class Guess(Action):
    guess: str


class Feedback(Observation):
    feedback: str


class Keypad(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True  # every WebSocket session gets its own Keypad

    def __init__(self, length: int = 2, max_guesses: int = 6) -> None:
        super().__init__()
        self.length, self.max_guesses = length, max_guesses
        self._state = State()
        self.code, self.jitter = "", False

    def reset(self, seed: int | None = None, episode_id: str | None = None, jitter: bool = False,
              **kwargs: Any) -> Feedback:
        rng = random.Random(seed)
        self.code = "".join(str(rng.randrange(10)) for _ in range(self.length))
        self.jitter = jitter
        self._state = State(episode_id=episode_id, step_count=0)
        return Feedback(feedback=f"Find the {self.length}-digit code. Guess like 12.", done=False, reward=None)

    def step(self, action: Guess, timeout_s: float | None = None, **kwargs: Any) -> Feedback:  # type: ignore[override]
        self._state.step_count += 1
        right = sum(a == b for a, b in zip(action.guess.strip(), self.code))
        found = action.guess.strip() == self.code
        text = "Open!" if found else f"{right} right in place."
        if self.jitter:
            text += f" ({time.monotonic_ns()})"
        done = found or self._state.step_count >= self.max_guesses
        return Feedback(feedback=text, done=done, reward=1.0 if found else 0.0)

    @property
    def state(self) -> State:
        return self._state


app = create_app(Keypad, Guess, Feedback, env_name="keypad", max_concurrent_envs=64)
