"""Loading and checking a run's config: :func:`load_config` (a YAML file and
``section.key=value`` overrides to a checked :class:`~arbor.config.Config`), :func:`validate`
(the range and cross-field rules, each error naming its keys) and
:func:`check_context_length` (the longest request against the model's context).

    cfg = load_config("configs/math.yaml", ["loss.clip_high=0.3", "run.steps=10"])

The records themselves, and dumping them, are :mod:`arbor.config`; the YAML reading and
type checks, :mod:`arbor.config_parse`.
"""

from __future__ import annotations

import importlib.util
import math
import re
from collections.abc import Callable
from pathlib import Path

from arbor.config import Config
from arbor.config_override import apply_override
from arbor.config_parse import build, read_yaml
from arbor.errors import ConfigError

# -- loading (the YAML reading and type checks: arbor.config_parse) ----------------

# Keys of earlier releases: a config that sets one is told what to write instead.
REPLACED_KEYS = {"run.tensorboard": "run.loggers: [tensorboard] (the default), or [] for none"}


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Read ``path`` (YAML), apply ``section.key=value`` overrides (list items as
    ``section.key[0].field=value``: :mod:`arbor.config_override`), check everything."""
    raw, where = read_yaml(path)
    for item in overrides:
        where.add_override(apply_override(raw, item, Config), item)
    for key, instead in REPLACED_KEYS.items():
        section, _, name = key.partition(".")
        if isinstance(raw.get(section), dict) and name in raw[section]:
            raise ConfigError(f"{where(key)}: {key} was replaced by {instead}")
    cfg = build(Config, raw, "", where)
    cfg.source = str(Path(path).resolve()) if path is not None else None
    validate(cfg, where)
    return cfg


# -- validation of values and combinations ------------------------------------------------


def validate(cfg: Config, where: Callable[[str], str] | None = None, on_gpu: bool | None = None) -> None:
    """Range and cross-field checks; each error names the key(s) involved.

    Long on purpose: one ``need(condition, key, message)`` line per rule, grouped by
    section, so a key's rules are found by searching for it (a split per section would
    move every rule that crosses sections into a third place).

    ``where(key)`` says where a key came from (``file:line``, an override); without it,
    errors say ``<config>`` (a config built in code). ``on_gpu``: whether the learners get a
    GPU on this machine (:func:`arbor.run.startup.settled` knows; None: not known yet, as when
    a file is loaded, so rules that depend on it judge ``learner.device`` as written).
    """
    where = where or (lambda key: "<config>")

    def need(ok: bool, key: str, why: str) -> None:
        if not ok:
            raise ConfigError(f"{where(key)}: {key} {why}")

    r, e, lo, a, o, le = cfg.rollout, cfg.engine, cfg.loss, cfg.algorithm, cfg.optim, cfg.learner
    m = cfg.model
    need(m.lora_rank >= 0, "model.lora_rank", f"must be ≥ 0 (0: full fine-tuning), got {m.lora_rank}")
    need(m.lora_alpha > 0, "model.lora_alpha", f"must be > 0, got {m.lora_alpha}")
    need(0 <= m.lora_dropout < 1, "model.lora_dropout", f"must be in [0, 1), got {m.lora_dropout}")
    need(all(t.strip() for t in m.lora_targets), "model.lora_targets", f"must be module names, got {m.lora_targets}")
    need(m.lora_rank > 0 or not m.lora_targets, "model.lora_targets", "needs model.lora_rank > 0 (0: full fine-tuning)")
    need(m.lora_rank == 0 or m.ref_path is None, "model.ref_path",
         "must be null with model.lora_rank > 0 (the KL reference is the model with its adapter off)")
    need(r.width >= 1, "rollout.width", f"must be ≥ 1, got {r.width}")
    need(r.branch >= 1, "rollout.branch", f"must be ≥ 1, got {r.branch}")
    need(r.branch <= r.width, "rollout.branch", f"({r.branch}) must not exceed rollout.width ({r.width})")
    need(r.segment_tokens >= 1, "rollout.segment_tokens", f"must be ≥ 1, got {r.segment_tokens}")
    need(r.max_depth >= 1, "rollout.max_depth", f"must be ≥ 1, got {r.max_depth}")
    need(r.temperature > 0, "rollout.temperature", f"must be > 0, got {r.temperature}")
    need(0 < r.top_p <= 1, "rollout.top_p", f"must be in (0, 1], got {r.top_p}")
    need(r.top_k == -1 or r.top_k >= 1, "rollout.top_k", f"must be -1 (off) or ≥ 1, got {r.top_k}")
    need(r.branch_temperature > 0, "rollout.branch_temperature", "must be > 0")
    fork = [r.branch] * 2 if r.root_fork is None else r.root_fork if isinstance(r.root_fork, list) else [r.root_fork] * 2
    need(
        len(fork) == 2 and 1 <= fork[0] <= fork[1] <= r.width,
        "rollout.root_fork",
        f"must be null (rollout.branch copies), k or [lo, hi] with 1 ≤ lo ≤ hi ≤ rollout.width "
        f"({r.width}), got {r.root_fork}",
    )
    need(r.repetition_window >= 1, "rollout.repetition_window", "must be ≥ 1")
    need(r.repetition_count >= 2, "rollout.repetition_count", "must be ≥ 2")
    need(r.agent is None or ":" in r.agent, "rollout.agent", f"must be 'module:attr', got {r.agent!r}")
    need(r.agent_timeout_s > 0, "rollout.agent_timeout_s", f"must be > 0, got {r.agent_timeout_s}")
    need(r.env is None or ":" in r.env, "rollout.env", f"must be 'module:attr', got {r.env!r}")
    need(r.env is None or r.agent is None, "rollout.env",
         "and rollout.agent are both set: an environment replaces the agent (a stateless agent is an "
         "environment); keep one")
    need(r.env is not None or not r.env_args, "rollout.env_args", "needs rollout.env (the class it builds)")
    need(r.env_timeout_s > 0, "rollout.env_timeout_s", f"must be > 0, got {r.env_timeout_s}")
    sources = [key for key, value in (("rollout.program", r.program), ("rollout.program_command", r.program_command),
                                      ("rollout.env", r.env), ("rollout.agent", r.agent)) if value]
    need(len(sources) <= 1 or sources == ["rollout.env", "rollout.agent"], sources[0] if sources else "rollout.program",
         f"and {', '.join(sources[1:])} are all set: a program, a command, an environment and an agent are "
         "alternatives; keep one")
    need(r.program is None or ":" in r.program, "rollout.program", f"must be 'module:attr', got {r.program!r}")
    need(all(isinstance(a, str) and a for a in r.program_command), "rollout.program_command",
         f"must be a list of non-empty strings (argv), got {r.program_command!r}")
    need(r.program_timeout_s > 0, "rollout.program_timeout_s", f"must be > 0, got {r.program_timeout_s}")
    need(not (sources and sources[0].startswith("rollout.program") and r.fork_at != "segment"), "rollout.fork_at",
         "must be segment with a program (a program's runs fork at segment boundaries, by replay)")
    need(r.max_live_envs >= 0, "rollout.max_live_envs", f"must be ≥ 0 (0: no cap), got {r.max_live_envs}")
    if r.fork_at == "entropy":
        need(r.mode == "tree", "rollout.fork_at", "entropy forks a tree: it needs rollout.mode: tree")
        need(1 <= r.entropy_init <= r.width, "rollout.entropy_init",
             f"must be in [1, rollout.width ({r.width})], got {r.entropy_init}")
        need(r.entropy_forks >= 1, "rollout.entropy_forks", f"must be ≥ 1, got {r.entropy_forks}")

    need(e.num_engines >= 1, "engine.num_engines", f"must be ≥ 1, got {e.num_engines}")
    need(e.kind != "external" or bool(e.urls), "engine.urls", "must list the servers when engine.kind is external")
    need(not e.urls or e.kind == "external", "engine.urls", f"is only used with engine.kind: external (kind is {e.kind})")
    need(0 < e.mem_fraction <= 1, "engine.mem_fraction", f"must be in (0, 1], got {e.mem_fraction}")
    need(e.max_retries >= 0, "engine.max_retries", "must be ≥ 0")
    need(e.tp_size >= 1, "engine.tp_size", f"must be ≥ 1, got {e.tp_size}")
    cpu = le.device == "cpu" if on_gpu is None else not on_gpu  # the learners (and engines) run on CPUs
    on_gpus = e.kind == "sglang" or le.device == "cuda" or on_gpu is True
    # NCCL cannot pair two ranks on one GPU: learner rank 0 and its colocated engine.
    need(not (cfg.ray.colocate and on_gpus and le.weight_sync == "distributed"), "learner.weight_sync",
         "must be disk with ray.colocate on GPUs (NCCL cannot put the learner's rank and the engine's on one GPU)")
    need(not (cfg.ray.colocate and e.tp_size > 1), "engine.tp_size",
         f"must be 1 with ray.colocate (a colocated engine gets one learner GPU), got {e.tp_size}")
    for key, resources in (("ray.learner_resources", cfg.ray.learner_resources),
                           ("ray.engine_resources", cfg.ray.engine_resources)):
        for name, amount in resources.items():
            need(name not in ("CPU", "GPU"), key, f"names custom resources; {name} is set by arbor from the run's device")
            need(isinstance(amount, (int, float)) and not isinstance(amount, bool) and amount > 0, key,
                 f"{name} must be a number > 0, got {amount!r}")
    program = r.program is not None or bool(r.program_command)
    need(not (program and e.partial_rollouts), "engine.partial_rollouts",
         "must be false with a program (a program's answers are never sampled again)")
    need(e.max_restarts >= 0, "engine.max_restarts", f"must be ≥ 0 (0: a dead engine stops the run), got {e.max_restarts}")

    need(bool(cfg.reward.functions) or r.env is not None or r.program is not None or bool(r.program_command),
         "reward.functions", "must name at least one reward function (it may be empty only when rollout.env or a "
         "program gives the reward)")
    for i, term in enumerate(cfg.reward.functions):
        key = f"reward.functions[{i}]"
        need(term.kind != "function" or ":" in term.fn, f"{key}.fn", f"must be 'module:attr', got {term.fn!r}")
        need(term.kind != "judge" or bool(term.model) != bool(term.url), f"{key}.model",
             "a judge needs model (an engine the run starts) or url (a running one), one of them")
        need(term.kind != "classifier" or bool(term.model), f"{key}.model", "a classifier needs model")
        need(term.kind != "http" or bool(term.url), f"{key}.url", "an http reward needs url")
        need(term.timeout_s > 0 and term.max_new_tokens >= 1, f"{key}.timeout_s",
             "timeout_s must be > 0 and max_new_tokens ≥ 1")
        if term.kind == "judge":
            try:
                groups = re.compile(term.parser).groups
            except re.error as error:
                groups = -1
                need(False, f"{key}.parser", f"is not a regular expression: {error}")
            need(groups != 0, f"{key}.parser", f"needs a group: group 1 is the score, got {term.parser!r}")
    need(math.isfinite(cfg.reward.env_weight), "reward.env_weight", f"must be a finite number, got {cfg.reward.env_weight}")
    need(cfg.reward.timeout_s > 0, "reward.timeout_s", "must be > 0")
    need(cfg.reward.workers >= 1, "reward.workers", "must be ≥ 1")
    need(cfg.run.max_empty_steps >= 0, "run.max_empty_steps", f"must be ≥ 0 (0: never stop), got {cfg.run.max_empty_steps}")
    need(0 <= cfg.reward.max_failure_fraction <= 1, "reward.max_failure_fraction",
         f"must be in [0, 1], got {cfg.reward.max_failure_fraction}")

    need(0 <= lo.clip_low < 1, "loss.clip_low", f"must be in [0, 1), got {lo.clip_low}")
    need(lo.clip_high >= 0, "loss.clip_high", f"must be ≥ 0, got {lo.clip_high}")
    need(lo.kl_coef >= 0, "loss.kl_coef", "must be ≥ 0")
    need(a.ppo_epochs >= 1, "algorithm.ppo_epochs", "must be ≥ 1")
    need(a.minibatches >= 1, "algorithm.minibatches", "must be ≥ 1")
    need(a.max_staleness >= 0, "algorithm.max_staleness", f"must be ≥ 0 (0: on-policy), got {a.max_staleness}")
    need(lo.behaviour_cap > 0, "loss.behaviour_cap", f"must be > 0, got {lo.behaviour_cap}")
    need(lo.rollout_is_cap > 0, "loss.rollout_is_cap", f"must be > 0, got {lo.rollout_is_cap}")
    bounds = lo.rollout_mask_bounds
    need(len(bounds) == 2 and 0 <= bounds[0] <= 1 <= bounds[1], "loss.rollout_mask_bounds",
         f"must be [lo, hi] with 0 ≤ lo ≤ 1 ≤ hi (a weight of 1, no mismatch, is never masked), got {bounds}")
    # The decoupled objective's proximal policy is the one before each tree's single update.
    need(not (a.max_staleness and a.ppo_epochs > 1), "algorithm.max_staleness",
         f"must be 0 with algorithm.ppo_epochs > 1 (got {a.ppo_epochs}): the off-policy objective takes "
         "the policy before a tree's one update as its proximal policy")
    need(not (e.partial_rollouts and not a.max_staleness), "engine.partial_rollouts",
         "needs algorithm.max_staleness ≥ 1 (on-policy runs never change weights while sampling)")
    d, t = a.distill, a.distill.teacher
    need(not (t.model and t.urls), "algorithm.distill.teacher", "give model (engines the run starts) or urls, not both")
    need(bool(t.urls) == (t.kind == "external"), "algorithm.distill.teacher.kind",
         f"must be external exactly when teacher.urls is set (got kind {t.kind!r}, {len(t.urls)} url(s))")
    need(t.num_engines >= 1, "algorithm.distill.teacher.num_engines", f"must be ≥ 1, got {t.num_engines}")
    need(d.coef >= 0 and math.isfinite(d.coef), "algorithm.distill.coef", f"must be a finite number ≥ 0, got {d.coef}")
    need(d.reward_weight >= 0 and math.isfinite(d.reward_weight), "algorithm.distill.reward_weight",
         f"must be a finite number ≥ 0, got {d.reward_weight}")
    need(
        a.minibatches <= cfg.data.prompts_per_step,
        "algorithm.minibatches",
        f"({a.minibatches}) cannot exceed data.prompts_per_step ({cfg.data.prompts_per_step})",
    )

    need(o.lr > 0, "optim.lr", f"must be > 0, got {o.lr}")
    need(len(o.betas) == 2 and all(0 <= b < 1 for b in o.betas), "optim.betas", "must be two numbers in [0, 1)")
    need(0 <= o.min_lr_ratio <= 1, "optim.min_lr_ratio", "must be in [0, 1]")
    need(o.max_grad_norm >= 0, "optim.max_grad_norm", "must be ≥ 0 (0: no clipping)")
    need(o.warmup_steps >= 0, "optim.warmup_steps", "must be ≥ 0")

    need(le.zero_stage in (0, 1, 2, 3), "learner.zero_stage", f"must be 0, 1, 2 or 3, got {le.zero_stage}")
    need(le.num_ranks >= 1, "learner.num_ranks", "must be ≥ 1")
    need(
        le.backend == "deepspeed" or le.num_ranks == 1,
        "learner.num_ranks",
        "must be 1 with learner.backend: torch (the plain-torch learner is single-process)",
    )
    need(
        le.backend == "deepspeed" or not (le.offload_optimizer or le.offload_params),
        "learner.offload_optimizer",
        "needs learner.backend: deepspeed",
    )
    need(not le.offload_params or le.zero_stage == 3, "learner.offload_params", "needs learner.zero_stage: 3")
    need(le.sync_bucket_mb > 0, "learner.sync_bucket_mb", f"must be > 0, got {le.sync_bucket_mb}")
    need(le.dfs_group_tokens >= 1, "learner.dfs_group_tokens", f"must be ≥ 1, got {le.dfs_group_tokens}")
    # transformers turns the KV cache off in checkpointed layers: the walk's forwards need it.
    need(not (le.tree_execution == "dfs" and m.gradient_checkpointing), "learner.tree_execution",
         "dfs needs model.gradient_checkpointing: false (transformers drops the KV cache under checkpointing)")
    need(le.logit_chunk_tokens >= 0, "learner.logit_chunk_tokens", f"must be ≥ 0 (0: off), got {le.logit_chunk_tokens}")
    need(
        le.pack_tokens >= cfg.data.max_prompt_tokens + r.segment_tokens,
        "learner.pack_tokens",
        f"({le.pack_tokens}) must hold at least one prompt and one segment "
        f"(data.max_prompt_tokens + rollout.segment_tokens = {cfg.data.max_prompt_tokens + r.segment_tokens})",
    )
    need(
        not (cpu and e.kind == "sglang" and e.deterministic),
        "engine.deterministic",
        "needs a GPU with engine.kind: sglang (SGLang samples seeded requests with a Triton kernel)",
    )
    need(
        not (le.attention == "flex" and cpu),
        "learner.attention",
        "flex needs CUDA (FlexAttention has no backward on CPU); use blocks or auto",
    )

    ev = cfg.eval
    need(ev.max_problems >= 0, "eval.max_problems", f"must be ≥ 0 (0: all), got {ev.max_problems}")
    need(ev.samples >= 1, "eval.samples", f"must be ≥ 1, got {ev.samples}")
    need(ev.temperature >= 0, "eval.temperature", f"must be ≥ 0 (0: greedy), got {ev.temperature}")
    need(ev.temperature > 0 or ev.samples == 1, "eval.samples",
         f"must be 1 with eval.temperature: 0 (greedy answers are all the same), got {ev.samples}")
    need(0 < ev.top_p <= 1, "eval.top_p", f"must be in (0, 1], got {ev.top_p}")
    need(ev.max_response_tokens is None or ev.max_response_tokens >= 1, "eval.max_response_tokens",
         f"must be ≥ 1 or null (rollout's budget), got {ev.max_response_tokens}")
    need(ev.step >= 0, "eval.step", f"must be ≥ 0, got {ev.step}")

    sft = cfg.sft
    need(sft.epochs >= 1, "sft.epochs", f"must be ≥ 1, got {sft.epochs}")
    need(sft.batch_size >= 1, "sft.batch_size", f"must be ≥ 1, got {sft.batch_size}")
    need(sft.max_steps >= 0, "sft.max_steps", f"must be ≥ 0 (0: epochs decide), got {sft.max_steps}")

    need(cfg.data.prompts_per_step >= 1, "data.prompts_per_step", "must be ≥ 1")
    need(cfg.data.max_prompt_tokens >= 1, "data.max_prompt_tokens", "must be ≥ 1")
    need(cfg.run.steps >= 0, "run.steps", "must be ≥ 0")
    need(cfg.run.log_every >= 1, "run.log_every", f"must be ≥ 1, got {cfg.run.log_every}")
    need(cfg.run.keep_checkpoints >= 1, "run.keep_checkpoints", f"must be ≥ 1, got {cfg.run.keep_checkpoints}")
    need(cfg.run.cpu_threads >= 0, "run.cpu_threads", f"must be ≥ 0 (0: all cores), got {cfg.run.cpu_threads}")
    need(len(set(cfg.run.loggers)) == len(cfg.run.loggers), "run.loggers", f"names a logger twice: {cfg.run.loggers}")
    for logger in cfg.run.loggers:  # the optional extras: a missing package fails here, not after start-up
        need(logger == "tensorboard" or importlib.util.find_spec(logger) is not None, "run.loggers",
             f"{logger} needs its package: pip install 'arbor[{logger}]'")
    for name in ("eval_every", "save_every", "save_trees_every"):
        need(getattr(cfg.run, name) >= 0, f"run.{name}", "must be ≥ 0")
    need(cfg.run.sync_probe_every is None or cfg.run.sync_probe_every >= 0, "run.sync_probe_every",
         "must be ≥ 0 (0: never), or null (every step synchronous, every 10 asynchronous)")
    need(cfg.run.eval_every == 0 or (cfg.eval.path or cfg.data.eval_path) is not None, "run.eval_every",
         "needs eval.path or data.eval_path (a set to evaluate on)")


def check_context_length(cfg: Config, context_length: int, source: str, command: str = "train") -> None:
    """The longest request must fit the model: ``data.max_prompt_tokens`` + the response
    budget ≤ ``context_length`` (what ``source`` says, e.g. the model's
    ``max_position_embeddings``). The budget of ``arbor train`` is ``rollout.max_depth ×
    rollout.segment_tokens`` (and ``eval.max_response_tokens`` when it evaluates); of
    ``arbor eval``, ``eval.max_response_tokens`` or the rollout's. Else a ConfigError
    naming the keys: past the context a server cuts responses short or refuses them.
    """
    r, ev = cfg.rollout, cfg.eval
    budgets = []  # (keys, tokens, how they add up)
    if command == "train":
        budgets.append(("rollout.max_depth × rollout.segment_tokens", r.max_response_tokens,
                        f"{r.max_depth} × {r.segment_tokens}"))
    if ev.max_response_tokens is not None and (command == "eval" or cfg.run.eval_every):
        budgets.append(("eval.max_response_tokens", ev.max_response_tokens, str(ev.max_response_tokens)))
    elif command == "eval":
        budgets.append(("rollout.max_depth × rollout.segment_tokens (eval.max_response_tokens is null)",
                        r.max_response_tokens, f"{r.max_depth} × {r.segment_tokens}"))
    for keys, tokens, how in budgets:
        total = cfg.data.max_prompt_tokens + tokens
        if total > context_length:
            raise ConfigError(
                f"data.max_prompt_tokens + {keys} = {cfg.data.max_prompt_tokens} + {how} = {total} tokens, "
                f"more than the model's context of {context_length} tokens ({source}); lower "
                f"{keys.split(' (')[0].replace(' × ', ' or ')} or data.max_prompt_tokens"
            )
