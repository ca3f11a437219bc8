"""OpenAI chat requests as token ids, token in and token out (docs/agent-programs.md).

    render = ChatRender(tokenizer)
    ids, changed = render.prompt_ids(messages, tools, sampled)   # sampled: message_key -> ids
    content, calls = parse_reply(text, "hermes")                  # the model's text as a message

Re-applying a chat template to a conversation does not give back the ids the policy sampled
(templates drop earlier reasoning, tool-call JSON is re-serialised, a turn cut at the budget
has no end marker), and training on ids the policy did not sample biases the update. So an
assistant message of the history that equals one the endpoint returned (same content, same
tool-call names, same arguments once parsed as JSON: frameworks re-serialise them) is
replaced by the ids sampled for it; the messages between two such turns are rendered the
template's way as a continuation (:func:`~arbor.rollout.agents.continuation_ids`). Any
other assistant message is rendered by the template: it is context, and counted.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

from arbor.data import chat_template_ids
from arbor.rollout.adapters.tool_calls import parse_tool_calls
from arbor.rollout.agents import continuation_ids

TOOL_PARSERS = ("hermes",)  # rollout.tool_parser's values


def text_of(content: Any) -> str:
    """A message's content as text: None is "", a list of parts joins its text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, Mapping) and p.get("type") == "text")
    raise TypeError(f"message content must be text or a list of parts, got {type(content).__name__}")


def _arguments(value: Any) -> Any:
    """Tool-call arguments as data: a JSON string parsed (frameworks re-serialise it), else as given."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            return value
    return value


def message_key(content: Any, tool_calls: Sequence[Mapping[str, Any]] | None) -> str:
    """What makes two assistant messages equal: the content and each call's name and parsed
    arguments (never the call ids, the JSON spacing or the key order)."""
    calls = []
    for call in tool_calls or []:
        function = call.get("function", call)
        calls.append([function.get("name"), _arguments(function.get("arguments"))])
    return json.dumps([text_of(content), calls], sort_keys=True)


def chat_message(message: Mapping[str, Any]) -> dict[str, Any]:
    """An OpenAI message as chat templates read it: text content, tool-call arguments as data."""
    out = {k: v for k, v in message.items() if k not in ("content", "tool_calls")}
    out["content"] = text_of(message.get("content"))
    if message.get("tool_calls"):
        out["tool_calls"] = [
            {**call, "function": {**call.get("function", {}), "arguments": _arguments(call.get("function", {})
                                                                                      .get("arguments"))}}
            for call in message["tool_calls"]
        ]
    return out


class ChatRender:
    """Requests' messages -> prompt ids with the sampled ids spliced in."""

    def __init__(self, tokenizer: Any, stop_ids: Sequence[int]) -> None:
        self.tokenizer = tokenizer
        self.stop_ids = set(stop_ids)
        self.eos = tokenizer.eos_token_id

    def prompt_ids(
        self, messages: Sequence[Mapping[str, Any]], tools: list[dict] | None, sampled: Mapping[str, list[int]],
    ) -> tuple[list[int], list[int]]:
        """``(ids, retokenized)``: the prompt of a request whose history is ``messages``, and the
        indices of its assistant messages that matched no returned one (rendered by the template).

        ``messages[:a]`` up to the first matched assistant message ``a`` are rendered with the
        generation prompt (and ``tools``); each matched message is its sampled ids (an end marker
        added where the sample was cut without one); the messages after it are a continuation.
        A final assistant message (a prefill) is never spliced.
        """
        chat = [chat_message(m) for m in messages]
        spliced: list[tuple[int, list[int]]] = []
        retokenized: list[int] = []
        for i, m in enumerate(messages):
            if m.get("role") != "assistant":
                continue
            ids = sampled.get(message_key(m.get("content"), m.get("tool_calls"))) if i < len(messages) - 1 else None
            if ids is None:
                retokenized.append(i)
            else:
                spliced.append((i, ids if ids and ids[-1] in self.stop_ids else [*ids, self.eos]))
        if not spliced:
            return chat_template_ids(self.tokenizer, chat, generation_prompt=True, tools=tools), retokenized
        first = spliced[0][0]
        out = chat_template_ids(self.tokenizer, chat[:first], generation_prompt=True, tools=tools)
        for k, (index, ids) in enumerate(spliced):
            out += ids
            end = spliced[k + 1][0] if k + 1 < len(spliced) else len(chat)
            between = chat[index + 1 : end]
            if between:
                # OpenAI messages carry more fields than arbor's Message (tool calls, call ids): the template reads them.
                out += continuation_ids(self.tokenizer, between, eos_token_id=ids[-1])  # type: ignore[arg-type]
        return out, retokenized


def call_id(output_ids: Sequence[int], index: int) -> str:
    """A tool call's id, from the ids that wrote it: a replay returns the same one."""
    digest = hashlib.blake2b(json.dumps(list(output_ids)).encode(), digest_size=6).hexdigest()
    return f"call_{digest}_{index}"


def parse_reply(text: str, output_ids: Sequence[int], parser: str) -> tuple[str, list[dict[str, Any]]]:
    """``(content, tool_calls)`` of the model's ``text``: with ``hermes``, each well-formed
    ``<tool_call>`` block is a call and the content is the text before the first block. A
    malformed block leaves the whole text as content, with no calls (the program sees what the
    model wrote)."""
    if parser != "hermes":
        raise ValueError(f"rollout.tool_parser must be one of {', '.join(TOOL_PARSERS)}, got {parser!r}")
    calls = parse_tool_calls(text)
    if not calls or any(c.error for c in calls):
        return text, []
    content = text[: text.index("<tool_call>")].strip()
    return content, [
        {"id": call_id(output_ids, i), "type": "function",
         "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
        for i, c in enumerate(calls)
    ]
