"""Typed run configuration: YAML file + ``section.key=value`` overrides.

    cfg = load_config("configs/math.yaml", ["loss.clip_high=0.3", "run.steps=10"])
    cfg.loss.clip_high          # 0.3
    print(dump_config(cfg))     # the resolved config, loadable again

Every key is declared below with its type and default; the field names are the glossary of the
docs. Unknown keys, wrong types and invalid combinations raise :class:`~arbor.errors.ConfigError`
naming the key and the file before any work starts (:mod:`arbor.config_load`). Functions
receive only the section they need (``cfg.loss``), never the whole config.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

Dtype = Literal["auto", "float32", "bfloat16", "float16"]


@dataclass
class ModelConfig:
    # TreePO's base model (as configs/math.yaml): its context holds the default budget, 1,024 + 14 × 512.
    path: str = "Qwen/Qwen2.5-7B"  # HF directory or hub id (hub ids need network)
    dtype: Dtype = "auto"  # auto: bfloat16 on CUDA, float32 on CPU
    # Run the model repository's own Python code (transformers, and SGLang's --trust-remote-code).
    trust_remote_code: bool = False
    # Recompute activations in the backward instead of keeping them: less memory, more time.
    gradient_checkpointing: bool = False
    ref_path: str | None = None  # frozen reference model for KL; None: same as `path`
    chat_template: bool = True  # format prompts with the tokenizer's chat template
    # LoRA (docs/lora.md): train a rank-r adapter on the frozen model (peft) and sync only the
    # adapter to the engines; 0: full fine-tuning. The KL reference is the model with the adapter off.
    lora_rank: int = 0
    lora_alpha: float = 16.0  # the adapter's update is scaled by lora_alpha / lora_rank
    lora_dropout: float = 0.0  # > 0 makes the learner's log-probs differ from the engines'
    # Module names the adapter wraps; empty: the architecture's default (arbor.train.lora).
    lora_targets: list[str] = field(default_factory=list)


@dataclass
class DataConfig:
    # jsonl / parquet / HF dataset directory, or a generated set: reasoning_gym:NAME?options
    train_path: str = "data/math/train.jsonl"
    # Held-out problems for the periodic eval (run.eval_every) and `arbor eval`; None: no eval set.
    eval_path: str | None = None
    # Column (or dotted path into a nested one) holding a problem's id; absent: its place, file:line.
    id_key: str = "id"
    # Column (or dotted path) holding the prompt: text or a list of chat messages.
    prompt_key: str = "prompt"
    # Column (or dotted path) holding the gold answer reward functions compare with.
    answer_key: str = "answer"
    # Appended to every problem's prompt, e.g. the answer-format instruction.
    prompt_suffix: str = ""
    # A system message put first, unless the problem's messages carry their own; None: none.
    system_prompt: str | None = None
    # Longer prompts are skipped (never cut) and counted; also bounds the context check.
    max_prompt_tokens: int = 1024
    prompts_per_step: int = 32  # problems per RL step (each becomes one tree)
    # A new problem order each epoch (seeded by run.seed); false: file order.
    shuffle: bool = True


@dataclass
class RolloutConfig:
    """TreePO sampling (docs/algorithms.md); ``mode: independent`` is the GRPO baseline."""

    # tree: TreePO sampling; independent: width separate answers per prompt (GRPO).
    mode: Literal["tree", "independent"] = "tree"
    width: int = 16  # completed trajectories (leaves) per prompt: the group size
    branch: int = 2  # copies forked from a node before its next segment
    # Tokens per segment: paths may fork after each one.
    segment_tokens: int = 512
    max_depth: int = 14  # segments per trajectory at most
    temperature: float = 1.0  # sampling T; the learner scores log-probs of softmax(logits / T) too
    # Nucleus sampling; log-probs stay those of the untruncated tempered distribution.
    top_p: float = 1.0
    top_k: int = -1  # -1: off
    # Copies of the root before the first segment. null: rollout.branch (the paper's
    # Algorithm 1); k: k copies (1: every leaf shares its first segment); [lo, hi]: a random
    # count per tree (the paper's "More Init Divergence" is [2, 8]).
    root_fork: int | list[int] | None = None
    # How each round's path budget is split: evenly, or by the paths' log-probs.
    branch_assignment: Literal["even", "logprob"] = "even"
    # logprob's score: the last segment's mean token log-prob (the paper), or the path's sum.
    branch_logprob: Literal["last_segment", "path"] = "last_segment"
    branch_temperature: float = 2.0  # softmax temperature of the logprob heuristic
    # logprob assignment: favour paths of high or low score.
    branch_favor: Literal["high", "low"] = "high"
    # No active path and fewer than width leaves: fork from finished paths' segment
    # boundaries (or the root, when none is well-formed) until width. false: a shortfall.
    fallback: bool = True
    # A segment repeating some substring this long repetition_count times ends its path as failed.
    repetition_window: int = 32
    # Occurrences of a repetition_window-long substring that count as repetition.
    repetition_count: int = 8
    # module:attr of the agent deciding what follows each model turn; None: single turn.
    agent: str | None = None
    # Keyword arguments for the agent's class (e.g. {max_tool_calls: 2, timeout_s: 3.0}).
    agent_args: dict[str, Any] = field(default_factory=dict)
    # Wall-clock seconds one agent.step call may take; past it the episode ends there
    # ("agent_timeout", counted in agent/timeouts). The step's thread cannot be killed.
    agent_timeout_s: float = 60.0
    # module:attr of an environment (a class built with rollout.env_args, or a factory): state,
    # side effects and a reward of its own, one instance per episode and branch
    # (docs/environments.md). Replaces rollout.agent: set one of the two.
    env: str | None = None
    # Keyword arguments for rollout.env's class or factory.
    env_args: dict[str, Any] = field(default_factory=dict)
    # Wall-clock seconds one environment call (reset, step, copy, reward, close) may take; past
    # it that branch is dropped ("env_timeout", counted in env/timeouts and failures/env_timeout),
    # its siblings go on.
    env_timeout_s: float = 60.0
    # An episode whose next environment (or agent) message does not fit the response budget.
    # unfinished: it ends there, scored with the environment's reward (0 if none), counted in
    # env/overflow_ended (dropping would keep only episodes short enough to fit: a bias toward
    # easy ones). drop: the branch is removed, never trained (env/dropped).
    env_overflow: Literal["drop", "unfinished"] = "unfinished"
    # Environment instances open at once while a step samples; 0: no cap. A branch that needs
    # one more waits for another to close.
    max_live_envs: int = 0
    # module:attr of an agent program: a plain or async def program(problem, ctx) -> float | None
    # calling the policy through an OpenAI-compatible endpoint (ctx.openai_client()); each run is
    # one leaf, forks are replays (docs/agent-programs.md). Replaces rollout.env / rollout.agent.
    program: str | None = None
    # A command run once per episode instead (argv), with OPENAI_BASE_URL, OPENAI_API_KEY,
    # ARBOR_MODEL and ARBOR_SEED set, the problem as JSON on stdin and {"reward": x} as the last
    # line of its stdout. An argv[0] of python/python3/python3.N is this interpreter.
    program_command: list[str] = field(default_factory=list)
    # Wall-clock seconds one program run may take in all; past it the run is dropped and counted
    # (program/timeouts). rollout.env_timeout_s bounds the time a run spends between its calls.
    program_timeout_s: float = 600.0
    # How tool calls are read out of the model's text for a program's chat completions.
    tool_parser: Literal["hermes"] = "hermes"
    # Where paths fork. segment: TreePO's segment boundaries; entropy: TreeRL's EPTree, at the
    # highest-entropy tokens of whole paths already sampled (docs/fork-policies.md).
    fork_at: Literal["segment", "entropy"] = "segment"
    entropy_init: int = 6  # fork_at entropy: whole paths sampled from the prompt first (EPTree's M)
    entropy_forks: int = 2  # fork_at entropy: fork positions per initial path per round (EPTree's N)
    # fork_at entropy: a token's score. sampled: -log p of the token drawn (EPTree's); distribution:
    # the entropy of the distribution it was drawn from, asked of the engine.
    fork_entropy: Literal["sampled", "distribution"] = "sampled"

    @property
    def max_response_tokens(self) -> int:
        return self.segment_tokens * self.max_depth


@dataclass
class EngineConfig:
    # auto: sglang where it is installed and a CUDA GPU is visible, else embedded (`arbor
    # serve`); external: servers already running at engine.urls.
    kind: Literal["auto", "sglang", "embedded", "external"] = "auto"
    urls: list[str] = field(default_factory=list)  # kind=external: running servers
    # Engine servers the run starts (one Ray actor each).
    num_engines: int = 1
    # Address the engines bind on a single machine (on a cluster: their node's address).
    host: str = "127.0.0.1"
    # Tensor-parallel GPUs per SGLang engine.
    tp_size: int = 1
    mem_fraction: float = 0.8  # SGLang --mem-fraction-static
    max_cached_tokens: int = 1_000_000  # embedded engine's radix cache bound; SGLang on CPU: its KV pool
    # kind sglang: the interpreter that runs SGLang (it pins its own torch, so it often has a
    # venv of its own; scripts/sglang_cpu_env.sh builds one for CPUs). null: this interpreter.
    python: str | None = None
    extra_args: list[str] = field(default_factory=list)  # passed to the server command
    # Seconds an engine may take to answer its health check after launch.
    startup_timeout_s: float = 600.0
    # Seconds one HTTP request to an engine may take.
    request_timeout_s: float = 600.0
    # Retries of a request after a connection error or a 5xx answer (with back-off).
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
    # module:attr or path/to/file.py:attr of fn(problem, completion) -> float.
    fn: str = "rewards/math.py:boxed_accuracy"
    # The term's weight in the reward, the weighted sum of the terms.
    weight: float = 1.0
    # function: fn; judge: a generative model's verdict (model or url, template, parser); classifier:
    # a sequence-classification reward model (model); http: a reward server (url). docs/distillation.md
    kind: Literal["function", "judge", "classifier", "http"] = "function"
    model: str | None = None  # judge (served by an `arbor serve` the run starts) / classifier: its HF directory
    url: str | None = None  # judge: a running engine (SGLang's API); http: the reward server's URL
    # judge: the judge's prompt; {prompt}, {response} and {answer} are replaced by the problem's.
    template: str = "{prompt}\n{response}\nIs the answer {answer} right? Score 0-10:"
    parser: str = "(-?[0-9]+(?:[.][0-9]+)?)"  # judge: a regex searched in the verdict; group 1 is the score
    failure_value: float = 0.0  # what a failed call, a null or an unparsable verdict scores (counted)
    timeout_s: float = 60.0  # served kinds: seconds one batched call may take
    max_new_tokens: int = 16  # judge: the verdict's length at most (greedy)


@dataclass
class RewardConfig:
    # Reward terms ({fn, weight}); the first one also decides reward/accuracy and eval correctness.
    # May be empty when rollout.env gives the reward.
    functions: list[RewardTermConfig] = field(default_factory=lambda: [RewardTermConfig()])
    # An episode's reward is env_weight × the environment's reward() (rollout.env) + the terms.
    env_weight: float = 1.0
    timeout_s: float = 5.0  # a check past this is killed, its branch dropped, and counted
    # Processes that run reward checks in parallel.
    workers: int = 2
    # One failure policy: a branch whose user code failed (environment, agent, program, reward
    # function or judge: raised, returned a bad value, ran past its time limit) is dropped and
    # counted (failures/<kind>). More than this share of a step's episodes failed: the run stops,
    # naming the first failure's problem id, turn and message. 1.0: never stop.
    max_failure_fraction: float = 0.1


@dataclass
class TeacherConfig:
    """The teacher of on-policy distillation: engines of its own, placed like the policy's."""

    # The teacher's HF directory, served by engines the run starts; its tokenizer must be model.path's.
    model: str | None = None
    # auto: the policy engines' kind (embedded on CPU); external: servers already running at urls.
    kind: Literal["auto", "sglang", "embedded", "external"] = "auto"
    urls: list[str] = field(default_factory=list)  # kind external: the running teacher servers
    num_engines: int = 1  # teacher servers the run starts (one Ray actor and bundle each)


@dataclass
class DistillConfig:
    """On-policy distillation (docs/distillation.md): the teacher scores the student's tokens."""

    # The teacher's engines; distillation is on when teacher.model or teacher.urls is set.
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    # Token t's advantage gets − coef × (log π_behav(t) − log π_teacher(t)), unwhitened.
    coef: float = 1.0
    # Weight of the task reward's (whitened) advantage; 0: pure distillation, dynamic sampling off.
    reward_weight: float = 0.0
    # reverse_kl: the per-token log-ratio; k3: (r − 1) − log r, r = π_teacher / π_behav (≥ 0, lower variance).
    kind: Literal["reverse_kl", "k3"] = "reverse_kl"

    @property
    def enabled(self) -> bool:
        return bool(self.teacher.model or self.teacher.urls)


@dataclass
class AlgorithmConfig:
    # Advantage estimator: TreePO subgroups, GRPO groups, REINFORCE++, TEMPO, or treerl (TreeRL's
    # global + local advantage per node).
    advantage: Literal["treepo", "grpo", "reinforce_pp", "tempo", "treerl"] = "treepo"
    # treepo: how a leaf's subgroup advantages combine (the paper's plain mean, or weighted by subgroup size).
    treepo_aggregate: Literal["mean", "size_weighted"] = "mean"
    std_normalize: bool = True  # grpo: divide by the group std (False: Dr.GRPO)
    whiten: bool = True  # global token whitening after the estimator (REINFORCE++ style)
    dynamic_sampling: bool = True  # drop prompts whose rewards are all equal
    max_refill_rounds: int = 3  # extra sampling rounds to refill a filtered batch
    # Passes over each rollout batch.
    ppo_epochs: int = 1
    minibatches: int = 1  # optimizer steps per epoch over one rollout batch
    # Asynchronous RL: the engines sample the next steps' trees while the learner trains, on
    # weights at most this many updates old (older trees are dropped and counted); the loss
    # is then AReaL's decoupled objective (loss.behaviour_cap). 0: sample, then train (on-policy).
    max_staleness: int = 0
    # On-policy distillation from a teacher served by its own engines; off unless a teacher is set.
    distill: DistillConfig = field(default_factory=DistillConfig)


@dataclass
class LossConfig:
    # tree: each tree packed once (a shared prefix is computed once); linear: every leaf a
    # chain of its own (arbor.train.packing.linearise_trees), packed: the GRPO baseline's compute,
    # the same loss and gradients.
    mode: Literal["tree", "linear"] = "tree"
    # PPO clip range below 1: the ratio is clipped at 1 - clip_low.
    clip_low: float = 0.2
    # PPO clip range above 1 (DAPO's clip-higher when larger than clip_low).
    clip_high: float = 0.28
    # token: the objective summed over trained tokens, divided by their count; sequence: each
    # trajectory's mean, averaged over trajectories (both on the linearised batch).
    normalize: Literal["token", "sequence"] = "token"
    # Weight of the KL penalty to the reference model (model.ref_path); 0: no reference model.
    kl_coef: float = 0.0
    # KL estimator per token: k1 (log-ratio) or k3 (Schulman's unbiased, non-negative one).
    kl_estimator: Literal["k1", "k3"] = "k3"
    # Weight of the entropy bonus.
    entropy_coef: float = 0.0
    # algorithm.max_staleness ≥ 1: the cap C of the behaviour weight π_prox/π_behav in the
    # decoupled objective (truncated importance sampling; 2 as in Yao et al. 2025).
    behaviour_cap: float = 2.0
    # Engine–learner mismatch (docs/rollout-correction.md): none | tis (weight each token's
    # loss by min(π_old/π_rollout, rollout_is_cap)) | mis (no loss where the weight is outside
    # rollout_mask_bounds). With tis/mis π_old is the learner's forward before the update.
    rollout_correction: Literal["none", "tis", "mis"] = "none"
    rollout_correction_level: Literal["token", "sequence"] = "token"  # sequence: a leaf's path weight
    # tis: the cap on the importance weight π_old/π_rollout.
    rollout_is_cap: float = 2.0
    # mis: [lo, hi]; a token (or leaf) whose weight falls outside carries no loss.
    rollout_mask_bounds: list[float] = field(default_factory=lambda: [0.5, 2.0])


@dataclass
class OptimConfig:
    # AdamW learning rate (the peak, after warm-up).
    lr: float = 1e-6
    # AdamW weight decay.
    weight_decay: float = 0.0
    # AdamW betas.
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    # AdamW epsilon.
    eps: float = 1e-8
    # Optimizer steps of linear warm-up from 0 to optim.lr.
    warmup_steps: int = 0
    # Learning-rate decay after warm-up; its horizon is the run.steps the run started with.
    schedule: Literal["constant", "linear", "cosine"] = "constant"
    # linear / cosine: the floor of the decay as a fraction of optim.lr.
    min_lr_ratio: float = 0.0
    # Gradient norm clipping; 0: no clipping.
    max_grad_norm: float = 1.0


@dataclass
class LearnerConfig:
    # deepspeed: ZeRO ranks placed by Ray; torch: one plain-torch rank, for debugging.
    backend: Literal["deepspeed", "torch"] = "deepspeed"
    # DeepSpeed ZeRO stage (3: parameters, gradients and optimizer state sharded).
    zero_stage: int = 3
    num_ranks: int = 1  # data-parallel learner ranks (Ray actors)
    # auto: cuda when a GPU is visible, else cpu.
    device: Literal["auto", "cpu", "cuda"] = "auto"
    dtype: Dtype = "auto"  # training dtype: auto = bfloat16 on CUDA, float32 on CPU
    # Token budget of one tree pack (one forward/backward); tree_execution dfs walks whole trees.
    pack_tokens: int = 16384
    # Tokens per LM-head chunk for log-probs/entropy: [tokens, vocab] logits are never
    # materialised whole (exact gradients, one extra head matmul); 0: whole logits.
    logit_chunk_tokens: int = 1024
    # Tree attention: auto = flex (FlexAttention) on CUDA, blocks (ancestor blocks) on CPU;
    # dense = an N x N mask with SDPA, the reference.
    attention: Literal["auto", "blocks", "dense", "flex"] = "auto"
    # How a pack is forwarded: packed = all its tokens in one forward and backward (tree
    # attention); dfs = depth first, a group of sibling branches at a time with their
    # ancestors' keys and values as the KV cache: one root-to-leaf path in memory.
    tree_execution: Literal["packed", "dfs"] = "packed"
    # tree_execution dfs: the most tokens (padding included) of sibling branches forwarded
    # together; lower holds less memory, higher makes fewer, larger forwards.
    dfs_group_tokens: int = 2048
    # DeepSpeed: keep the optimizer state in CPU memory.
    offload_optimizer: bool = False
    # DeepSpeed ZeRO-3: keep parameter shards in CPU memory.
    offload_params: bool = False
    # Weight sync (and HF export) gather and send ZeRO-3 parameters this many MiB at a time
    sync_bucket_mb: float = 512
    # distributed: broadcast over a gloo/NCCL group (/update_weights_from_distributed);
    # disk: write an HF directory the engines load (/update_weights_from_disk).
    weight_sync: Literal["distributed", "disk"] = "distributed"


@dataclass
class RayConfig:
    address: str | None = None  # None: start a local instance (never joins a running one); "auto": join a cluster
    # CPUs a local Ray instance offers; None: the machine's (at least what the run needs).
    num_cpus: int | None = None
    # GPUs a local Ray instance offers; None: Ray detects them.
    num_gpus: int | None = None
    # Engines and learners share GPUs; the engines release their memory (KV cache, and on
    # GPUs the weights) while the learners train. On CPU only the release applies. With
    # algorithm.max_staleness ≥ 1 the engines sample while the learners train, so they keep
    # their memory: engine and learner must fit on one GPU together.
    colocate: bool = False
    # Ray placement-group strategy for learner ranks and engines (STRICT_SPREAD: one bundle per node).
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    # Custom Ray resources each learner rank's bundle asks for besides its CPU/GPU, e.g.
    # {trainer: 1} puts the ranks on nodes started with `ray start --resources='{"trainer": 4}'`.
    learner_resources: dict[str, float] = field(default_factory=dict)
    # The same for each engine's bundle (e.g. {rollout: 1}: engines on the nodes that offer it).
    engine_resources: dict[str, float] = field(default_factory=dict)


@dataclass
class SftConfig:
    """``arbor sft``: supervised fine-tuning on conversations or trees of branches (jsonl)."""

    # jsonl: {"messages": [...]} or {"prompt": ..., "branches": [...]}; the default is the tool-use
    # conversations configs/sft.yaml trains on.
    train_path: str = "data/arith-tool/sft.jsonl"
    # Passes over sft.train_path.
    epochs: int = 1
    batch_size: int = 32  # examples (conversations or trees) per optimizer step, over all ranks
    # token: the NLL summed over trained tokens, divided by their count; sequence: divided by
    # the number of root-to-leaf paths.
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
    # Nucleus sampling of eval answers (with eval.temperature > 0).
    top_p: float = 1.0
    max_response_tokens: int | None = None  # None: rollout.segment_tokens · rollout.max_depth
    output: str | None = None  # `arbor eval`'s JSON report; None: <run.output_dir>/eval.json
    step: int = 0  # `arbor eval`'s TensorBoard step (e.g. the evaluated checkpoint's step)


@dataclass
class RunConfig:
    # The run's name, shown in the start-up line.
    name: str = "arbor"
    # Where metrics, TensorBoard logs, checkpoints, trees and the final hf/ model go.
    output_dir: str = "runs/arbor"
    # Seed of the problem order, sampling and initialisation.
    seed: int = 0
    # RL steps of the run (also the learning-rate schedule's horizon).
    steps: int = 100
    log_every: int = 1  # a console line every N steps (and the last); metrics.jsonl and TensorBoard get every step
    eval_every: int = 0  # 0: never
    save_every: int = 50  # 0: only at the end
    keep_checkpoints: int = 2  # the newest N complete checkpoints are kept, older ones deleted
    save_trees_every: int = 10  # trees written for `arbor view`; 0: never
    # sync/logprob_gap (the engines sample a probe after a push, the learners score it) every N
    # steps and on the first; 0: never. None: every step when synchronous (the engines are idle
    # then), every 10 when asynchronous (the probe queues behind the producer's requests: 0.3 s
    # a step on the CPU quickstart, 1 s on an H100).
    sync_probe_every: int | None = None
    # Continue from output_dir's latest checkpoint (a new run refuses a used output_dir).
    resume: bool = False
    # Consecutive steps that train nothing (every tree too stale, failed or over the budget; not
    # dynamic sampling's filter) before the run stops; each is said and counted in run/empty_steps. 0: never.
    max_empty_steps: int = 3
    # Where every step's metrics and the resolved config go beside metrics.jsonl: tensorboard
    # (output_dir/tensorboard), wandb (W&B: WANDB_PROJECT, WANDB_MODE), mlflow (MLflow:
    # MLFLOW_TRACKING_URI, MLFLOW_EXPERIMENT_NAME); [] for none. wandb and mlflow are the
    # extras arbor[wandb] and arbor[mlflow] (docs/metrics.md, Where metrics go).
    loggers: list[Literal["tensorboard", "wandb", "mlflow"]] = field(default_factory=lambda: ["tensorboard"])
    # torch threads of each CPU process (each engine server, each learner rank); 0: the cores
    # split between the engines, the learner ranks and the driver, at least 1 each (on 2 cores:
    # 1 each, the fastest measured). Set 1 where other jobs share the cores: OpenMP threads
    # waiting for a busy core slowed SmolLM2 decoding over 10x.
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
