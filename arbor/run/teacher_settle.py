"""How a distilling run's config settles at start-up (:func:`arbor.run.startup.settled`): the
teacher's engine kind, its tokenizer against the student's, dynamic sampling at reward_weight 0."""

from __future__ import annotations

from dataclasses import replace

from arbor.config import Config
from arbor.errors import ConfigError

TEACHER_KEY = "algorithm.distill.teacher"


def settled_distill(cfg: Config, device: str | None) -> Config:
    """``cfg`` (its ``engine.kind`` settled) with the teacher's kind decided (auto: external with
    urls, else the policy's engines' kind, embedded when those are external) and, with
    ``reward_weight`` 0, ``algorithm.dynamic_sampling`` off: a tree whose leaves score alike
    still teaches the teacher's tokens. ``device``: the engines' (:func:`arbor.run.startup.engine_device`). A SGLang teacher needs ``rollout.temperature`` 1: SGLang
    scores input tokens at temperature 1 whatever the request says."""
    from arbor.engines.launch import resolve_kind

    distill = cfg.algorithm.distill
    kind: str = distill.teacher.kind
    if kind == "auto":
        kind = cfg.engine.kind if cfg.engine.kind != "external" else "embedded"
    kind = resolve_kind(kind, device=device, python=cfg.engine.python)
    if kind == "sglang" and cfg.rollout.temperature != 1.0:
        raise ConfigError(f"{TEACHER_KEY}.kind: a SGLang teacher scores the student's tokens at temperature 1 "
                          f"(its input log-probs ignore the request's), but rollout.temperature is "
                          f"{cfg.rollout.temperature}: sample at 1, or serve the teacher with kind embedded")
    if cfg.model.path and distill.teacher.model:
        check_same_tokenizer(cfg.model.path, distill.teacher.model, cfg.model.trust_remote_code)
    teacher = replace(distill.teacher, kind=kind)  # type: ignore[arg-type]  # kind: one of KINDS
    algorithm = replace(cfg.algorithm, distill=replace(distill, teacher=teacher))
    if distill.reward_weight == 0:
        algorithm = replace(algorithm, dynamic_sampling=False)
    return replace(cfg, algorithm=algorithm)


def check_same_tokenizer(policy: str, teacher: str, trust_remote_code: bool = False) -> None:
    """:class:`ConfigError` naming both models unless their tokenizers map the same strings to
    the same ids: the teacher scores the student's token ids as they are."""
    from transformers import AutoTokenizer

    try:
        vocabs = [AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code).get_vocab()
                  for path in (policy, teacher)]
    except (OSError, ValueError) as e:
        raise ConfigError(f"{TEACHER_KEY}.model: cannot read the tokenizer of {teacher!r} or {policy!r}: {e}") from None
    if vocabs[0] != vocabs[1]:
        differ = len(set(vocabs[0].items()) ^ set(vocabs[1].items()))
        raise ConfigError(
            f"{TEACHER_KEY}.model: the teacher {teacher} and the student model.path {policy} have different "
            f"tokenizers ({len(vocabs[1])} vs {len(vocabs[0])} tokens, {differ} (token, id) pairs differ): "
            "on-policy distillation scores the student's token ids with the teacher, so both need one tokenizer")
