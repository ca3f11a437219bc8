"""The tools of any stdio MCP server as an arbor environment (``pip install 'arbor[mcp]'``).

    rollout:
      env: arbor:MCPTools
      env_args: {command: [python3, -m, my_server], env: {API_ROOT: /data}}

Each episode starts its own server process (``command``; the MCP SDK's ``stdio_client``) and
lists its tools; the model sees them in its chat template's tool format (``tools``: the
OpenAI function format that ``apply_chat_template(tools=...)`` renders) and calls them the
Hermes way, ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
(:mod:`arbor.rollout.adapters.tool_calls`). After each model turn the environment makes the
calls it wrote, in order, and answers with one ``tool`` message per call (``error: true``
when the server says the call failed, the call timed out, or it could not be parsed); a
turn without a call ends the episode, and so does the ``max_tool_turns``-th turn with calls.
The reward is the reward functions' (the episode's text holds the tools' answers).

The server gets the MCP SDK's allow-listed environment (``PATH``, ``HOME``, ``USER``, ...,
not the run's secrets) plus ``env``. A call may take ``call_timeout_s``.

**Forks.** ``fork: copy`` (the default). Tools whose ``readOnlyHint`` is true do not count
as side effects: a copy is a new server process that replays, on its first use, only the
calls of the other tools made so far, each answer checked against the recorded one (a
different answer raises, naming the call: a server whose side effects are not
deterministic cannot be forked mid-episode; give it ``fork: none``). A copy made before any
side effect starts a fresh server and replays nothing; copies that are never used start
nothing. ``readOnlyHint`` is the server's promise, not something arbor can check.

The MCP client is async only and must be entered and exited in the same task, while arbor
calls an environment's plain methods from worker threads: every session runs in one task
of its own on one event loop thread shared by the process, and the methods hand it
requests.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import logging
import tempfile
import threading
from collections.abc import Sequence
from datetime import timedelta
from importlib.metadata import version
from typing import Any

from mcp import ClientSession, StdioServerParameters
from mcp.client.stdio import stdio_client

from arbor.data import prompt_messages
from arbor.rollout.adapters.tool_calls import function_tool, parse_tool_calls
from arbor.rollout.agents import Message
from arbor.rollout.commands import command_argv, stderr_tail
from arbor.rollout.environments import Fork, Step

log = logging.getLogger(__name__)

_MCP_2 = int(version("mcp").split(".")[0]) >= 2  # 2.x takes timeouts in seconds, 1.x as timedelta
_exceptions = importlib.import_module("mcp.shared.exceptions")
_ProtocolError: type[Exception] = getattr(_exceptions, "MCPError", None) or _exceptions.McpError  # 2.x / 1.x
_START_S = 60.0  # a server that has not listed its tools by then does not start


class MCPTools:
    """One stdio MCP server per episode branch, its tools called by the environment (module doc)."""

    def __init__(
        self,
        command: Sequence[str],
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        call_timeout_s: float = 30.0,
        max_tool_turns: int = 4,
        fork: Fork = "copy",
    ) -> None:
        if isinstance(command, str) or not command:
            raise ValueError(f"command must be a list: the program and its arguments, got {command!r}")
        argv = command_argv(command)  # a bare python3 is arbor's own interpreter (arbor.rollout.commands)
        self.params = StdioServerParameters(command=argv[0], args=argv[1:], env=env, cwd=cwd)
        self.call_timeout_s, self.max_tool_turns = float(call_timeout_s), int(max_tool_turns)
        self.fork = fork  # an instance attribute: env_args may choose "none"
        self.tools: list[dict[str, Any]] = []  # the server's tools, OpenAI function format (after reset)
        self._read_only: set[str] = set()
        self._effects: list[tuple[str, dict, dict]] = []  # (tool, arguments, answer) of side-effecting calls
        self._turns = 0
        self._session: _Session | None = None

    def reset(self, problem: dict, seed: int) -> list[Message]:
        self._start()
        return prompt_messages(problem["prompt"])  # type: ignore[return-value]

    def step(self, history: list[Message]) -> Step:
        calls = parse_tool_calls(history[-1]["content"])
        if not calls:
            return Step([], done=True)
        self._turns += 1
        answers: list[Message] = []
        for call in calls:
            if call.error is not None:
                answers.append({"role": "tool", "content": call.error, "error": True})
                continue
            answer = self._call(call.name, call.arguments)
            answers.append({"role": "tool", "content": answer["text"], "error": answer["error"]})
        return Step(answers, done=self._turns >= self.max_tool_turns)

    def copy(self) -> MCPTools:
        twin = object.__new__(MCPTools)
        twin.__dict__.update(self.__dict__)
        twin.tools, twin._effects = list(self.tools), list(self._effects)
        twin._session = None  # its own server, started (and the side effects replayed) when first used
        return twin

    def close(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            session.stop()

    # -- the server ----------------------------------------------------------------------

    def _start(self) -> _Session:
        if self._session is None:
            self._session = _Session(self.params)
            listing = self._session.start()
            self.tools = [function_tool(t["name"], t.get("description") or "", t.get("inputSchema") or {})
                          for t in listing]
            self._read_only = {t["name"] for t in listing if (t.get("annotations") or {}).get("readOnlyHint") is True}
            self._replay()
        return self._session

    def _replay(self) -> None:
        """Make the recorded side-effecting calls on this instance's new server, checking each answer."""
        assert self._session is not None
        for k, (name, arguments, recorded) in enumerate(self._effects, 1):
            answer = self._session.call(name, arguments, self._timeout())
            if answer != recorded:
                raise RuntimeError(
                    f"MCP server {self.params.command!r}: replaying side effect {k} of {len(self._effects)} "
                    f"({name} {json.dumps(arguments)[:200]}) for a forked branch answered {answer!r:.200} where "
                    f"the episode had {recorded!r:.200}: its side effects are not deterministic, so it cannot be "
                    "forked mid-episode (rollout.env_args fork: none)")

    def _call(self, name: str, arguments: dict) -> dict[str, Any]:
        """``{"text", "error"}``: a tool's answer (a timeout or protocol error is an error answer)."""
        session = self._start()
        try:
            answer = session.call(name, arguments, self._timeout())
        except _ProtocolError as e:  # the server refused or the call timed out: the model is told
            answer = {"text": f"{type(e).__name__}: {e}", "error": True}
        if name not in self._read_only:
            self._effects.append((name, dict(arguments), answer))
        return answer

    def _timeout(self) -> Any:
        return self.call_timeout_s if _MCP_2 else timedelta(seconds=self.call_timeout_s)


class _Session:
    """A server process and its ``ClientSession``, both owned by one task on the shared loop."""

    def __init__(self, params: StdioServerParameters) -> None:
        self.params = params
        self.loop = _shared_loop()
        self._requests: asyncio.Queue[tuple[str, dict, Any, asyncio.Future] | None] | None = None
        self._task: asyncio.Task | None = None

    def start(self) -> list[dict[str, Any]]:
        """Start the server; its tools as dicts (by alias: ``inputSchema``, ``annotations.readOnlyHint``)."""
        return asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(_START_S)

    def call(self, name: str, arguments: dict, timeout: Any) -> dict[str, Any]:
        return asyncio.run_coroutine_threadsafe(self._call(name, arguments, timeout), self.loop).result()

    def stop(self) -> None:
        try:
            asyncio.run_coroutine_threadsafe(self._stop(), self.loop).result(_START_S)
        except TimeoutError:
            log.warning("MCP server %r did not stop within %gs", self.params.command, _START_S)

    async def _start(self) -> list[dict[str, Any]]:
        self._requests = asyncio.Queue()
        ready: asyncio.Future[list[dict[str, Any]]] = self.loop.create_future()
        self._task = asyncio.create_task(self._serve(ready), name=f"mcp-{self.params.command}")
        return await ready

    async def _serve(self, ready: asyncio.Future) -> None:
        """The session's whole life in this one task: enter, list, answer requests, exit."""
        assert self._requests is not None
        # The server's stderr is kept: a server that dies says why in the error, not only on the console.
        errlog = tempfile.TemporaryFile("w+", encoding="utf-8", errors="replace")
        try:
            async with stdio_client(self.params, errlog=errlog) as (read, write), ClientSession(read, write) as session:
                await session.initialize()
                listing = await session.list_tools()
                ready.set_result([tool.model_dump(by_alias=True, exclude_none=True) for tool in listing.tools])
                while (request := await self._requests.get()) is not None:
                    name, arguments, timeout, reply = request
                    try:
                        result = await session.call_tool(name, arguments, read_timeout_seconds=timeout)
                    except Exception as e:  # handed to the caller, who decides
                        reply.set_exception(e)
                        continue
                    reply.set_result(_answer(result.model_dump(by_alias=True)))
        except Exception as e:
            errlog.seek(0)
            said = stderr_tail(errlog.read())
            cause = _innermost(e)
            what = f"{type(cause).__name__}: {cause}" + (f"; its stderr:\n    {said}" if said else "")
            if not ready.done():
                ready.set_exception(RuntimeError(f"MCP server {self.params.command!r} {self.params.args} did not "
                                                 f"start: {what}"))
            else:
                raise RuntimeError(f"MCP server {self.params.command!r} {self.params.args} stopped: {what}") from e
        finally:
            errlog.close()

    async def _call(self, name: str, arguments: dict, timeout: Any) -> dict[str, Any]:
        assert self._requests is not None and self._task is not None
        if self._task.done():
            raise RuntimeError(f"MCP server {self.params.command!r} has stopped: {self._task.exception()!r}")
        reply: asyncio.Future[dict[str, Any]] = self.loop.create_future()
        await self._requests.put((name, arguments, timeout, reply))
        done, _ = await asyncio.wait({reply, self._task}, return_when=asyncio.FIRST_COMPLETED)
        if reply not in done:
            raise RuntimeError(f"MCP server {self.params.command!r} stopped during a call of {name!r}: "
                               f"{self._task.exception()!r}")
        return reply.result()

    async def _stop(self) -> None:
        if self._requests is not None and self._task is not None and not self._task.done():
            await self._requests.put(None)
            try:
                await asyncio.wait_for(asyncio.shield(self._task), _START_S / 2)
            except asyncio.TimeoutError:
                self._task.cancel()


def _innermost(error: BaseException) -> BaseException:
    """The first leaf of an exception group (anyio's "unhandled errors in a TaskGroup" says nothing)."""
    inner = getattr(error, "exceptions", None)  # BaseExceptionGroup (3.11+, or the exceptiongroup backport)
    while isinstance(inner, tuple) and inner and isinstance(inner[0], BaseException):
        error = inner[0]
        inner = getattr(error, "exceptions", None)
    return error


def _answer(result: dict[str, Any]) -> dict[str, Any]:
    """A ``CallToolResult`` (dumped by alias) as ``{"text", "error"}``: its text blocks joined,
    other blocks (images, resources) as JSON."""
    parts = [block["text"] if block.get("type") == "text" else json.dumps(block) for block in result.get("content", [])]
    return {"text": "\n".join(parts), "error": bool(result.get("isError"))}


_loop: asyncio.AbstractEventLoop | None = None
_loop_lock = threading.Lock()


def _shared_loop() -> asyncio.AbstractEventLoop:
    """The event loop every MCP session of this process runs on, in a daemon thread."""
    global _loop
    with _loop_lock:
        if _loop is None or _loop.is_closed():
            _loop = asyncio.new_event_loop()
            threading.Thread(target=_loop.run_forever, name="arbor-mcp-sessions", daemon=True).start()
        return _loop
