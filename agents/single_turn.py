"""The default agent: one user message, one model turn.

    rollout:
      agent: agents/single_turn.py:SingleTurn

An agent decides what follows each finished model turn (the :class:`arbor.Agent` protocol, docs/api.md): ``start``
gives the first messages, ``step`` the messages after a model turn, or None to end the
episode. This one ends every episode after the first answer. A problem's prompt is text
or a list of chat messages (:func:`arbor.prompt_messages`); either way the episode starts with it as is.
"""

from __future__ import annotations

from arbor import prompt_messages


class SingleTurn:
    def start(self, problem: dict) -> list[dict[str, str]]:
        return prompt_messages(problem["prompt"])

    def step(self, problem: dict, history: list[dict[str, str]]) -> list[dict[str, str]] | None:
        return None
