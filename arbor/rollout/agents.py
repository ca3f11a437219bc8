"""Agents: what follows each finished model turn of an episode.

    agent = load_agent("agents/python_tool.py:PythonTool", key="rollout.agent")
    messages = agent.start(problem)                 # the first prompt, as chat messages
    more = agent.step(problem, history)             # after a model turn: tool results, or None

An agent is any object with ``start`` and ``step``, or a class built with the config's
``rollout.agent_args``, named ``module:attr`` in the config. It is stateless: everything it needs is in the
problem and the history, so any node of a rollout tree can be forked and continued.

Token ids are only ever appended. The model's own turn stays exactly the ids it
sampled; what the agent adds (tool output, the template's turn markers, the next
generation prompt) is rendered by the tokenizer's chat template as a *continuation* —
:func:`continuation_ids` — and carries ``loss_mask = 0``: the model did not generate it.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypedDict, runtime_checkable

from arbor.config import DataConfig, RolloutConfig
from arbor.data import DataError, chat_template_ids, format_prompt
from arbor.errors import ConfigError
from arbor.plugins import load_object

if TYPE_CHECKING:
    from typing_extensions import NotRequired  # typing's from Python 3.11; an annotation only

    from arbor.tree import Node, RolloutTree



class Message(TypedDict):
    """A chat message an agent returns or reads (a plain dict: agents need no arbor import)."""

    role: str  # "system" | "user" | "assistant" | "tool"
    content: str
    # A tool message reporting a failure (timed out, raised, out of memory): counted in
    # agent/tool_errors. arbor's own field: it never reaches the chat template.
    error: NotRequired[bool]


CHAT_KEYS_DROPPED = ("error",)  # Message fields that are arbor's, not the chat format's
Render = Callable[[list[Message]], list[int]]  # an agent's messages -> the ids appended

log = logging.getLogger(__name__)


@runtime_checkable
class Agent(Protocol):
    def start(self, problem: dict) -> list[Message]: ...

    def step(self, problem: dict, history: list[Message]) -> list[Message] | None: ...


def load_agent(
    spec: str,
    key: str = "rollout.agent",
    search_dirs: Sequence[str] = (),
    kwargs: Mapping[str, Any] | None = None,
    kwargs_key: str = "rollout.agent_args",
) -> Agent:
    """Resolve ``spec`` to an agent instance; a :class:`ConfigError` names ``key`` otherwise.

    A class is built with ``kwargs`` (the config's ``rollout.agent_args``, e.g. a tool's
    time limit); an object named directly takes none.
    """
    kwargs = dict(kwargs or {})
    obj = load_object(spec, key, search_dirs)
    if isinstance(obj, type):
        try:
            obj = obj(**kwargs)
        except TypeError as e:
            given = f"with {kwargs_key} {kwargs}" if kwargs else "without arguments"
            raise ConfigError(f"{key}: {spec!r} is a class that cannot be built {given}: {e}") from None
    elif kwargs:
        raise ConfigError(
            f"{kwargs_key}: {spec!r} is an object, not a class, so it takes no arguments (got {kwargs})"
        )
    missing = [name for name in ("start", "step") if not callable(getattr(obj, name, None))]
    if missing:
        raise ConfigError(
            f"{key}: {spec!r} is not an agent: it has no {' and no '.join(missing)} method "
            "(an agent needs start(problem) -> messages and step(problem, history) -> messages | None)"
        )
    return obj


def rollout_agent(rollout_cfg: RolloutConfig, search_dirs: Sequence[str] = ()) -> Agent | None:
    """The agent ``rollout.agent`` names, built with ``rollout.agent_args``; None for
    single-turn rollouts. ``arbor train``, ``arbor eval`` and the config check load it here."""
    if rollout_cfg.agent is None:
        return None
    return load_agent(rollout_cfg.agent, "rollout.agent", search_dirs, rollout_cfg.agent_args)


def episode_inputs(
    problems: Sequence[dict],
    agent: Agent | None,
    tokenizer: Any,
    data_cfg: DataConfig,
    chat_template: bool,
) -> tuple[list[list[int]], Render | None]:
    """What the sampler needs to start ``problems``: ``(prompts, render)``.

    Without an agent: each problem's :func:`~arbor.data.format_prompt` ids and no render.
    With one: ``data.system_prompt`` (unless the agent gives a system message) and
    ``agent.start(problem)``, chat-templated, and :func:`continuation_ids` as the render.
    ``arbor train``'s rollouts and evals and ``arbor eval`` all start episodes here.
    """
    if agent is None:
        return [format_prompt(p, data_cfg, tokenizer, chat_template) for p in problems], None
    prompts = [episode_prompt(tokenizer, agent.start(problem), data_cfg) for problem in problems]
    return prompts, functools.partial(continuation_ids, tokenizer)


def episode_prompt(
    tokenizer: Any, messages: list[Message], data_cfg: DataConfig, tools: list[dict] | None = None,
) -> list[int]:
    """The prompt ids of an episode's first messages: ``data.system_prompt`` first (unless the
    messages hold a system message), chat-templated with the generation prompt and ``tools``
    (an environment's, OpenAI function format) the template's way."""
    if data_cfg.system_prompt and not any(m["role"] == "system" for m in messages):
        messages = [{"role": "system", "content": data_cfg.system_prompt}, *messages]
    chat = [{k: v for k, v in m.items() if k not in CHAT_KEYS_DROPPED} for m in messages]
    return chat_template_ids(tokenizer, chat, generation_prompt=True, tools=tools)


def fitting_problems(
    problems: Sequence[dict],
    agent: Agent | None,
    tokenizer: Any,
    data_cfg: DataConfig,
    chat_template: bool,
    source: str,
) -> tuple[list[dict], list[str]]:
    """``(kept, skipped_ids)``: the problems whose first prompt, as :func:`episode_inputs`
    renders it, fits ``data.max_prompt_tokens``, and the ids of the rest.

    A prompt is never cut: half a problem has another answer. Skipped problems get one
    warning naming them (``source``: the config key of their set); the caller counts them
    in a metric (``data/skipped_long_prompts``).
    """
    unlimited = dataclasses.replace(data_cfg, max_prompt_tokens=sys.maxsize)
    prompts, _ = episode_inputs(problems, agent, tokenizer, unlimited, chat_template)
    limit = data_cfg.max_prompt_tokens
    kept = [p for p, ids in zip(problems, prompts) if len(ids) <= limit]
    skipped = [(str(p["id"]), len(ids)) for p, ids in zip(problems, prompts) if len(ids) > limit]
    if not kept:
        raise DataError(f"{source}: every prompt is longer than data.max_prompt_tokens={limit} "
                        f"(the shortest has {min(n for _, n in skipped)} tokens)")
    if skipped:
        shown = ", ".join(f"{i} ({n} tokens)" for i, n in skipped[:10])
        log.warning("%s: skipped %d of %d problems whose prompt is longer than data.max_prompt_tokens=%d: %s%s",
                    source, len(skipped), len(problems), limit, shown,
                    f" and {len(skipped) - 10} more" if len(skipped) > 10 else "")
    return kept, [i for i, _ in skipped]


def tool_turns(tree: RolloutTree, leaf: Node) -> int:
    """Agent turns on the path to ``leaf``: the nodes the model generated none of (mask all 0)."""
    return sum(1 for node in tree.path(leaf) if node.loss_mask and not any(node.loss_mask))


# A finished conversation the template renders in full; the continuation of what an agent
# adds is what the template appends after it. Nothing of the real history is re-tokenised.
_ANCHOR: list[Message] = [{"role": "user", "content": "."}, {"role": "assistant", "content": "."}]


def continuation_ids(
    tokenizer: Any, messages: list[Message], eos_token_id: int | None = None
) -> list[int]:
    """Ids to append after a model turn that ended with ``eos_token_id`` (default: the
    tokenizer's EOS): the rest of the template's turn ending, ``messages`` and the next
    generation prompt, as the chat template renders them (all loss mask 0).

    Computed as the template's rendering of an anchor conversation + ``messages`` minus
    that of the anchor cut after its assistant turn's EOS (what the model itself emits);
    raises when the template does not render that as a prefix (it rewrites earlier
    turns, so appending ids would not match it).
    """
    if not messages:
        raise ValueError("continuation_ids needs at least one message")
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the tokenizer has no chat template: multi-turn agents need one")
    eos = tokenizer.eos_token_id if eos_token_id is None else eos_token_id
    base = chat_template_ids(tokenizer, _ANCHOR, generation_prompt=False)
    if eos in base:  # the model's turn stops at its EOS; what the template puts after is ours
        base = base[: len(base) - base[::-1].index(eos)]
    chat = [{k: v for k, v in m.items() if k not in CHAT_KEYS_DROPPED} for m in messages]
    full = chat_template_ids(tokenizer, [*_ANCHOR, *chat], generation_prompt=True)
    if full[: len(base)] != base:
        raise ValueError(
            "the chat template rewrites earlier turns when messages are added, so tool "
            "output cannot be appended as token ids; use a template that renders turns independently"
        )
    return full[len(base) :]
