"""Problems: dataset rows with an id, a prompt and a gold answer, and the order they are served in.

    problems = load_problems("data/math/train.jsonl", cfg.data)      # list[dict]
    stream = ProblemStream(problems, seed=0, shuffle=True)
    batch = stream.next_batch(32)                                     # reshuffles every epoch
    state = stream.state_dict()                                       # resume exactly here

A problem is its row as a dict (``id``, ``prompt``, ``answer`` plus any other columns,
which reward functions receive untouched). Files: ``.jsonl`` (one JSON object a line)
or ``.json`` (a list of objects). Bad rows fail with the file, the line and the problem.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from arbor.config import DataConfig


class DataError(ValueError):
    """A dataset problem, naming the file and line (or row) and the problem id."""


def load_problems(path: str | Path, data_cfg: DataConfig) -> list[dict[str, Any]]:
    """Read every row, normalised to the keys ``id``, ``prompt``, ``answer`` (+ the rest)."""
    path = Path(path)
    if not path.exists():
        raise DataError(f"{path}: no such file or directory (data.train_path / data.eval_path)")
    rows = list(read_rows(path))
    if not rows:
        raise DataError(f"{path}: no problems in it")
    problems, seen = [], {}
    for where, row in rows:
        if not isinstance(row, dict):
            raise DataError(f"{where}: a row must be an object, got {type(row).__name__}")
        for key, name in ((data_cfg.prompt_key, "data.prompt_key"), (data_cfg.answer_key, "data.answer_key")):
            if key not in row:
                raise DataError(f"{where}: row has no {key!r} column ({name}); columns: {sorted(row)}")
        if not isinstance(row[data_cfg.prompt_key], str):
            raise DataError(f"{where}: {data_cfg.prompt_key!r} must be text")
        problem = dict(row)
        problem["id"] = str(row.get(data_cfg.id_key, where))
        problem["prompt"] = row[data_cfg.prompt_key]
        problem["answer"] = row[data_cfg.answer_key]
        if problem["id"] in seen:
            raise DataError(f"{where}: duplicate problem id {problem['id']!r} (first at {seen[problem['id']]})")
        seen[problem["id"]] = where
        problems.append(problem)
    return problems


def read_rows(path: Path) -> Any:
    """``(where, row)`` of a .jsonl or .json file; ``where`` is ``file:line`` (``file[i]``)."""
    if path.suffix == ".jsonl":
        with path.open() as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    yield f"{path}:{lineno}", json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"{path}:{lineno}: invalid JSON: {e.msg}") from None
    elif path.suffix == ".json":
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{e.lineno}: invalid JSON: {e.msg}") from None
        if not isinstance(data, list):
            raise DataError(f"{path}: a .json dataset must be a list of objects")
        for i, row in enumerate(data):
            yield f"{path}[{i}]", row
    else:
        raise DataError(f"{path}: unknown dataset format (use .jsonl or .json)")


def format_prompt(problem: dict[str, Any], data_cfg: DataConfig, tokenizer: Any, chat_template: bool) -> list[int]:
    """Token ids of the prompt: chat-templated (with the generation prompt) or plain text."""
    text = problem["prompt"] + data_cfg.prompt_suffix
    if chat_template and getattr(tokenizer, "chat_template", None):
        messages = ([{"role": "system", "content": data_cfg.system_prompt}] if data_cfg.system_prompt else [])
        messages.append({"role": "user", "content": text})
        ids = chat_template_ids(tokenizer, messages, generation_prompt=True)
    else:
        ids = tokenizer(text, add_special_tokens=True)["input_ids"]
    if len(ids) > data_cfg.max_prompt_tokens:
        raise DataError(
            f"problem {problem['id']!r}: prompt has {len(ids)} tokens, more than "
            f"data.max_prompt_tokens={data_cfg.max_prompt_tokens}"
        )
    return [int(t) for t in ids]


def chat_template_ids(tokenizer: Any, messages: list[dict[str, str]], generation_prompt: bool) -> list[int]:
    """Token ids of ``messages`` rendered by the tokenizer's chat template."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # BatchEncoding in newer transformers
        ids = ids["input_ids"]
    return [int(t) for t in ids]


class ProblemStream:
    """Serves problems batch after batch, reshuffled each epoch, resumable from its state."""

    def __init__(self, problems: Sequence[dict[str, Any]], seed: int, shuffle: bool = True) -> None:
        if not problems:
            raise DataError("no problems to serve")
        self.problems = list(problems)
        self.seed, self.shuffle = seed, shuffle
        self.epoch, self.cursor = 0, 0
        self._order = self._epoch_order(0)

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(len(self.problems)))
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def next_batch(self, n: int) -> list[dict[str, Any]]:
        out = []
        while len(out) < n:
            if self.cursor == len(self._order):
                self.epoch, self.cursor = self.epoch + 1, 0
                self._order = self._epoch_order(self.epoch)
            out.append(self.problems[self._order[self.cursor]])
            self.cursor += 1
        return out

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "cursor": self.cursor}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.cursor = int(state["epoch"]), int(state["cursor"])
        self._order = self._epoch_order(self.epoch)
