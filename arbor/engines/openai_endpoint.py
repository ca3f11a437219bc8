"""An OpenAI-compatible HTTP endpoint on loopback, for agent programs (docs/agent-programs.md).

    endpoint = OpenAIEndpoint(handler, model="tiny-arith")
    await endpoint.start()                       # 127.0.0.1, a free port, a fresh key
    endpoint.base_url("p3-run0")                 # http://127.0.0.1:PORT/e/p3-run0/v1
    ...                                          # programs call it with endpoint.api_key
    await endpoint.close()

It serves ``POST /v1/chat/completions`` (non-streaming, and streaming as one chunk),
``POST /v1/completions`` and ``GET /v1/models`` under one base URL per episode, so every
call is attributed to its episode. It only translates: the JSON of a request becomes a
:class:`ChatRequest` / :class:`CompletionRequest`, the :class:`CallHandler` (the rollout's
recorder, :mod:`arbor.rollout.program_tree`) turns it into token ids, samples and answers a
:class:`Reply`, which goes back as OpenAI's JSON. Sampling fields a request sets
(``temperature``, ``top_p``, ...) are ignored (the run samples at ``rollout.temperature``)
and handed over by name to be counted; ``n`` > 1 is refused: the tree decides branching.

Errors are 400s with OpenAI's ``{"error": {"message", "type"}}`` body (clients do not
retry a 400), 401 for a wrong key, 404 for an unknown episode.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from aiohttp import web

# Request fields that would change sampling: the run's rollout.* settings decide it instead.
IGNORED_SAMPLING = ("temperature", "top_p", "top_k", "presence_penalty", "frequency_penalty", "seed",
                    "logit_bias", "min_p", "repetition_penalty")


@dataclass
class ChatRequest:
    """``POST /v1/chat/completions`` as the handler reads it."""

    messages: list[dict[str, Any]]  # OpenAI chat messages, as sent
    tools: list[dict[str, Any]] | None  # OpenAI function tools; None: none
    max_tokens: int | None  # max_completion_tokens or max_tokens; None: the episode's budget
    stop: list[str] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)  # sampling fields set and ignored


@dataclass
class CompletionRequest:
    """``POST /v1/completions``: a text prompt or one list of token ids."""

    prompt: str | list[int]
    max_tokens: int | None
    stop: list[str] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)


@dataclass
class Reply:
    """What the policy answered one call."""

    text: str  # the content (chat: without the tool-call blocks)
    tool_calls: list[dict[str, Any]]  # OpenAI format: {"id", "type": "function", "function": {"name", "arguments"}}
    finish_reason: str  # "stop" | "length" | "tool_calls"
    prompt_tokens: int
    completion_tokens: int


class EndpointError(Exception):
    """A request the handler refuses; the message goes back to the program (HTTP ``status``)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


class CallHandler(Protocol):
    """Answers an episode's calls (:class:`~arbor.rollout.program_tree.ProgramCalls`)."""

    def knows(self, episode: str) -> bool: ...

    async def chat(self, episode: str, request: ChatRequest) -> Reply: ...

    async def completion(self, episode: str, request: CompletionRequest) -> Reply: ...


class OpenAIEndpoint:
    """The aiohttp server; one per sampling call, on the caller's event loop."""

    def __init__(self, handler: CallHandler, model: str, host: str = "127.0.0.1") -> None:
        self.handler, self.model, self.host = handler, model, host
        self.api_key = "arbor-" + secrets.token_urlsafe(24)  # per run: nothing else on the host can call it
        self.port = 0
        self._runner: web.AppRunner | None = None

    def base_url(self, episode: str) -> str:
        """The ``/v1`` base URL of ``episode`` (what ``OPENAI_BASE_URL`` is set to)."""
        return f"http://{self.host}:{self.port}/e/{episode}/v1"

    async def start(self) -> None:
        app = web.Application(client_max_size=64 << 20)
        app.router.add_post("/e/{episode}/v1/chat/completions", self._guard(self._chat))
        app.router.add_post("/e/{episode}/v1/completions", self._guard(self._completion))
        app.router.add_get("/e/{episode}/v1/models", self._guard(self._models))
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, 0)
        await site.start()
        server = site._server
        assert server is not None and server.sockets  # type: ignore[attr-defined]
        self.port = server.sockets[0].getsockname()[1]  # type: ignore[attr-defined]

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # -- routes ----------------------------------------------------------------------------

    def _guard(self, route: Callable[[str, web.Request], Awaitable[web.StreamResponse]]
               ) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
        """Key and episode checked, handler refusals as OpenAI error bodies."""

        async def guarded(request: web.Request) -> web.StreamResponse:
            if request.headers.get("Authorization") != f"Bearer {self.api_key}":
                return _error(401, "invalid API key: use the key the run gave this program (OPENAI_API_KEY)")
            episode = request.match_info["episode"]
            if not self.handler.knows(episode):
                return _error(404, f"no episode {episode!r} is running: a program may only call the base URL it "
                                   "was given, while its run lasts")
            try:
                return await route(episode, request)
            except EndpointError as e:
                return _error(e.status, str(e))

        return guarded

    async def _models(self, episode: str, request: web.Request) -> web.StreamResponse:
        return web.json_response({"object": "list", "data": [
            {"id": self.model, "object": "model", "created": 0, "owned_by": "arbor"}]})

    async def _chat(self, episode: str, request: web.Request) -> web.StreamResponse:
        body = await _json_body(request)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise EndpointError("'messages' must be a non-empty list of message objects")
        tools = body.get("tools")
        if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
            raise EndpointError("'tools' must be a list of tool objects")
        if body.get("tool_choice") not in (None, "auto", "none"):
            ignored_choice = ["tool_choice"]  # the template decides; a forced choice is not honoured
        else:
            ignored_choice = []
        call = ChatRequest(messages, tools or None, _max_tokens(body), _stop(body),
                           _ignored(body) + ignored_choice)
        reply = await self.handler.chat(episode, call)
        message: dict[str, Any] = {"role": "assistant", "content": reply.text if reply.text or not reply.tool_calls
                                   else None}
        if reply.tool_calls:
            message["tool_calls"] = reply.tool_calls
        created, rid = int(time.time()), "chatcmpl-" + secrets.token_hex(8)
        if body.get("stream"):
            return await self._stream(request, rid, created, message, reply)
        return web.json_response({
            "id": rid, "object": "chat.completion", "created": created, "model": self.model,
            "choices": [{"index": 0, "message": message, "finish_reason": reply.finish_reason, "logprobs": None}],
            "usage": _usage(reply),
        })

    async def _stream(self, request: web.Request, rid: str, created: int, message: dict[str, Any],
                      reply: Reply) -> web.StreamResponse:
        """Server-sent events: the whole message as one delta, then the finish and ``[DONE]``."""
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        delta = dict(message)
        if "tool_calls" in delta:
            delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(delta["tool_calls"])]
        head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": self.model}
        chunks = [
            head | {"choices": [{"index": 0, "delta": delta, "finish_reason": None}]},
            head | {"choices": [{"index": 0, "delta": {}, "finish_reason": reply.finish_reason}],
                    "usage": _usage(reply)},
        ]
        for chunk in chunks:
            await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def _completion(self, episode: str, request: web.Request) -> web.StreamResponse:
        body = await _json_body(request)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]  # a batch of one
        if not (isinstance(prompt, str) or (isinstance(prompt, list) and all(isinstance(t, int) for t in prompt))):
            raise EndpointError("'prompt' must be a string or one list of token ids (no batches)")
        if body.get("stream"):
            raise EndpointError("streaming is served for /v1/chat/completions only")
        reply = await self.handler.completion(episode, CompletionRequest(prompt, _max_tokens(body), _stop(body),
                                                                         _ignored(body)))
        return web.json_response({
            "id": "cmpl-" + secrets.token_hex(8), "object": "text_completion", "created": int(time.time()),
            "model": self.model,
            "choices": [{"index": 0, "text": reply.text, "finish_reason": reply.finish_reason, "logprobs": None}],
            "usage": _usage(reply),
        })


async def _json_body(request: web.Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except json.JSONDecodeError as e:
        raise EndpointError(f"the request body is not JSON: {e}") from None
    if not isinstance(body, dict):
        raise EndpointError("the request body must be a JSON object")
    n = body.get("n", 1)
    if n not in (1, None):
        raise EndpointError(f"n={n} is not served: arbor decides how a program's runs branch (rollout.width); "
                            "ask for one choice")
    return body


def _max_tokens(body: dict[str, Any]) -> int | None:
    value = body.get("max_completion_tokens", body.get("max_tokens"))
    if value is not None and (not isinstance(value, int) or value < 1):
        raise EndpointError(f"max_tokens must be a positive integer, got {value!r}")
    return value


def _stop(body: dict[str, Any]) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise EndpointError("'stop' must be a string or a list of non-empty strings")
    return stops


def _ignored(body: dict[str, Any]) -> list[str]:
    return [key for key in IGNORED_SAMPLING if body.get(key) is not None]


def _usage(reply: Reply) -> dict[str, int]:
    return {"prompt_tokens": reply.prompt_tokens, "completion_tokens": reply.completion_tokens,
            "total_tokens": reply.prompt_tokens + reply.completion_tokens}


def _error(status: int, message: str) -> web.Response:
    kind = {401: "authentication_error", 404: "not_found_error"}.get(status, "invalid_request_error")
    return web.json_response({"error": {"message": message, "type": kind, "param": None, "code": None}},
                             status=status)
