"""Typed run configuration: YAML file + ``section.key=value`` overrides.

    cfg = load_config("configs/math.yaml", ["loss.clip_high=0.3", "run.steps=10"])
    cfg.loss.clip_high          # 0.3
    print(dump_config(cfg))     # the resolved config, loadable again

Every key is declared below with its type and default; the field names are the glossary
of the docs. Unknown keys, wrong types and invalid combinations raise
:class:`~arbor.errors.ConfigError` naming the key and the file before any work starts.
Functions receive only the section they need (``cfg.loss``), never the whole config.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from arbor.errors import ConfigError

_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")

Dtype = Literal["auto", "float32", "bfloat16", "float16"]


@dataclass
class ModelConfig:
    # TreePO's base model (as configs/math.yaml): its context holds the default budget, 1,024 + 14 × 512.
    path: str = "Qwen/Qwen2.5-7B"  # HF directory or hub id (hub ids need network)
    dtype: Dtype = "auto"  # auto: bfloat16 on CUDA, float32 on CPU
    trust_remote_code: bool = False
    gradient_checkpointing: bool = False
    ref_path: str | None = None  # frozen reference model for KL; None: same as `path`
    chat_template: bool = True  # format prompts with the tokenizer's chat template


@dataclass
class DataConfig:
    train_path: str = "data/math/train.jsonl"  # jsonl / parquet / HF dataset directory
    eval_path: str | None = None
    id_key: str = "id"
    prompt_key: str = "prompt"
    answer_key: str = "answer"
    # Appended to every problem's prompt, e.g. the answer-format instruction.
    prompt_suffix: str = ""
    system_prompt: str | None = None
    max_prompt_tokens: int = 1024
    prompts_per_step: int = 32  # problems per RL step (each becomes one tree)
    shuffle: bool = True


@dataclass
class RolloutConfig:
    """TreePO sampling (ALGORITHMS.md §1); ``mode: independent`` is the GRPO baseline."""

    mode: Literal["tree", "independent"] = "tree"
    width: int = 16  # completed trajectories (leaves) per prompt: the group size
    branch: int = 2  # copies forked from a node before its next segment
    segment_tokens: int = 512
    max_depth: int = 14  # segments per trajectory at most
    temperature: float = 1.0  # sampling T; the learner scores log-probs of softmax(logits / T) too
    top_p: float = 1.0
    top_k: int = -1  # -1: off
    # Copies of the root before the first segment. null: rollout.branch (the paper's
    # Algorithm 1); k: k copies (1: every leaf shares its first segment); [lo, hi]: a random
    # count per tree (the paper's "More Init Divergence" is [2, 8]).
    root_fork: int | list[int] | None = None
    branch_assignment: Literal["even", "logprob"] = "even"
    # logprob's score: the last segment's mean token log-prob (the paper), or the path's sum.
    branch_logprob: Literal["last_segment", "path"] = "last_segment"
    branch_temperature: float = 2.0  # softmax temperature of the logprob heuristic
    branch_favor: Literal["high", "low"] = "high"
    # No active path and fewer than width leaves: fork from finished paths' segment
    # boundaries (or the root, when none is well-formed) until width. false: a shortfall.
    fallback: bool = True
    repetition_window: int = 32
    repetition_count: int = 8
    # module:attr of the agent deciding what follows each model turn; None: single turn.
    agent: str | None = None
    # Keyword arguments for the agent's class (e.g. {max_tool_calls: 2, timeout_s: 3.0}).
    agent_args: dict[str, Any] = field(default_factory=dict)
    # Wall-clock seconds one agent.step call may take; past it the episode ends there
    # ("agent_timeout", counted in agent/timeouts). The step's thread cannot be killed.
    agent_timeout_s: float = 60.0

    @property
    def max_response_tokens(self) -> int:
        return self.segment_tokens * self.max_depth


@dataclass
class EngineConfig:
    kind: Literal["auto", "sglang", "embedded", "external"] = "auto"
    urls: list[str] = field(default_factory=list)  # kind=external: running servers
    num_engines: int = 1
    host: str = "127.0.0.1"
    tp_size: int = 1
    mem_fraction: float = 0.8  # SGLang --mem-fraction-static
    max_cached_tokens: int = 1_000_000  # embedded engine's radix cache bound; SGLang on CPU: its KV pool
    # kind sglang: the interpreter that runs SGLang (it pins its own torch, so it often has a
    # venv of its own; scripts/sglang_cpu_env.sh builds one for CPUs). null: this interpreter.
    python: str | None = None
    extra_args: list[str] = field(default_factory=list)  # passed to the server command
    startup_timeout_s: float = 600.0
    request_timeout_s: float = 600.0
    max_retries: int = 3
    # SGLang: --enable-deterministic-inference, so per-fork sampling seeds are honoured and
    # runs reproduce (slower kernels). Off: SGLang ignores seeds; forks use its randomness.
    deterministic: bool = False
    # A dead engine is restarted (weights restored, requests resent); more restarts than this
    # without a step in between that it served whole stop the run.
    max_restarts: int = 3
    # The bearer key the engines require (kind external: the one their servers were started
    # with). Unset: $ARBOR_ENGINE_API_KEY, else a fresh key per run for engines arbor starts.
    # Never written out (dump_config drops it) nor shown in a repr.
    api_key: str | None = field(default=None, repr=False)
    # With algorithm.max_staleness ≥ 1 weights change while trees are sampled. false: a
    # segment in flight finishes under the weights it started with (tagged with their
    # version); true: such a segment is dropped and sampled again from its parent (its path's
    # last finished segment) under the new weights. A path may mix versions either way.
    partial_rollouts: bool = False


@dataclass
class RewardTermConfig:
    fn: str = "rewards/math.py:boxed_accuracy"
    weight: float = 1.0


@dataclass
class RewardConfig:
    functions: list[RewardTermConfig] = field(default_factory=lambda: [RewardTermConfig()])
    timeout_s: float = 5.0  # a check past this is killed, scores 0, and is counted
    workers: int = 2
    # More than this share of a step's checks timed out or crashed: the run stops (a broken
    # reward function must not train on zeros). 1.0: never stop.
    max_failure_fraction: float = 0.1


@dataclass
class AlgorithmConfig:
    advantage: Literal["treepo", "grpo", "reinforce_pp", "tempo"] = "treepo"
    treepo_aggregate: Literal["mean", "size_weighted"] = "mean"
    std_normalize: bool = True  # grpo: divide by the group std (False: Dr.GRPO)
    whiten: bool = True  # global token whitening after the estimator (REINFORCE++ style)
    dynamic_sampling: bool = True  # drop prompts whose rewards are all equal
    max_refill_rounds: int = 3  # extra sampling rounds to refill a filtered batch
    ppo_epochs: int = 1
    minibatches: int = 1  # optimizer steps per epoch over one rollout batch
    # Asynchronous RL: the engines sample the next steps' trees while the learner trains, on
    # weights at most this many updates old (older trees are dropped and counted); the loss
    # is then AReaL's decoupled objective (loss.behaviour_cap). 0: sample, then train (on-policy).
    max_staleness: int = 0


@dataclass
class LossConfig:
    # tree: each tree packed once (a shared prefix is computed once); linear: every leaf a
    # chain of its own (arbor.train.packing.linearise_trees), packed: the GRPO baseline's compute,
    # the same loss and gradients.
    mode: Literal["tree", "linear"] = "tree"
    clip_low: float = 0.2
    clip_high: float = 0.28
    normalize: Literal["token", "sequence"] = "token"
    kl_coef: float = 0.0
    kl_estimator: Literal["k1", "k3"] = "k3"
    entropy_coef: float = 0.0
    # algorithm.max_staleness ≥ 1: the cap C of the behaviour weight π_prox/π_behav in the
    # decoupled objective (truncated importance sampling; 2 as in Yao et al. 2025).
    behaviour_cap: float = 2.0


@dataclass
class OptimConfig:
    lr: float = 1e-6
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    warmup_steps: int = 0
    schedule: Literal["constant", "linear", "cosine"] = "constant"
    min_lr_ratio: float = 0.0
    max_grad_norm: float = 1.0


@dataclass
class LearnerConfig:
    backend: Literal["deepspeed", "torch"] = "deepspeed"
    zero_stage: int = 3
    num_ranks: int = 1  # data-parallel learner ranks (Ray actors)
    device: Literal["auto", "cpu", "cuda"] = "auto"
    dtype: Dtype = "auto"  # training dtype: auto = bfloat16 on CUDA, float32 on CPU
    pack_tokens: int = 16384  # token budget of one tree pack (one forward/backward)
    # Tokens per LM-head chunk for log-probs/entropy: [tokens, vocab] logits are never
    # materialised whole (exact gradients, one extra head matmul); 0: whole logits.
    logit_chunk_tokens: int = 1024
    # Tree attention: auto = flex (FlexAttention) on CUDA, blocks (ancestor blocks) on CPU;
    # dense = an N x N mask with SDPA, the reference.
    attention: Literal["auto", "blocks", "dense", "flex"] = "auto"
    offload_optimizer: bool = False
    offload_params: bool = False
    # Weight sync (and HF export) gather and send ZeRO-3 parameters this many MiB at a time
    sync_bucket_mb: float = 512
    # distributed: broadcast over a gloo/NCCL group (/update_weights_from_distributed);
    # disk: write an HF directory the engines load (/update_weights_from_disk).
    weight_sync: Literal["distributed", "disk"] = "distributed"


@dataclass
class RayConfig:
    address: str | None = None  # None: start a local instance; "auto": join a cluster
    num_cpus: int | None = None
    num_gpus: int | None = None
    # Engines and learners share GPUs; the engines release their memory (KV cache, and on
    # GPUs the weights) while the learners train. On CPU only the release applies.
    colocate: bool = False
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"


@dataclass
class SftConfig:
    """``arbor sft``: supervised fine-tuning on conversations or trees of branches (jsonl)."""

    train_path: str = "data/sft/train.jsonl"  # jsonl: {"messages": [...]} or {"prompt": ..., "branches": [...]}
    epochs: int = 1
    batch_size: int = 32  # examples (conversations or trees) per optimizer step, over all ranks
    normalize: Literal["token", "sequence"] = "token"
    max_steps: int = 0  # stop after this many optimizer steps; 0: when the epochs are done
    shuffle: bool = True  # a new order each epoch (seeded by run.seed)


@dataclass
class EvalConfig:
    """``arbor eval`` and the trainer's periodic eval: accuracy through the engines."""

    # The set `arbor eval` and the trainer's periodic eval score; None: data.eval_path.
    path: str | None = None
    max_problems: int = 0  # the first N problems of the set; 0: all
    samples: int = 1  # answers per problem (k of pass@k / maj@k)
    temperature: float = 0.0  # 0: greedy (then samples must be 1)
    top_p: float = 1.0
    max_response_tokens: int | None = None  # None: rollout.segment_tokens · rollout.max_depth
    output: str | None = None  # `arbor eval`'s JSON report; None: <run.output_dir>/eval.json
    step: int = 0  # `arbor eval`'s TensorBoard step (e.g. the evaluated checkpoint's step)


@dataclass
class RunConfig:
    name: str = "arbor"
    output_dir: str = "runs/arbor"
    seed: int = 0
    steps: int = 100
    log_every: int = 1  # a console line every N steps (and the last); metrics.jsonl and TensorBoard get every step
    eval_every: int = 0  # 0: never
    save_every: int = 50  # 0: only at the end
    keep_checkpoints: int = 2  # the newest N complete checkpoints are kept, older ones deleted
    save_trees_every: int = 10  # trees written for `arbor view`; 0: never
    resume: bool = False
    tensorboard: bool = True
    # torch threads of each CPU process (the engine server, each learner rank); 0: the machine's
    # cores (the engine all of them, each learner rank its share). Set 1 where other jobs share
    # the cores: OpenMP threads waiting for a busy core slowed SmolLM2 decoding over 10x here.
    cpu_threads: int = 0


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    sft: SftConfig = field(default_factory=SftConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    run: RunConfig = field(default_factory=RunConfig)
    # Where the config was loaded from (not a key): relative extension specs resolve here.
    source: str | None = field(default=None, compare=False, repr=False)


# -- loading ----------------------------------------------------------------------------


class _Where:
    """Where each key came from, for error messages: ``file:line`` or the override."""

    def __init__(self, path: str | None) -> None:
        self.path = path or "<defaults>"
        self.lines: dict[str, int] = {}
        self.overrides: dict[str, str] = {}

    def __call__(self, key: str) -> str:
        key = key.split("[")[0] if key not in self.lines else key
        if key in self.overrides:
            return f"override {self.overrides[key]!r}"
        if key in self.lines:
            return f"{self.path}:{self.lines[key]}"
        return self.path


def _key_lines(node: yaml.Node, prefix: str, out: dict[str, int]) -> None:
    """Record the 1-based line of every mapping key under ``node`` as ``section.key``."""
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            key = f"{prefix}{key_node.value}"
            out[key] = key_node.start_mark.line + 1
            _key_lines(value_node, key + ".", out)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            out[f"{prefix[:-1]}[{i}]"] = item.start_mark.line + 1
            _key_lines(item, f"{prefix[:-1]}[{i}].", out)


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Read ``path`` (YAML), apply ``section.key=value`` overrides, check everything."""
    where = _Where(None if path is None else str(path))
    raw: dict[str, Any] = {}
    if path is not None:
        try:
            text = Path(path).read_text()
        except OSError as e:
            raise ConfigError(f"cannot read config file {path}: {e.strerror}") from None
        try:
            raw = yaml.safe_load(text) or {}
            node = yaml.compose(text)
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: invalid YAML: {e}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: the top level must be a mapping of sections")
        if node is not None:
            _key_lines(node, "", where.lines)
    for item in overrides:
        key = _apply_override(raw, item)
        where.overrides[key] = item
    cfg = _build(Config, raw, "", where)
    cfg.source = str(Path(path).resolve()) if path is not None else None
    validate(cfg, where)
    return cfg


def _apply_override(raw: dict[str, Any], item: str) -> str:
    key, sep, value = item.partition("=")
    if not sep or not key or key.startswith(".") or key.endswith("."):
        raise ConfigError(f"override {item!r}: expected section.key=value")
    try:
        parsed = yaml.safe_load(value) if value.strip() else ""
    except yaml.YAMLError:
        parsed = value  # not YAML: keep the string, the type check decides
    parts = key.split(".")
    node = raw
    for i, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {item!r}: {'.'.join(parts[: i + 1])} is not a section")
        node = child
    node[parts[-1]] = parsed
    return key


def _build(cls: type, raw: Any, prefix: str, where: _Where) -> Any:
    if not isinstance(raw, dict):
        raise ConfigError(
            f"{where(prefix.rstrip('.'))}: {prefix.rstrip('.') or 'config'} must be a mapping, got {_show(raw)}"
        )
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.name != "source"}
    unknown = [k for k in raw if k not in fields]
    if unknown:
        key = f"{prefix}{unknown[0]}"
        raise ConfigError(
            f"{where(key)}: unknown key '{key}'" + _suggest(str(unknown[0]), list(fields))
            + f" (allowed in {prefix.rstrip('.') or 'the top level'}: {', '.join(fields)})"
        )
    values = {name: _coerce(raw[name], hints[name], f"{prefix}{name}", where) for name in raw}
    return cls(**values)


def _coerce(value: Any, tp: Any, key: str, where: _Where) -> Any:
    """Check ``value`` against the annotation ``tp``; return it (ints widen to floats)."""
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, key + ".", where)
    if origin is typing.Union or origin is types.UnionType:
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return _coerce(value, arg, key, where)
            except ConfigError as e:
                errors.append(e)
        raise errors[0]
    if origin is Literal:
        allowed = typing.get_args(tp)
        if value not in allowed:
            raise ConfigError(
                f"{where(key)}: {key} must be one of {', '.join(map(repr, allowed))}; got {_show(value)}"
            )
        return value
    if origin is dict:
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise ConfigError(f"{where(key)}: {key} must be a mapping of names to values, got {_show(value)}")
        return dict(value)  # values are the consumer's to check (e.g. a class's arguments)
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{where(key)}: {key} must be a list, got {_show(value)}")
        (item_tp,) = typing.get_args(tp)
        return [_coerce(v, item_tp, f"{key}[{i}]", where) for i, v in enumerate(value)]
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where(key)}: {key} must be true or false, got {_show(value)}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where(key)}: {key} must be an integer, got {_show(value)}")
        return value
    if tp is float:
        if isinstance(value, str) and _FLOAT.fullmatch(value.strip()):
            # PyYAML follows YAML 1.1, where `1e-6` (no dot) is a string, not a number.
            return float(value)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where(key)}: {key} must be a number, got {_show(value)}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where(key)}: {key} must be a string, got {_show(value)}")
        return value
    raise TypeError(f"config field {key} has an unsupported annotation {tp!r}")  # our bug


def _show(value: Any) -> str:
    text = repr(value)
    return f"{text[:60]}… ({type(value).__name__})" if len(text) > 60 else f"{text} ({type(value).__name__})"


def _suggest(name: str, options: list[str]) -> str:
    import difflib

    close = difflib.get_close_matches(name, options, n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""


# -- validation of values and combinations ------------------------------------------------


def validate(cfg: Config, where: Callable[[str], str] | None = None) -> None:
    """Range and cross-field checks; each error names the key(s) involved.

    ``where(key)`` says where a key came from (``file:line``, an override); without it,
    errors say ``<config>`` (a config built in code).
    """
    where = where or (lambda key: "<config>")

    def need(ok: bool, key: str, why: str) -> None:
        if not ok:
            raise ConfigError(f"{where(key)}: {key} {why}")

    r, e, lo, a, o, le = cfg.rollout, cfg.engine, cfg.loss, cfg.algorithm, cfg.optim, cfg.learner
    need(r.width >= 1, "rollout.width", f"must be ≥ 1, got {r.width}")
    need(r.branch >= 1, "rollout.branch", f"must be ≥ 1, got {r.branch}")
    need(r.branch <= r.width, "rollout.branch", f"({r.branch}) must not exceed rollout.width ({r.width})")
    need(r.segment_tokens >= 1, "rollout.segment_tokens", f"must be ≥ 1, got {r.segment_tokens}")
    need(r.max_depth >= 1, "rollout.max_depth", f"must be ≥ 1, got {r.max_depth}")
    need(r.temperature > 0, "rollout.temperature", f"must be > 0, got {r.temperature}")
    need(0 < r.top_p <= 1, "rollout.top_p", f"must be in (0, 1], got {r.top_p}")
    need(r.top_k == -1 or r.top_k >= 1, "rollout.top_k", f"must be -1 (off) or ≥ 1, got {r.top_k}")
    need(r.branch_temperature > 0, "rollout.branch_temperature", "must be > 0")
    fork = r.root_fork if isinstance(r.root_fork, list) else [r.root_fork] * 2
    fork = [r.branch, r.branch] if r.root_fork is None else fork
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

    need(e.num_engines >= 1, "engine.num_engines", f"must be ≥ 1, got {e.num_engines}")
    need(e.kind != "external" or bool(e.urls), "engine.urls", "must list the servers when engine.kind is external")
    need(not e.urls or e.kind == "external", "engine.urls", f"is only used with engine.kind: external (kind is {e.kind})")
    need(0 < e.mem_fraction <= 1, "engine.mem_fraction", f"must be in (0, 1], got {e.mem_fraction}")
    need(e.max_retries >= 0, "engine.max_retries", "must be ≥ 0")
    need(e.tp_size >= 1, "engine.tp_size", f"must be ≥ 1, got {e.tp_size}")
    on_gpus = e.kind == "sglang" or le.device == "cuda"
    # NCCL cannot pair two ranks on one GPU: learner rank 0 and its colocated engine.
    need(not (cfg.ray.colocate and on_gpus and le.weight_sync == "distributed"), "learner.weight_sync",
         "must be disk with ray.colocate on GPUs (NCCL cannot put the learner's rank and the engine's on one GPU)")
    need(not (cfg.ray.colocate and e.tp_size > 1), "engine.tp_size",
         f"must be 1 with ray.colocate (a colocated engine gets one learner GPU), got {e.tp_size}")
    need(e.max_restarts >= 0, "engine.max_restarts", f"must be ≥ 0 (0: a dead engine stops the run), got {e.max_restarts}")

    need(bool(cfg.reward.functions), "reward.functions", "must name at least one reward function")
    for i, term in enumerate(cfg.reward.functions):
        need(":" in term.fn, f"reward.functions[{i}].fn", f"must be 'module:attr', got {term.fn!r}")
    need(cfg.reward.timeout_s > 0, "reward.timeout_s", "must be > 0")
    need(cfg.reward.workers >= 1, "reward.workers", "must be ≥ 1")
    need(0 <= cfg.reward.max_failure_fraction <= 1, "reward.max_failure_fraction",
         f"must be in [0, 1], got {cfg.reward.max_failure_fraction}")

    need(0 <= lo.clip_low < 1, "loss.clip_low", f"must be in [0, 1), got {lo.clip_low}")
    need(lo.clip_high >= 0, "loss.clip_high", f"must be ≥ 0, got {lo.clip_high}")
    need(lo.kl_coef >= 0, "loss.kl_coef", "must be ≥ 0")
    need(a.ppo_epochs >= 1, "algorithm.ppo_epochs", "must be ≥ 1")
    need(a.minibatches >= 1, "algorithm.minibatches", "must be ≥ 1")
    need(a.max_staleness >= 0, "algorithm.max_staleness", f"must be ≥ 0 (0: on-policy), got {a.max_staleness}")
    need(lo.behaviour_cap > 0, "loss.behaviour_cap", f"must be > 0, got {lo.behaviour_cap}")
    # The engines keep sampling while the learners train: they cannot give their memory up.
    need(not (a.max_staleness and cfg.ray.colocate), "algorithm.max_staleness",
         "must be 0 with ray.colocate (colocated engines release their memory while the learners train, "
         "so they cannot sample meanwhile)")
    # The decoupled objective's proximal policy is the one before each tree's single update.
    need(not (a.max_staleness and a.ppo_epochs > 1), "algorithm.max_staleness",
         f"must be 0 with algorithm.ppo_epochs > 1 (got {a.ppo_epochs}): the off-policy objective takes "
         "the policy before a tree's one update as its proximal policy")
    need(not (e.partial_rollouts and not a.max_staleness), "engine.partial_rollouts",
         "needs algorithm.max_staleness ≥ 1 (on-policy runs never change weights while sampling)")
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
    need(le.logit_chunk_tokens >= 0, "learner.logit_chunk_tokens", f"must be ≥ 0 (0: off), got {le.logit_chunk_tokens}")
    need(
        le.pack_tokens >= cfg.data.max_prompt_tokens + r.segment_tokens,
        "learner.pack_tokens",
        f"({le.pack_tokens}) must hold at least one prompt and one segment "
        f"(data.max_prompt_tokens + rollout.segment_tokens = {cfg.data.max_prompt_tokens + r.segment_tokens})",
    )
    need(
        not (le.device == "cpu" and e.kind == "sglang" and e.deterministic),
        "engine.deterministic",
        "needs a GPU with engine.kind: sglang (SGLang samples seeded requests with a Triton kernel)",
    )
    need(
        not (le.attention == "flex" and le.device == "cpu"),
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
    for name in ("eval_every", "save_every", "save_trees_every"):
        need(getattr(cfg.run, name) >= 0, f"run.{name}", "must be ≥ 0")
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


# -- dumping ------------------------------------------------------------------------------


def config_to_dict(cfg: Config) -> dict[str, Any]:
    """The config as plain data, without ``engine.api_key`` (a secret: saved runs, printed
    configs and logs must not hold it; a resumed run takes it from the environment again)."""
    out = dataclasses.asdict(cfg)
    out.pop("source", None)
    out["engine"].pop("api_key")
    return out


def dump_config(cfg: Config) -> str:
    """The resolved config as YAML; ``load_config`` of this text gives an equal Config."""
    return yaml.safe_dump(config_to_dict(cfg), sort_keys=False, default_flow_style=False)


def save_config(cfg: Config, path: str | Path) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(dump_config(cfg))
