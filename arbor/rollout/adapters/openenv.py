"""An OpenEnv environment server, driven through its client (``pip install 'arbor[openenv]'``).

    rollout:
      env: arbor:OpenEnvClient
      env_args: {app: my_env.server.app:app, action_field: message, observation_field: text}

The server is either one running already (``url``, e.g. ``http://127.0.0.1:8000`` or a
Hugging Face Space) or an OpenEnv app arbor starts on this machine, without Docker: ``app``
is the ``module:attr`` (or ``path/to/file.py:attr``) of the FastAPI app that OpenEnv's
``create_app(Env, Action, Observation)`` builds, served by uvicorn in a process of its own,
once per process that samples, stopped at its exit.

Each episode is one WebSocket session (the client's ``reset`` / ``step``: the server keeps a
fresh environment per session; its HTTP ``/reset`` and ``/step`` would build a new one per
call). ``reset(seed=...)`` gets the problem's ``seed`` column (else arbor's) and its
``reset_args``; the first user message is the problem's prompt followed by the
observation. Each model turn becomes the action ``{action_field: text}``; the next
observation is the next user message (``observation_field`` of it, else the observation as
JSON), and the episode ends when the server says ``done``. The reward is the sum of the
step rewards (``reward: last``: the last one given); ``unfinished_reward`` when the server
gave none (an episode arbor ended before any step; None: none, the reward functions judge).

The server must allow as many concurrent sessions as arbor keeps instances open
(``create_app(..., max_concurrent_envs=N)`` and ``SUPPORTS_CONCURRENT_SESSIONS = True`` on
the environment; ``rollout.max_live_envs`` caps arbor's side). OpenEnv has no snapshot API:
forks are by ``replay`` (a new session, reset with the same seed, the actions replayed and
each observation checked), so the environment must be deterministic given the seed.
"""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Literal

from openenv.core import GenericEnvClient

from arbor.data import prompt_messages
from arbor.engines.ports import free_port
from arbor.rollout.agents import Message
from arbor.rollout.environments import Step


class OpenEnvClient:
    """One OpenEnv session per episode branch (see the module doc)."""

    fork = "replay"

    def __init__(
        self,
        url: str | None = None,
        app: str | None = None,
        action_field: str = "message",
        observation_field: str | None = None,
        reward: Literal["sum", "last"] = "sum",
        unfinished_reward: float | None = 0.0,
        message_timeout_s: float = 60.0,
        startup_timeout_s: float = 120.0,
    ) -> None:
        if (url is None) == (app is None):
            raise ValueError("give one of url (a running OpenEnv server) and app (module:attr of an OpenEnv app "
                             f"arbor serves), got url={url!r}, app={app!r}")
        if reward not in ("sum", "last"):
            raise ValueError(f"reward must be 'sum' or 'last', got {reward!r}")
        self.url, self.app = url, app
        self.action_field, self.observation_field, self.reward_of = action_field, observation_field, reward
        self.unfinished_reward = unfinished_reward
        self.message_timeout_s, self.startup_timeout_s = float(message_timeout_s), float(startup_timeout_s)
        self._client: Any = None
        self._rewards: list[float] = []

    def reset(self, problem: dict, seed: int) -> list[Message]:
        url = self.url or _served(self.app or "", self.startup_timeout_s)
        self._client = GenericEnvClient(base_url=url, message_timeout_s=self.message_timeout_s).sync()
        self._client.connect()
        result = self._client.reset(seed=int(problem.get("seed", seed)), **dict(problem.get("reset_args") or {}))
        self._rewards = []
        observation = self._text(result.observation)
        messages = prompt_messages(problem["prompt"]) if problem.get("prompt") else [{"role": "user", "content": ""}]
        last = max(i for i, m in enumerate(messages) if m["role"] == "user")
        messages[last]["content"] = "\n\n".join(filter(None, [messages[last]["content"], observation]))
        return messages  # type: ignore[return-value]

    def step(self, history: list[Message]) -> Step:
        if self._client is None:
            raise RuntimeError("OpenEnvClient.step before reset")
        result = self._client.step({self.action_field: history[-1]["content"]})
        if result.reward is not None:
            self._rewards.append(float(result.reward))
        return Step([{"role": "user", "content": self._text(result.observation)}], done=bool(result.done))

    def reward(self) -> float | None:
        if not self._rewards:
            return self.unfinished_reward
        return sum(self._rewards) if self.reward_of == "sum" else self._rewards[-1]

    def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            client.close()

    def _text(self, observation: dict[str, Any]) -> str:
        if self.observation_field is None:
            return json.dumps({k: v for k, v in observation.items() if k != "metadata"}, sort_keys=True)
        if self.observation_field not in observation:
            raise ValueError(f"rollout.env_args.observation_field {self.observation_field!r}: the observation has "
                           f"only {sorted(observation)}")
        return str(observation[self.observation_field])


_servers: dict[str, tuple[subprocess.Popen, str]] = {}  # app -> (its uvicorn process, its URL)
_servers_lock = threading.Lock()


def _served(app: str, timeout_s: float) -> str:
    """The URL of ``app`` served by uvicorn on this machine, started on first use (once per process)."""
    with _servers_lock:
        if app in _servers and _servers[app][0].poll() is None:
            return _servers[app][1]
        module, _, attr = app.partition(":")
        command = [sys.executable, "-m", "uvicorn", "--host", "127.0.0.1", "--log-level", "warning"]
        if module.endswith(".py") or os.sep in module:  # a file: its directory is the app dir
            path = Path(module).resolve()
            command += ["--app-dir", str(path.parent)]
            module = path.stem
        port = free_port()
        process = subprocess.Popen([*command, "--port", str(port), f"{module}:{attr}"], start_new_session=True)
        atexit.register(_stop, process)
        url = f"http://127.0.0.1:{port}"
        _wait_healthy(process, url, app, timeout_s)
        _servers[app] = (process, url)
        return url


def _wait_healthy(process: subprocess.Popen, url: str, app: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"rollout.env_args.app {app!r}: the OpenEnv server exited with code "
                               f"{process.returncode} at start (its error is above)")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as answer:
                if answer.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.2)
    _stop(process)
    raise RuntimeError(f"rollout.env_args.app {app!r}: the OpenEnv server did not answer {url}/health within "
                       f"{timeout_s:g}s (startup_timeout_s)")


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
