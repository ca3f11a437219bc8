"""Reading a request to ``arbor serve``: the JSON body, SGLang's ``sampling_params`` and
the prompts (``input_ids`` or ``text``), each check raising :class:`BadRequest` (a 4xx
with a message) rather than failing inside the engine."""

from __future__ import annotations

import contextlib
import json
from typing import Any

from aiohttp import web

from arbor.engines.types import SamplingParams

DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's default


class BadRequest(ValueError):
    """A request the server refuses with a 4xx and a message."""


@contextlib.contextmanager
def checking_request() -> Any:
    """Around the engine's and the weight group's checks of a request's content: their
    ``ValueError`` is the client's mistake (400); anything raised outside is the server's (500)."""
    try:
        yield
    except ValueError as exc:
        raise BadRequest(str(exc)) from exc


async def json_body(request: web.Request) -> dict[str, Any]:
    raw = await request.read()
    if not raw:
        raise BadRequest("empty request body: expected a JSON object")
    try:
        body = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise BadRequest(f"body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequest(f"body must be a JSON object, got {type(body).__name__}")
    return body


def _int(value: Any, name: str, *, minimum: int | None = None) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise BadRequest(f"{name} must be an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise BadRequest(f"{name} must be >= {minimum}, got {value}")
    return value


def _float(value: Any, name: str) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise BadRequest(f"{name} must be a number, got {value!r}")
    return float(value)


def parse_sampling_params(raw: Any) -> SamplingParams:
    """SGLang's ``sampling_params`` object -> :class:`SamplingParams` (unknown keys are ignored)."""
    raw = {} if raw is None else raw
    if not isinstance(raw, dict):
        raise BadRequest(f"sampling_params must be an object, got {type(raw).__name__}")
    max_new = raw.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS)
    stop_ids = raw.get("stop_token_ids") or []
    if not isinstance(stop_ids, list):
        raise BadRequest("sampling_params.stop_token_ids must be a list of integers")
    seed = raw.get("sampling_seed")
    return SamplingParams(
        max_new_tokens=_int(max_new, "sampling_params.max_new_tokens", minimum=0),
        temperature=_float(raw.get("temperature", 1.0), "sampling_params.temperature"),
        top_p=_float(raw.get("top_p", 1.0), "sampling_params.top_p"),
        top_k=_int(raw.get("top_k", -1), "sampling_params.top_k"),
        n=_int(raw.get("n", 1), "sampling_params.n", minimum=1),
        stop_token_ids=[_int(t, "sampling_params.stop_token_ids[]") for t in stop_ids],
        seed=None if seed is None else _int(seed, "sampling_params.sampling_seed"),
    )


def prompt_ids(body: dict[str, Any], tokenizer: Any) -> tuple[list[list[int]], bool]:
    """The prompts as token ids, and whether the request was a batch."""
    if "input_ids" in body and body["input_ids"] is not None:
        ids = body["input_ids"]
        if not isinstance(ids, list) or not ids:
            raise BadRequest("input_ids must be a non-empty list of token ids (or of lists)")
        batch = isinstance(ids[0], list)
        prompts = ids if batch else [ids]
        for prompt in prompts:
            if not isinstance(prompt, list) or not prompt:
                raise BadRequest("every prompt in input_ids must be a non-empty list")
            for token in prompt:
                _int(token, "input_ids[]")
        return prompts, batch
    if "text" in body and body["text"] is not None:
        text = body["text"]
        batch = isinstance(text, list)
        texts = text if batch else [text]
        if not texts or not all(isinstance(t, str) for t in texts):
            raise BadRequest("text must be a string or a non-empty list of strings")
        if tokenizer is None:
            raise BadRequest("this server has no tokenizer: send input_ids")
        return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts], batch
    raise BadRequest("give input_ids or text")
