"""A verifiers environment's rollouts, arbor sampling every model turn (``pip install 'arbor[verifiers]'``).

    rollout:
      env: arbor:VerifiersEnv
      env_args: {environment: my_env, args: {max_turns: 4}}   # vf.load_environment("my_env", max_turns=4)
    reward:
      functions: []              # the environment's rubric is the reward

``environment`` is what ``vf-eval`` loads: the id of an installed environment module (its
``load_environment(**args)``), or ``module:attr`` / ``path.py:attr`` naming that function or a
built environment. Any of verifiers' classic environments runs: ``SingleTurnEnv``,
``MultiTurnEnv`` subclasses, ``ToolEnv`` (the API of verifiers 0.1-0.3; 0.4 dropped it).

**The environment runs its own loop.** Each episode is the environment's real
``rollout(input, client, model)`` (its ``setup_state``, ``env_response``, stop conditions
and cleanup handlers, as ``vf-eval`` runs it) in a task of its own, with arbor as the
``client``: when the environment asks its client for the next model turn, it waits for the
turn arbor sampled. arbor owns the token ids: the model's turn stays the ids it sampled
(the environment gets its decoded text), and what the environment answers is appended as
chat-template ids, never retokenised. Tool calls are read from the text the Hermes way
(:mod:`arbor.rollout.adapters.tool_calls`), as an inference server's parser would hand them
to ``ToolEnv``; its ``tool_defs`` reach the chat template as ``tools``.

A problem row is a row of the environment's dataset (``prompt`` messages, ``answer``,
``info``, ``example_id``): export it with ``env.get_dataset().to_json("train.jsonl")``.

The reward is the environment's rubric (``rubric.score_rollout``, then its cleanup), read
when the episode ends. An episode arbor ends first (the response budget) ends the
environment's loop as verifiers' own "prompt too long" stop does and is scored on the turns
the environment saw. A rollout that records an error (``state["error"]``, e.g. a
``ToolEnv`` stop error) ends there, warned about with the problem id, and is scored as
verifiers scores it. Forks are by ``replay`` (a suspended rollout cannot be copied).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import re
import time
from typing import Any

import verifiers as vf
from verifiers.clients import Client
from verifiers.types import Response, ResponseMessage, ToolCall

from arbor.data import prompt_messages
from arbor.plugins import load_object
from arbor.rollout.adapters.tool_calls import function_tool, parse_tool_calls
from arbor.rollout.agents import Message
from arbor.rollout.environments import Step

log = logging.getLogger(__name__)

_CALL_BLOCK = re.compile(r"<tool_call>.*?</tool_call>", re.DOTALL)


class VerifiersEnv:
    """One verifiers rollout per episode, its model turns sampled by arbor (module doc)."""

    fork = "replay"

    def __init__(self, environment: str, args: dict[str, Any] | None = None) -> None:
        self.environment = load_environment(environment, json.dumps(args or {}, sort_keys=True))
        self.tools: list[dict[str, Any]] = []  # the rollout's tool_defs, OpenAI function format (after reset)
        self._turns: _Turns | None = None
        self._rollout: asyncio.Task | None = None
        self._shown = 0  # messages of the environment's conversation the model has seen
        self._problem_id: Any = None

    async def reset(self, problem: dict, seed: int) -> list[Message]:
        self._problem_id = problem.get("id")
        self._turns = _Turns()
        info = problem.get("info") or {}
        rollout_input = {"prompt": prompt_messages(problem["prompt"]), "example_id": int(problem.get("example_id", 0)),
                         "answer": str(problem.get("answer", "")), "info": json.loads(info) if isinstance(info, str) else info}
        if "task" in problem:
            rollout_input["task"] = problem["task"]
        self._rollout = asyncio.create_task(self.environment.rollout(rollout_input, self._turns, "arbor", {}),
                                            name=f"verifiers-rollout-{self._problem_id}")
        prompt = await self._next_prompt()
        if prompt is None:
            raise RuntimeError(f"problem {self._problem_id!r}: the verifiers rollout ended before its first model "
                               f"turn ({self._ended_why()})")
        state = self._turns.state
        self.tools = [function_tool(t.name, t.description, dict(t.parameters)) for t in state.get("tool_defs") or []]
        self._shown = len(prompt)
        return [_message(m) for m in prompt]

    async def step(self, history: list[Message]) -> Step:
        assert self._turns is not None, "VerifiersEnv.step before reset"
        await self._turns.answers.put(history[-1]["content"])
        prompt = await self._next_prompt()
        if prompt is None:
            self._warn_error()
            return Step([], done=True)
        # The conversation so far, the model's turn (one message), then the environment's answer.
        new = [_message(m) for m in prompt[self._shown + 1:]]
        if len(prompt) <= self._shown + 1 or prompt[self._shown].role != "assistant":
            raise RuntimeError(f"problem {self._problem_id!r}: the environment's next prompt does not extend the "
                               "conversation (a get_prompt_messages override that rewrites it?): arbor's trees "
                               "can only append")
        self._shown = len(prompt)
        return Step(new)

    async def reward(self) -> float | None:
        if self._rollout is None or self._turns is None:
            return None
        if not self._rollout.done():  # arbor ended the episode: the environment's loop stops as on an overlong prompt
            await self._turns.answers.put(None)
        state = await self._rollout
        self._warn_error()
        await self.environment.rubric.score_rollout(state)
        await self.environment.rubric.cleanup(state)
        return float(state["reward"])

    async def close(self) -> None:
        task, self._rollout = self._rollout, None
        if task is None or task.done():
            return
        loop = task.get_loop()
        if loop is asyncio.get_running_loop():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)  # its cleanup handlers run
        elif not loop.is_closed():  # closed late, from another thread (a timed-out call)
            loop.call_soon_threadsafe(task.cancel)

    async def _next_prompt(self) -> list[Any] | None:
        """The prompt of the environment's next model turn; None when its rollout ended instead."""
        assert self._turns is not None and self._rollout is not None
        waiting = asyncio.ensure_future(self._turns.prompts.get())
        done, _ = await asyncio.wait({waiting, self._rollout}, return_when=asyncio.FIRST_COMPLETED)
        if waiting in done:
            return waiting.result()
        waiting.cancel()
        self._rollout.result()  # an exception of the environment's own code is raised here
        return None

    def _state(self) -> Any:
        """The rollout's state: its result once it ended, else the one it asked the model with."""
        if self._rollout is not None and self._rollout.done() and not self._rollout.cancelled():
            return self._rollout.result()
        return self._turns.state if self._turns is not None else {}

    def _ended_why(self) -> str:
        state = self._state()
        return f"stop condition {state.get('stop_condition')!r}, error {state.get('error')!r}"

    def _warn_error(self) -> None:
        if self._state().get("error") is not None:
            log.warning("problem %r: the verifiers rollout recorded an error and ends there (%s); it is scored as "
                        "verifiers scores it", self._problem_id, self._ended_why())


class _Turns(Client):
    """arbor as a verifiers client: ``get_response`` hands the prompt over and waits for the
    model turn arbor sampled (text), returned as an assistant message with its tool calls."""

    def __init__(self) -> None:
        super().__init__(client_or_config=None)
        self.prompts: asyncio.Queue[list[Any]] = asyncio.Queue()
        self.answers: asyncio.Queue[str | None] = asyncio.Queue()  # None: arbor ended the episode
        self.state: Any = {}
        self._turn = 0

    def setup_client(self, config: Any) -> None:  # never called: no config, arbor is the client
        return None

    async def to_native_tool(self, tool: Any) -> Any:
        return tool

    async def to_native_prompt(self, messages: Any) -> tuple[Any, dict]:
        return messages, {}

    async def get_native_response(self, prompt: Any, model: str, sampling_args: Any, tools: Any = None,
                                  **kwargs: Any) -> str:
        self.state = kwargs.get("state", self.state)
        await self.prompts.put(list(prompt))
        text = await self.answers.get()
        if text is None:
            raise vf.OverlongPromptError("arbor ended the episode: its response budget is spent")
        return text

    async def raise_from_native_response(self, response: Any) -> None:
        return None

    async def from_native_response(self, response: Any) -> Response:
        self._turn += 1
        calls = [c for c in parse_tool_calls(response) if c.error is None]
        tool_calls = [ToolCall(id=f"call_{self._turn}_{k}", name=c.name, arguments=json.dumps(c.arguments))
                      for k, c in enumerate(calls)]
        content = _CALL_BLOCK.sub("", response).strip() if tool_calls else response
        message = ResponseMessage(content=content, tool_calls=tool_calls or None, is_truncated=False,
                                  finish_reason="tool_calls" if tool_calls else "stop")
        return Response(id=f"arbor-{self._turn}", created=int(time.time()), model="arbor", message=message)

    async def close(self) -> None:
        return None


@functools.lru_cache(maxsize=8)
def load_environment(environment: str, args_json: str) -> Any:
    """The verifiers environment ``environment`` names, built once per process with ``args``
    (its rollouts keep their state apart: one environment serves every episode)."""
    args = json.loads(args_json)
    if ":" in environment:
        built = load_object(environment, "rollout.env_args.environment")
        if callable(built) and not isinstance(built, vf.Environment):
            built = built(**args)
    else:
        built = vf.load_environment(environment, **args)
    if not isinstance(built, vf.Environment):
        raise TypeError(f"rollout.env_args.environment {environment!r} gives a {type(built).__name__}, not a "
                        "verifiers Environment")
    return built


def _message(message: Any) -> Message:
    """A verifiers message (pydantic) as an arbor chat message: its role and its text."""
    content = message.content
    if isinstance(content, list):  # content parts: the text ones, in order
        content = "".join(part.get("text", "") if isinstance(part, dict) else getattr(part, "text", "") or ""
                          for part in content)
    return {"role": message.role, "content": "" if content is None else str(content)}
