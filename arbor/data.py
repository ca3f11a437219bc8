"""Problems: dataset rows with an id, a prompt and a gold answer, and the order they are served in.

    problems = load_problems("data/math/train.parquet", cfg.data)    # list[dict]
    ids = format_prompt(problems[0], cfg.data, tokenizer, chat_template=True)
    stream = ProblemStream(problems, seed=0, shuffle=True)
    batch = stream.next_batch(32)                                     # reshuffles every epoch
    state = stream.state_dict()                                       # resume exactly here

A problem is its row as a dict (``id``, ``prompt``, ``answer`` plus every column of the
row, which reward functions receive untouched). Files: ``.jsonl``, ``.json``,
``.parquet``, ``.arrow``, a ``save_to_disk`` directory or a directory of shards
(:mod:`arbor.dataset_files`), or a set a library generates (``reasoning_gym:NAME``,
:mod:`arbor.dataset_sources`). ``data.id_key``, ``data.prompt_key`` and
``data.answer_key`` name columns, or dotted paths into nested ones: verl's rows
(``prompt`` = chat messages, ``reward_model: {style, ground_truth}``, ``extra_info:
{split, index}``) load with ``answer_key: reward_model.ground_truth`` and ``id_key:
extra_info.index``. A row without the id column gets its place (``file:line``) as id.

A prompt is text or a list of chat messages ``[{"role": ..., "content": ...}, ...]``.
Text becomes one user message; ``data.prompt_suffix`` is appended to the last user
message; ``data.system_prompt`` is put first unless the messages already start with
their own system message (the dataset's wins: it was written for these prompts).
Bad rows fail with the file, the line (or row) and the problem id.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from arbor.config import DataConfig
from arbor.dataset_files import DataError, read_rows
from arbor.dataset_sources import is_source, source_rows

log = logging.getLogger(__name__)

Message = dict[str, Any]  # {"role": "system" | "user" | "assistant" | "tool", "content": str, ...}


def used_columns(env: str | None, reward_functions: int) -> tuple[str, ...]:
    """The columns a run needs of every row (``id`` is never required): the prompt unless an
    environment writes its own (``rollout.env``'s reset), the answer when reward functions score
    against it. A task whose environment writes the prompt and gives the reward needs neither.

    >>> used_columns(None, 1), used_columns("envs/ledger.py:Ledger", 0)
    (('prompt', 'answer'), ())
    """
    return tuple(name for name, used in (("prompt", env is None), ("answer", reward_functions > 0)) if used)


def load_problems(
    path: str | Path, data_cfg: DataConfig, key: str = "data.train_path", columns: Sequence[str] = ("prompt", "answer"),
) -> list[dict[str, Any]]:
    """Read every row, normalised to the keys ``id``, ``prompt``, ``answer`` (+ the rest);
    ``path`` may also name a generated set (``reasoning_gym:NAME``, :mod:`arbor.dataset_sources`).
    ``key`` is the config key that named ``path``, for the error when it does not exist.
    ``columns``: of ``prompt`` and ``answer``, those every row must have (:func:`used_columns`);
    the others are kept when a row has them."""
    if is_source(str(path)):
        rows = source_rows(str(path))
    elif not Path(path).exists():
        raise DataError(f"{key}: {path}: no such file or directory")
    else:
        rows = read_rows(Path(path))
    problems: list[dict[str, Any]] = []
    seen: dict[str, str] = {}
    for where, row in rows:
        problem = problem_from_row(row, where, data_cfg, columns)
        if problem["id"] in seen:
            raise DataError(f"{where}: duplicate problem id {problem['id']!r} (first at {seen[problem['id']]})")
        seen[problem["id"]] = where
        problems.append(problem)
    if not problems:
        raise DataError(f"{path}: no problems in it")
    return problems


def problem_from_row(
    row: Any, where: str, data_cfg: DataConfig, columns: Sequence[str] = ("prompt", "answer"),
) -> dict[str, Any]:
    """One row as a problem: the row's columns + ``id``, ``prompt``, ``answer`` (those of the
    two a row lacks and ``columns`` does not require are left out)."""
    if not isinstance(row, dict):
        raise DataError(f"{where}: a row must be an object, got {type(row).__name__}")
    raw_id = column(row, data_cfg.id_key)
    problem_id = where if raw_id is None else str(raw_id)
    at = f"{where} (problem {problem_id!r})"
    keys = {"prompt": (data_cfg.prompt_key, "data.prompt_key"), "answer": (data_cfg.answer_key, "data.answer_key")}
    values = {name: column(row, key) for name, (key, _) in keys.items()}
    missing = [f"{keys[name][0]!r} column ({keys[name][1]})" for name in columns if values[name] is None]
    if missing:  # every missing column in one message
        raise DataError(f"{at}: row has no {' and no '.join(missing)}, or it is null; columns: {sorted(row)}")
    prompt = values["prompt"]
    if isinstance(prompt, list):
        prompt = _checked_messages(prompt, at, data_cfg.prompt_key)
    elif prompt is not None and not isinstance(prompt, str):
        raise DataError(
            f"{at}: {data_cfg.prompt_key!r} must be text or a list of chat messages, got {type(prompt).__name__}"
        )
    known = {name: value for name, value in (("prompt", prompt), ("answer", values["answer"])) if value is not None}
    return {**row, "id": problem_id, **known}


def column(row: dict[str, Any], key: str) -> Any:
    """``row[key]``, or for a dotted key the nested value (``reward_model.ground_truth``);
    None when missing. A column whose own name contains the dots wins."""
    if key in row:
        return row[key]
    value: Any = row
    for part in key.split("."):
        if not isinstance(value, dict):
            return None
        value = value.get(part)
    return value


def _checked_messages(messages: list[Any], at: str, key: str) -> list[Message]:
    """Chat messages with text ``role`` and ``content``; keys a columnar file filled with
    None (a struct column holds every key any row has) are dropped."""
    if not messages:
        raise DataError(f"{at}: {key!r} is an empty list of messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise DataError(f"{at}: {key!r} message {i} must be an object with text 'role' and 'content', got {m!r:.80}")
        out.append({k: v for k, v in m.items() if v is not None})
    if not any(m["role"] == "user" for m in out):
        raise DataError(f"{at}: {key!r} has no user message (roles: {[m['role'] for m in out]})")
    return out


def prompt_messages(prompt: str | list[Message], suffix: str = "", system_prompt: str | None = None) -> list[Message]:
    """The chat messages of a prompt: text as one user message, messages copied; ``suffix``
    appended to the last user message; ``system_prompt`` first unless a system message is.

        prompt_messages("2+2?", " Box it.")   # [{"role": "user", "content": "2+2? Box it."}]
    """
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]
    if suffix:
        last_user = max(i for i, m in enumerate(messages) if m["role"] == "user")
        messages[last_user]["content"] += suffix
    if system_prompt and not any(m["role"] == "system" for m in messages):
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages


def format_prompt(problem: dict[str, Any], data_cfg: DataConfig, tokenizer: Any, chat_template: bool) -> list[int]:
    """Token ids of the prompt: chat-templated (with the generation prompt) or plain text.

    Without a chat template a text prompt is tokenised as is, + ``data.prompt_suffix``
    (``data.system_prompt`` is not used); a list of messages needs the template.
    Raises when the prompt is longer than ``data.max_prompt_tokens``: the trainer skips
    such problems at start-up (``arbor.rollout.agents.fitting_problems``), so none gets here.
    """
    prompt = problem["prompt"]
    if chat_template and getattr(tokenizer, "chat_template", None):
        messages = prompt_messages(prompt, data_cfg.prompt_suffix, data_cfg.system_prompt)
        ids = chat_template_ids(tokenizer, messages, generation_prompt=True)
    elif isinstance(prompt, str):
        ids = tokenizer(prompt + data_cfg.prompt_suffix, add_special_tokens=True)["input_ids"]
    else:
        raise DataError(
            f"problem {problem['id']!r}: the prompt is a list of chat messages, which needs a chat "
            "template (model.chat_template: true and a tokenizer with one)"
        )
    if len(ids) > data_cfg.max_prompt_tokens:
        raise DataError(
            f"problem {problem['id']!r}: prompt has {len(ids)} tokens, more than "
            f"data.max_prompt_tokens={data_cfg.max_prompt_tokens}"
        )
    return [int(t) for t in ids]


def stop_token_ids(tokenizer: Any, model_path: str | Path | None = None, trust_remote_code: bool = False) -> list[int]:
    """Every id that ends a model turn, sorted: the tokenizer's EOS and each ``eos_token_id``
    of the model's ``generation_config.json`` and config (one id or a list in either).

    Real checkpoints disagree: Qwen2.5-Instruct ends turns on ``<|im_end|>`` (listed in its
    generation config) while a base tokenizer's EOS is ``<|endoftext|>``; sampling must
    stop on all of them. ``model_path`` defaults to where the tokenizer was loaded from.

        stop_token_ids(AutoTokenizer.from_pretrained("models/smollm2-135m-instruct"))  # [2]

    A directory without ``generation_config.json`` or ``config.json`` (a tokenizer saved on
    its own) is normal; a file that is there but cannot be read is warned about, naming it;
    and no end-of-turn id at all is a :class:`DataError`: sampling would run every path to
    its length limit.
    """
    from transformers import AutoConfig, GenerationConfig

    found = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    path = str(model_path if model_path is not None else tokenizer.name_or_path)
    failures = []
    for name, read in (("generation_config.json", lambda: GenerationConfig.from_pretrained(path).eos_token_id),
                       ("config.json", lambda: getattr(AutoConfig.from_pretrained(
                           path, trust_remote_code=trust_remote_code).get_text_config(), "eos_token_id", None))):
        if Path(path).is_dir() and not (Path(path) / name).exists():
            continue  # a tokenizer-only directory (tests, SFT data checks): nothing to read
        try:
            found |= _id_set(read())
        except (OSError, ValueError, TypeError) as e:
            failures.append(f"{name}: {type(e).__name__}: {e}")
            log.warning("model %s: could not read eos_token_id from %s (%s: %s); stop tokens so far: %s",
                        path, name, type(e).__name__, e, sorted(found) or "none")
    if not found:
        raise DataError(
            f"model {path}: no end-of-turn token: the tokenizer has no eos_token and no eos_token_id "
            f"was found in generation_config.json or config.json{' (' + '; '.join(failures) + ')' if failures else ''}. "
            "Set eos_token in the tokenizer or eos_token_id in the model's config."
        )
    return sorted(found)


def _id_set(ids: int | list[int] | None) -> set[int]:
    """``eos_token_id`` as configs write it (absent, one id or a list) as a set."""
    return set() if ids is None else {int(i) for i in (ids if isinstance(ids, list) else [ids])}


def chat_template_ids(
    tokenizer: Any, messages: Sequence[Mapping[str, Any]], generation_prompt: bool,
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> list[int]:
    """Token ids of ``messages`` rendered by the tokenizer's chat template; ``tools`` (OpenAI
    function format) are rendered the template's way, where it has one (an environment's
    ``tools``, :mod:`arbor.rollout.adapters.tool_calls`)."""
    extra = {"tools": list(tools)} if tools else {}
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=True, **extra)
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
        out: list[dict[str, Any]] = []
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
