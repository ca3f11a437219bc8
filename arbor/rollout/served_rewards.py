"""Reward terms scored by served models: a generative judge, a reward-model classifier, a
user's reward server. Entries of ``reward.functions`` with ``kind`` judge, classifier or http.

    terms = served_terms(cfg.reward)            # the config's served entries, checked and started
    values, failures = terms[0].score(items)    # items: [(problem, completion)]; one batched call

- ``judge``: the prompt ``template`` with ``{prompt}``, ``{response}`` and ``{answer}`` replaced
  (plain replacement: other braces stay as written), sent as text in one batched ``/generate``
  (SGLang's native API, greedy, ``max_new_tokens``) to ``url`` or to an ``arbor serve`` of
  ``model`` the run starts; the first match of ``parser`` in each verdict, its group 1, is the
  score. Identical judge prompts (a tree's leaves that answered alike) are sent once.
- ``classifier``: a transformers sequence-classification model (one label) loaded in the
  driver's process on CPU; the score is its logit for prompt + completion, in batches.
- ``http``: ``POST url {"items": [{"problem": ..., "completion": ...}]}`` answered
  ``{"scores": [float | null, ...]}``, one per item.

A failed call (timeout, connection, HTTP error, a malformed answer) scores every item of the
call ``failure_value``; a null or an unparsable verdict scores that item ``failure_value``.
Both are counted (``reward/served_failures``) and warned about with the term, never silent.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
from collections.abc import Sequence
from typing import Any

import aiohttp

from arbor.config import RewardConfig, RewardTermConfig

log = logging.getLogger(__name__)
Item = tuple[dict, str]  # (problem row, completion text)
SERVED_KINDS = ("judge", "classifier", "http")
_CLASSIFIER_BATCH = 16


def served_spec(term: RewardTermConfig) -> str:
    """The name a served term's scores are reported under (``result.term_scores``)."""
    return f"{term.kind}:{term.model or term.url}"


def fill_template(template: str, problem: dict, completion: str) -> str:
    """``template`` with ``{prompt}``, ``{response}`` and ``{answer}`` replaced.

    >>> fill_template("Q: {prompt} A: {response} \\\\boxed{}", {"prompt": "1+1?", "answer": "2"}, "2")
    'Q: 1+1? A: 2 \\\\boxed{}'
    """
    prompt = problem.get("prompt", "")
    if not isinstance(prompt, str):  # chat messages: their contents, in order
        prompt = "\n".join(str(m.get("content", "")) for m in prompt)
    return (template.replace("{prompt}", prompt).replace("{response}", completion)
            .replace("{answer}", str(problem.get("answer", ""))))


def parse_verdict(text: str, parser: re.Pattern[str]) -> float | None:
    """Group 1 of ``parser``'s first match in ``text`` as a finite float; None if there is none."""
    match = parser.search(text)
    try:
        value = float(match.group(1)) if match else math.nan
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


class ServedTerm:
    """One served entry of ``reward.functions``; :meth:`score` makes its batched call(s)."""

    def __init__(self, term: RewardTermConfig, index: int, url: str | None = None, classifier: Any = None) -> None:
        self.cfg, self.key, self.spec = term, f"reward.functions[{index}]", served_spec(term)
        self.weight = term.weight
        self.url = url  # judge: the engine; http: the server
        self.classifier = classifier  # (model, tokenizer) for a classifier
        self.parser = re.compile(term.parser)
        self.engine: Any = None  # the judge's arbor serve, when the run started it (launch_engines' handle)

    def score(self, items: Sequence[Item]) -> tuple[list[float], int]:
        """One value per item (``failure_value`` where it failed) and the failures."""
        if not items:
            return [], 0
        if self.cfg.kind == "classifier":
            values: list[float | None] = self._classify(items)
        else:
            try:
                values = asyncio.run(asyncio.wait_for(self._call(items), self.cfg.timeout_s))
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError, TypeError) as e:
                log.warning("%s (%s): the call for %d items failed (%s: %s); they score %s",
                            self.key, self.spec, len(items), type(e).__name__, e, self.cfg.failure_value)
                return [self.cfg.failure_value] * len(items), len(items)
        failed = [i for i, v in enumerate(values) if v is None]
        for i in failed[:3]:
            log.warning("%s (%s): no score for problem id %r; it scores %s", self.key, self.spec,
                        items[i][0].get("id"), self.cfg.failure_value)
        return [self.cfg.failure_value if v is None else v for v in values], len(failed)

    async def _call(self, items: Sequence[Item]) -> list[float | None]:
        assert self.url is not None
        async with aiohttp.ClientSession() as session:
            if self.cfg.kind == "http":
                body: dict[str, Any] = {"items": [{"problem": p, "completion": c} for p, c in items]}
                async with session.post(self.url, json=body) as response:
                    response.raise_for_status()
                    scores = (await response.json())["scores"]
                if not isinstance(scores, list) or len(scores) != len(items):
                    raise ValueError(f"expected {{'scores': [...]}} with {len(items)} entries")
                return [float(s) if isinstance(s, (int, float)) and not isinstance(s, bool) and math.isfinite(s)
                        else None for s in scores]
            prompts = [fill_template(self.cfg.template, p, c) for p, c in items]
            unique = list(dict.fromkeys(prompts))  # leaves that answered alike: judged once
            body = {"text": unique, "sampling_params": {"max_new_tokens": self.cfg.max_new_tokens, "temperature": 0.0}}
            async with session.post(self.url.rstrip("/") + "/generate", json=body) as response:
                response.raise_for_status()
                replies = await response.json()
            replies = replies if isinstance(replies, list) else [replies]
            if len(replies) != len(unique):
                raise ValueError(f"sent {len(unique)} judge prompts, got {len(replies)} verdicts")
            verdicts = {p: parse_verdict(r["text"], self.parser) for p, r in zip(unique, replies)}
            return [verdicts[p] for p in prompts]

    def _classify(self, items: Sequence[Item]) -> list[float | None]:
        import torch

        model, tokenizer = self.classifier
        values: list[float | None] = []
        for start in range(0, len(items), _CLASSIFIER_BATCH):
            chunk = items[start:start + _CLASSIFIER_BATCH]
            texts = [fill_template("{prompt}{response}", p, c) for p, c in chunk]
            batch = tokenizer(texts, return_tensors="pt", padding=True, truncation=True)
            with torch.no_grad():
                logits = model(**batch).logits[:, 0].float()
            values += [v if math.isfinite(v) else None for v in logits.tolist()]
        return values

    def close(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()


def add_served(result: Any, items: Sequence[Item], served: Sequence[tuple[int, ServedTerm]]) -> Any:
    """``result`` (:class:`arbor.rollout.rewards.ScoreResult` of the function terms) with each
    served term's weighted values added to the scores, its column placed where the config
    lists it in ``term_scores``, and its failures counted in ``served_failures``."""
    columns = list(result.term_scores.items())  # the function terms, in config order
    for position, term in sorted(served, key=lambda s: s[0]):
        values, failures = term.score(items)
        result.served_failures += failures
        result.scores = [score + term.weight * value for score, value in zip(result.scores, values)]
        columns.insert(position, (term.spec, values))
    result.term_scores = dict(columns)
    return result


def served_terms(reward_cfg: RewardConfig) -> list[tuple[int, ServedTerm]]:
    """``(index in reward.functions, term)`` of every served entry; judges of ``model`` get an
    ``arbor serve`` started here, classifiers are loaded here."""
    out = []
    for i, term in enumerate(reward_cfg.functions):
        if term.kind not in SERVED_KINDS:
            continue
        if term.kind == "classifier":
            out.append((i, ServedTerm(term, i, classifier=load_classifier(term.model or ""))))
        elif term.kind == "judge" and term.model:
            from arbor.engines.launch import launch_engines

            handle = launch_engines("embedded", model_path=term.model, num_engines=1)
            served = ServedTerm(term, i, url=handle.urls[0])
            served.engine = handle
            out.append((i, served))
        else:
            out.append((i, ServedTerm(term, i, url=term.url)))
    return out


def load_classifier(path: str) -> tuple[Any, Any]:
    """A one-label sequence-classification model and its tokenizer (padding on the right)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    model.config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer
