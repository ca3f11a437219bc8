"""The paged lookup of ``envs/paged_lookup.py`` as an agent program with the ``openai`` client.

    rollout:
      program: agents/paged_lookup_program.py:program

The book's rules (the first message, ``open page N``, the page as a tool message, the question
once a page is open, the reward) are the environment's, imported from beside this file; the loop
is a program's: it asks the endpoint for each model turn and sends the answers back unchanged, so
the conversation renders to the same tokens as the environment's episodes and
``models/tiny-paged-lookup`` (warmed up on them) plays it as it is.

A program run is one leaf of its problem's tree (docs/agent-programs.md). With
``configs/program_paged_lookup.yaml``'s ``root_fork: 1`` and ``branch: 8`` the tree forks at the
start of the answer, after the page: the runs the fork starts replay the first call (``open page
N``) from the recording, and all eight answers share the call, the page and the question.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import openai

from arbor import ProgramContext

_spec = importlib.util.spec_from_file_location("paged_lookup", Path(__file__).parents[1] / "envs" / "paged_lookup.py")
assert _spec is not None and _spec.loader is not None
_book = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_book)

MAX_OPENS = 2  # pages one run may open (a run that only browses ends unanswered)


async def program(problem: dict, ctx: ProgramContext) -> float:
    book = _book.PagedLookup(max_opens=MAX_OPENS)  # deterministic: a replayed run sends the same requests
    messages = book.reset(problem, ctx.seed)
    async with ctx.openai_client() as client:
        while True:
            try:
                reply = await client.chat.completions.create(model=ctx.model, messages=messages)
            except openai.BadRequestError as e:
                if "response budget" not in str(e):
                    raise
                return 0.0  # the run's response budget is spent: it ends unanswered, as the environment's
            messages.append({"role": "assistant", "content": reply.choices[0].message.content or ""})
            step = book.step(messages)
            if step.done:
                return book.reward()
            messages += [{"role": m["role"], "content": m["content"]} for m in step.messages]
