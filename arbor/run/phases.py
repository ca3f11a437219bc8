"""The phases of one RL step, each a function the trainer calls by name (docs/scale.md).

    batch = collect_rollouts(ctx.sampling, ctx.rewards, ctx.stream, ctx.log, cfg, step)
    advantages = batch_advantages(batch.trees, cfg.algorithm)
    with ctx.weights.changing():     # no engine is restored between the update and its push
        train = train_on_batch(ctx.learners, batch.trees, advantages, step, cfg.algorithm, cfg.loss,
                               pack_tokens=pack_budget(cfg.learner.tree_execution, cfg.learner.pack_tokens),
                               seed=cfg.run.seed)  # PPO epochs × minibatches
        sync = push_weights(ctx.weights, ctx.recovery, version=str(step))
    sync |= probe_weights(ctx.learners, ctx.sampling, cfg.rollout, probe=batch.trees[:2])

Each phase takes the pieces it uses (the run's engines in :class:`Sampling`, the learner
group, the reward pool, the sub-configs) by name and owns none of them: the trainer's
:class:`~arbor.run.context.RunContext` starts and stops them.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
from collections.abc import Callable, Coroutine, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, TypeVar

from arbor.config import AlgorithmConfig, Config, DataConfig, EvalConfig, LossConfig, RolloutConfig
from arbor.data import ProblemStream, format_prompt
from arbor.engines.connect import closing
from arbor.errors import EpisodeFailure, check_failure_share, failure_counts
from arbor.rollout.agents import tool_turns
from arbor.rollout.answers import has_final_answer
from arbor.rollout.environments import FORK_MODES, EnvSource
from arbor.rollout.episodes import EpisodeSetup, run_episodes
from arbor.rollout.programs import ProgramSampler, ProgramSource, program_metrics, program_sampler
from arbor.rollout.rewards import RewardPool, clip_text
from arbor.rollout.sample_stats import SampleStats
from arbor.rollout.sampler import sample_trees
from arbor.rollout.tools import unsandboxed_calls
from arbor.run.learner_group import LearnerGroup
from arbor.run.recovery import EngineRecovery, RecoveringEngine
from arbor.run.weight_sync import EngineWeights, probe_samples
from arbor.train.advantage import compute_advantages, dynamic_sampling_filter
from arbor.train.distill import distill_advantages
from arbor.train.loss import LossStats
from arbor.train.packing import PackedBatch, loss_denominator
from arbor.train.rank_balance import rank_imbalance, rank_packs
from arbor.train.rollout_correction import (
    attach_learner_logprobs,
    correction_of,
    leaf_correction_weights,
)
from arbor.tree import RolloutTree

T = TypeVar("T")
Status = Callable[[str], None]  # a progress line for the console (MetricsLog.status)
log = logging.getLogger(__name__)


@dataclass
class Batch:
    """One step's rollouts: the trees trained on and everything sampled for them."""

    trees: list[RolloutTree]  # kept by dynamic sampling, at most data.prompts_per_step
    sampled: list[RolloutTree] = field(default_factory=list)  # every tree sampled this step
    stats: list[SampleStats] = field(default_factory=list)
    correct: list[bool] = field(default_factory=list)  # per sampled leaf: first reward term > 0
    reward_timeouts: int = 0
    reward_crashed: int = 0  # checks whose worker died (killed, segfault); scored 0
    # Branches dropped because user code failed on them (environment, agent, program, reward):
    # arbor.errors' one failure policy. The step stops past reward.max_failure_fraction.
    failures: list[EpisodeFailure] = field(default_factory=list)
    alike: int = 0  # trees dynamic sampling filtered (their leaves all scored alike)
    reward_served_failures: int = 0  # judge / classifier / http calls or items that failed (their failure_value)
    rounds: int = 0
    requests: int = 0  # /generate calls the rollouts sent (batched: one per round of all trees)
    unsandboxed_tool_calls: int = 0  # tool calls run without bubblewrap while sampling this step
    episodes: bool = False  # multi-turn episodes (rollout.env, or rollout.agent): env/* metrics
    programs: bool = False  # agent programs (rollout.program, rollout.program_command): program/* metrics


@dataclass
class Sampling:
    """What rollouts, evals and the weight-sync probe need of the engines: the run's engines,
    and the tokenizer, environment and prompt format that turn problems into token ids and back."""

    engine: RecoveringEngine  # the run's engines: names the served adapter, recovers a dead server
    tokenizer: Any  # the policy's transformers tokenizer
    # rollout.env's (or rollout.agent's) multi-turn episodes; None: one prompt, one answer.
    env: EnvSource | None
    eos_token_ids: list[int]  # every id that ends a model turn (arbor.data.stop_token_ids)
    data_cfg: DataConfig  # the prompt format: system prompt, suffix, max_prompt_tokens
    chat_template: bool  # model.chat_template
    # engine.partial_rollouts: is a segment of this weight version overtaken by an update
    # (sampled again)? None: segments finish under the weights they started with.
    is_stale: Callable[[str], bool] | None = None
    env_weight: float = 1.0  # reward.env_weight: an episode's reward adds env_weight × its environment's
    # reward.functions is empty: the environment's reward is the whole reward (an episode it
    # gives none is dropped, never scored 0).
    env_reward_only: bool = False
    # Whether the run has warned that most episodes end at the response budget (warn_budget):
    # shared by the copies the asynchronous producer makes of this record.
    budget_warned: list[bool] = field(default_factory=lambda: [False])
    # rollout.program / rollout.program_command: each tree's leaves are runs of it; None: none.
    program: ProgramSource | None = None
    model_name: str = "arbor-policy"  # the name a program's endpoint answers to (model.path's last part)

    def run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        """Run a coroutine on the engine client from the synchronous loop."""
        return asyncio.run(closing(self.engine, coroutine))

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def prompts(self, problems: list[dict]) -> list[list[int]] | None:
        """Each problem's prompt ids; None with an environment (each tree's prompt is its reset's)."""
        if self.env is not None or self.program is not None:
            return None
        return [format_prompt(p, self.data_cfg, self.tokenizer, self.chat_template) for p in problems]

    def programs(self) -> ProgramSampler | None:
        """How a program's trees are sampled (:func:`~arbor.rollout.programs.program_sampler`); None: no program."""
        if self.program is None:
            return None
        return program_sampler(self.engine, self.program, self.tokenizer, self.eos_token_ids, self.model_name,
                               needs_reward=self.env_reward_only)

    def episodes(self) -> EpisodeSetup | None:
        """How multi-turn episodes start and render (:func:`~arbor.rollout.episodes.run_episodes`)."""
        if self.env is None:
            return None
        return run_episodes(self.env, self.tokenizer, self.data_cfg, self.env_reward_only)


def step_seed(seed: int, step: int, round_: int = 0) -> int:
    """Sampling seed of a step's round: a run with the same seed samples the same trees."""
    return (seed * 1_000_003 + step * 1_009 + round_) % (2**31)


class PhaseLog(Protocol):
    """What :func:`collect_rollouts` needs of a log: phase timing and progress lines
    (:class:`~arbor.run.metrics.MetricsLog`; the asynchronous producer keeps its own)."""

    def phase(self, name: str) -> AbstractContextManager[None]: ...

    def status(self, text: str) -> None: ...


def collect_rollouts(
    sampling: Sampling, rewards: RewardPool, stream: ProblemStream, log: PhaseLog, cfg: Config, step: int
) -> Batch:
    """Sample ``data.prompts_per_step`` trees, score them; refill what dynamic sampling drops.

    Reads ``data.prompts_per_step``, ``algorithm.dynamic_sampling`` / ``max_refill_rounds``,
    ``rollout.*``, ``run.seed`` and ``reward.max_failure_fraction``. Raises
    :class:`~arbor.errors.RewardFailureError` when more than ``reward.max_failure_fraction``
    of the step's episodes failed (arbor.errors: the one failure policy).
    """
    target = cfg.data.prompts_per_step
    rounds = 1 + (cfg.algorithm.max_refill_rounds if cfg.algorithm.dynamic_sampling else 0)
    batch = Batch(trees=[])
    for round_ in range(rounds):
        problems = stream.next_batch(target - len(batch.trees))
        calls, unsandboxed = sampling.engine.generate_calls, unsandboxed_calls()
        with log.phase("rollout"):
            trees, stats = sample(sampling, problems, cfg.rollout, step_seed(cfg.run.seed, step, round_), log.status)
        for s in stats:
            batch.failures += s.failures
        with log.phase("reward"):
            correct = score_trees(rewards, sampling.decode, trees, batch, log.status, sampling.env_weight,
                                  reward_timeout_s=cfg.reward.timeout_s)
        batch.sampled += trees
        batch.stats += stats
        batch.requests += sampling.engine.generate_calls - calls
        batch.unsandboxed_tool_calls += unsandboxed_calls() - unsandboxed
        batch.correct += correct
        batch.rounds = round_ + 1
        batch.episodes = sampling.env is not None
        batch.programs = sampling.program is not None
        trees = [t for t in trees if t.leaves()]  # every branch dropped (failures, the budget): nothing to train
        kept = dynamic_sampling_filter(trees) if cfg.algorithm.dynamic_sampling else trees
        batch.alike += len(trees) - len(kept)
        batch.trees += kept
        if len(batch.trees) >= target:
            break
    check_failure_share(batch.failures, episodes_attempted(batch), cfg.reward.max_failure_fraction, f"step {step}")
    warn_budget(batch, cfg.rollout, step, sampling.budget_warned)
    return batch


def episodes_attempted(batch: Batch) -> int:
    """Episodes the step sampled: the leaves kept, those dropped (by their environment's failure,
    the budget, a diverged replay, a failed reward check) and the branches that never started
    (a failed reset or copy): what ``reward.max_failure_fraction`` is a share of."""
    kept = sum(len(t.leaves()) for t in batch.sampled)
    dropped = sum(s.env_dropped + s.unstarted for s in batch.stats)
    reward_failed = sum(1 for f in batch.failures if f.kind.startswith(("reward_", "judge_")))
    return kept + dropped + reward_failed


def sample(
    sampling: Sampling, problems: list[dict], rollout_cfg: RolloutConfig, seed: int, status: Status
) -> tuple[list[RolloutTree], list[SampleStats]]:
    """Trees for ``problems`` from the engines (progress on the console)."""
    done = [0]

    def progress(*_: Any) -> None:
        done[0] += 1
        status(f"rollout: {done[0]}/{len(problems)} trees")

    programs = sampling.programs()
    if programs is not None:
        return sampling.run(programs(problems, rollout_cfg, seed, progress))
    return sampling.run(sample_trees(
        sampling.engine, problems, sampling.prompts(problems), rollout_cfg, eos_token_ids=sampling.eos_token_ids,
        seed=seed, is_final_answer=lambda ids: has_final_answer(sampling.decode(ids)), decode=sampling.decode,
        on_progress=progress, env=sampling.episodes(), is_stale=sampling.is_stale,
    ))


def score_trees(
    rewards: RewardPool, decode: Callable[[list[int]], str], trees: list[RolloutTree], batch: Batch, status: Status,
    env_weight: float = 1.0, reward_timeout_s: float | None = None,
) -> list[bool]:
    """Set every leaf's reward: the reward functions' + ``env_weight`` × its environment's reward
    (``reward.env_weight``; none without an environment). Returns per-leaf correctness (of the
    leaves kept): the first reward term > 0, or with no reward functions the reward > 0.

    A check that failed (the function raised or returned a non-number, ran past ``reward.timeout_s``,
    or its worker died) drops its leaf, never trained on, recorded in ``batch.failures``
    (``failures/reward_*``) and counted in ``reward/timeouts`` / ``reward/crashed``.
    """
    leaves = [(tree, leaf) for tree in trees for leaf in tree.leaves()]
    items = [(tree.problem or {}, decode(tree.response_ids(leaf))) for tree, leaf in leaves]
    result = rewards.score(items, lambda d, n: status(f"rewards: {d}/{n}"), record_errors=True)
    limit = f"reward.timeout_s={reward_timeout_s:g}s" if reward_timeout_s else "reward.timeout_s"
    failed: dict[int, tuple[str, str]] = {i: ("reward_error", message) for i, message in result.errors.items()}
    failed |= {i: ("reward_timeout", f"the check ran past {limit} and was killed") for i in result.timed_out}
    failed |= {i: ("reward_crash", "the check's worker process died") for i in result.crashed}
    for i, (kind, message) in sorted(failed.items()):
        problem_id = repr(items[i][0].get("id", f"<item {i}>"))
        failure = EpisodeFailure(kind, problem_id, None, f"{message} (completion {clip_text(items[i][1], 80)})")
        batch.failures.append(failure)
        log.info("%s: the branch is dropped", failure.describe())
    batch.reward_timeouts += len(result.timed_out)
    batch.reward_crashed += len(result.crashed)
    batch.reward_served_failures += result.served_failures
    for (_, leaf), score in zip(leaves, result.scores):
        leaf.reward = score + (0.0 if leaf.env_reward is None else env_weight * leaf.env_reward)
    by_tree: dict[int, list] = {}
    for i in failed:
        by_tree.setdefault(id(leaves[i][0]), []).append(leaves[i][1])
    for tree in trees:
        if id(tree) in by_tree:
            tree.drop_leaves(by_tree[id(tree)])
    first = next(iter(result.term_scores.values()), [leaf.reward or 0.0 for _, leaf in leaves])
    return [v > 0 for i, v in enumerate(first) if i not in failed]


def batch_advantages(trees: list[RolloutTree], algorithm: AlgorithmConfig) -> list:
    """The estimator's advantages; with ``algorithm.distill`` per-token values mixing them
    (× ``reward_weight``; not computed at 0) with the teacher's term (:mod:`arbor.train.distill`)."""
    distill = algorithm.distill
    reward = None if distill.enabled and distill.reward_weight == 0 else compute_advantages(
        trees, algorithm.advantage, treepo_aggregate=algorithm.treepo_aggregate,
        std_normalize=algorithm.std_normalize, whiten_tokens=algorithm.whiten,
    )
    if not distill.enabled:
        return reward  # type: ignore[return-value]  # computed above when not distilling
    return distill_advantages(trees, reward, reward_weight=distill.reward_weight, coef=distill.coef, kind=distill.kind)


def train_on_batch(
    learners: LearnerGroup, trees: list[RolloutTree], advantages: list, step: int, algorithm: AlgorithmConfig,
    loss_cfg: LossConfig, *, pack_tokens: int, seed: int, behaviour_cap: float | None = None,
) -> dict[str, float]:
    """``ppo_epochs`` × ``minibatches`` learner updates over the batch; loss metrics.

    ``pack_tokens``: a pack's budget (``learner.pack_tokens``; whole trees with
    ``learner.tree_execution: dfs``, :func:`arbor.train.dfs.pack_budget`); ``seed``: ``run.seed`` (the epochs' shuffles);
    ``behaviour_cap``: ``loss.behaviour_cap`` for off-policy batches (the decoupled objective),
    None on-policy. With ``loss.rollout_correction`` tis/mis the learners first score the whole
    batch without an update (π_old, :func:`recompute_old_logprobs`); at sequence level each
    leaf's weight then scales its advantage mass in the packs. ``mismatch/*`` every step.
    """
    correction = correction_of(loss_cfg)
    leaf_level = correction.recompute and correction.level == "sequence"
    if correction.recompute:
        recompute_old_logprobs(learners, trees, pack_tokens)
    stats, norms, lrs = LossStats(), [], []
    rank_tokens = [0] * learners.world_size  # tokens each rank forwarded over the step's updates
    order = list(range(len(trees)))
    for epoch in range(algorithm.ppo_epochs):
        if epoch:
            random.Random(step_seed(seed, step, 100 + epoch)).shuffle(order)
        size = -(-len(order) // algorithm.minibatches)
        for start in range(0, len(order), size):
            chosen = order[start : start + size]
            sub_trees, sub_adv = [trees[i] for i in chosen], [advantages[i] for i in chosen]
            if loss_cfg.mode == "linear":
                from arbor.train.packing import linearise_trees

                sub_trees, sub_adv = linearise_trees(sub_trees, sub_adv)
            weights = leaf_correction_weights(sub_trees, correction)[0] if leaf_level else None
            # Each rank its share of the trees, balanced by the tokens it computes, packed there.
            per_rank, tokens = rank_packs(sub_trees, sub_adv, learners.world_size, pack_tokens=pack_tokens,
                                          normalize=loss_cfg.normalize, correction_weights=weights)
            rank_tokens = [a + b for a, b in zip(rank_tokens, tokens)]
            denominator = loss_denominator(sub_trees, loss_cfg.normalize)
            results = learners.step(per_rank, denominator, filler=_filler(per_rank), behaviour_cap=behaviour_cap)
            stats = sum((r.stats for r in results), stats)
            norms.append(results[0].grad_norm)  # the same on every rank
            lrs.append(results[0].lr)
    metrics = {f"train/{k}": v for k, v in stats.metrics().items()}
    nonfinite = [i for i, n in enumerate(norms) if not math.isfinite(n)]
    if nonfinite:  # the learner's log names the parameters; this names the step
        log.warning("step %d: gradient norm not finite in update(s) %s of %d (train/nonfinite_grad_norms)",
                    step, nonfinite, len(norms))
    finite = [n for n in norms if math.isfinite(n)]
    metrics["train/grad_norm"] = sum(finite) / len(finite) if finite else float("nan")
    metrics["train/nonfinite_grad_norms"] = float(len(nonfinite))
    metrics["train/lr"] = lrs[-1]
    metrics["train/updates"] = float(len(norms))
    metrics["train/rank_imbalance"] = rank_imbalance(rank_tokens)
    mismatch = stats.mismatch
    if leaf_level:  # the weights are the leaves' (per leaf); the KL stays per token
        mismatch = replace(leaf_correction_weights(trees, correction)[1], kl=mismatch.kl, tokens=mismatch.tokens)
    metrics |= {f"mismatch/{k}": v for k, v in mismatch.metrics().items()}
    return metrics


def recompute_old_logprobs(learners: LearnerGroup, trees: list[RolloutTree], pack_tokens: int) -> None:
    """π_old for ``loss.rollout_correction``: the learners' log-probs of every trained token of
    ``trees`` under the weights before this batch's updates, into ``node.learner_logprobs``."""
    per_rank, _ = rank_packs(trees, None, learners.world_size, pack_tokens=pack_tokens)
    results = learners.old_logprobs(per_rank, filler=_filler(per_rank))
    attach_learner_logprobs(trees, [p for packs in per_rank for p in packs], [lp for logps in results for lp in logps])


def _filler(per_rank: list[list[PackedBatch]]) -> PackedBatch:
    """A pack for the idle passes of ranks without one (ZeRO-3: every rank in every forward)."""
    return next(pack for packs in per_rank for pack in packs)


def push_weights(weights: EngineWeights, recovery: EngineRecovery, version: str) -> dict[str, float]:
    """Learner weights → every engine (cache flushed, version checked), inside the trainer's
    ``weights.changing()`` block: :mod:`arbor.run.weight_sync`."""
    sent = recovery.push(version)  # a server that died after its last request is restarted first
    return {"sync/weight_version": float(version), "sync/bytes": float(sent)}


def probe_weights(
    learners: LearnerGroup, sampling: Sampling, rollout_cfg: RolloutConfig, probe: list[RolloutTree],
    flush: bool = True,
) -> dict[str, float]:
    """``sync/logprob_gap``: the engines sample the probe's prompts (naming the pushed adapter)
    and the learners score the samples; ~0 when the engines serve the learners' weights.

    ``flush`` empties the engines' prefix cache afterwards, so a synchronous run's next step
    starts from the cache state a resumed run has. An asynchronous run passes False: its
    producer is sampling meanwhile, and a flush would throw away the KV of its unfinished
    trees (their children's prompts would be prefilled again)."""
    if not probe:
        return {}
    samples = sampling.run(probe_samples(sampling.engine, [t.prompt_ids for t in probe],
                                         max_new_tokens=rollout_cfg.segment_tokens, temperature=rollout_cfg.temperature))
    gap = learners.logprob_gap(samples)
    if flush:  # the probe's KV must not make the next step's cache state differ from a resumed run's
        sampling.run(sampling.engine.flush_cache())
    return {"sync/logprob_gap": gap}


def evaluate(
    sampling: Sampling, rewards: RewardPool, problems: list[dict], eval_cfg: EvalConfig,
    rollout_cfg: RolloutConfig, seed: int, status: Status,
) -> dict[str, float]:
    """``eval/*`` metrics (pass@k, maj@k, accuracy, length; tool calls with an agent) on
    ``problems``: :mod:`arbor.run.evaluate`."""
    from arbor.run.evaluate import run_eval

    problems = problems[: eval_cfg.max_problems or None]
    report = run_eval(
        sampling.engine, rewards, problems, sampling.prompts(problems), eval_cfg, rollout_cfg, decode=sampling.decode,
        eos_token_ids=sampling.eos_token_ids, seed=seed, run_async=sampling.run, status=status,
        env=sampling.episodes(), env_weight=sampling.env_weight, programs=sampling.programs(),
    )
    # As after the probe: the next step starts from the cache state a resumed run has.
    sampling.run(sampling.engine.flush_cache())
    return report.metrics


EVAL_PHASE = "eval"  # the periodic eval's phase name (time/eval_s)


def working_seconds(phase_seconds: Mapping[str, float]) -> float:
    """A step's own time: its timed phases (``time/<phase>_s``) but the periodic eval's,
    which samples other problems for no update (counted, every eval step's throughput dips)."""
    return sum(seconds for name, seconds in phase_seconds.items() if name != EVAL_PHASE)


def throughput_metrics(batch: Batch, phase_seconds: Mapping[str, float]) -> dict[str, float]:
    """Trajectories and generated tokens per second of the step's own work (:func:`working_seconds`)."""
    seconds = working_seconds(phase_seconds) or 1e-9
    leaves = sum(len(t.leaves()) for t in batch.sampled)
    tokens = sum(s.tokens_generated for s in batch.stats)
    return {"throughput/trajectories_per_s": leaves / seconds, "throughput/tokens_per_s": tokens / seconds}


def rollout_metrics(batch: Batch) -> dict[str, float]:
    """Reward, response, tree and rollout-cost metrics of everything sampled this step."""
    leaves = [leaf for tree in batch.sampled for leaf in tree.leaves()]
    rewards = [leaf.reward or 0.0 for leaf in leaves]  # every sampled leaf was scored (score_trees)
    lengths = [leaf.end for leaf in leaves]
    by_tree = {id(tree): tree.stats() for tree in batch.sampled}  # batch.trees ⊆ batch.sampled
    stats = list(by_tree.values())
    trained = [by_tree[id(tree)] for tree in batch.trees]
    n = max(len(leaves), 1)
    computed = sum(s.tokens_computed for s in batch.stats)
    prompt = sum(s.prompt_tokens for s in batch.stats)
    return {
        "reward/mean": sum(rewards) / n,
        "reward/std": (sum((r - sum(rewards) / n) ** 2 for r in rewards) / n) ** 0.5,
        "reward/accuracy": sum(batch.correct) / n,
        "reward/timeouts": float(batch.reward_timeouts),
        "reward/crashed": float(batch.reward_crashed),
        "reward/served_failures": float(batch.reward_served_failures),
        # Leaves whose group-relative advantage can be non-zero: those of trees whose leaves'
        # rewards differ (the rest teach nothing). Why an arm learns more per step than another.
        "reward/signal_leaves": sum(len(t.leaves()) for t in batch.sampled
                                    if len({leaf.reward for leaf in t.leaves()}) > 1) / n,
        "response/length_mean": sum(lengths) / n,
        "response/length_max": float(max(lengths, default=0)),
        "response/finished": sum(leaf.finish_reason == "stop" for leaf in leaves) / n,
        "tree/leaves": n / max(len(batch.sampled), 1),
        "tree/depth_mean": sum(s.max_depth for s in stats) / max(len(stats), 1),
        "tree/sharing_ratio": sum(s.linearised_tokens for s in stats) / max(sum(s.unique_tokens for s in stats), 1),
        "rollout/trees": float(len(batch.sampled)),
        "rollout/trees_trained": float(len(batch.trees)),
        "rollout/refill_rounds": float(batch.rounds - 1),
        # TreePO fallback: finished paths cut and restarted from, and root restarts (no
        # path ended well); rounds: sequential sampling rounds per tree.
        "rollout/fallbacks": float(sum(s.fallbacks for s in batch.stats)),
        "rollout/root_restarts": float(sum(s.root_restarts for s in batch.stats)),
        "rollout/rounds_per_tree": sum(s.rounds for s in batch.stats) / max(len(batch.stats), 1),
        "rollout/requests": float(batch.requests),  # /generate calls (a batch is one)
        "rollout/tokens_generated": float(sum(s.tokens_generated for s in batch.stats)),
        "rollout/tokens_computed": float(computed),
        "rollout/cached_ratio": sum(s.cached_tokens for s in batch.stats) / max(prompt, 1),
        "train/tokens_saved": float(sum(s.linearised_tokens - s.unique_tokens for s in trained)),
        # Multi-turn episodes (rollout.agent): tool turns on each trajectory's path, errors.
        "agent/tool_calls_per_episode": sum(tool_turns(tree, leaf) for tree in batch.sampled for leaf in tree.leaves()) / n,
        "agent/tool_errors": float(sum(s.tool_errors for s in batch.stats)),
        "agent/timeouts": float(sum(s.agent_timeouts for s in batch.stats)),  # steps past rollout.agent_timeout_s
        # Tool calls run without bubblewrap (agent_args.allow_unsandboxed) in this step's rollouts.
        "agent/unsandboxed_tool_calls": float(batch.unsandboxed_tool_calls),
        # Episodes that ran out of the response budget (agent and environment messages count).
        "response/max_length": sum(leaf.finish_reason == "max_length" for leaf in leaves) / n,
    } | failure_counts(batch.failures) | (env_metrics(batch) if batch.episodes else {}) | (
        program_metrics(batch.stats) if batch.programs else {})


def env_metrics(batch: Batch) -> dict[str, float]:
    """``env/*``: environments' rewards, steps, forks by mode, replays, failures, instances left open."""
    stats = batch.stats
    rewards = [leaf.env_reward for tree in batch.sampled for leaf in tree.leaves() if leaf.env_reward is not None]
    forks = {mode: float(sum(s.env_forks.get(mode, 0) for s in stats)) for mode in FORK_MODES}
    return {
        "env/steps_per_episode": sum(s.env_episode_steps for s in stats) / max(sum(s.env_episodes for s in stats), 1),
        "env/forks": sum(forks.values()),
        **{f"env/forks/{mode}": count for mode, count in forks.items()},
        "env/replayed_steps": float(sum(s.env_replayed_steps for s in stats)),
        "env/timeouts": float(sum(s.env_timeouts for s in stats)),
        "env/errors": float(sum(s.env_errors for s in stats)),
        "env/dropped": float(sum(s.env_dropped for s in stats)),  # leaves never trained on
        # Episodes ended where the next message did not fit (rollout.env_overflow: unfinished).
        "env/overflow_ended": float(sum(s.overflow_ended for s in stats)),
        "env/diverged": float(sum(s.env_diverged for s in stats)),  # replays that did not rebuild the episode
        "env/live": float(sum(s.env_live for s in stats)),  # 0: every instance was closed
    } | ({"env/reward_mean": sum(rewards) / len(rewards)} if rewards else {})


def warn_budget(batch: Batch, rollout_cfg: RolloutConfig, step: int, warned: list[bool]) -> None:
    """Warn once (``warned`` holds whether it has) when most of a step's episodes ended at the
    response budget: their answers were cut, or dropped because an agent's or environment's
    messages did not fit, and nothing else says why (``response/max_length``, ``env/errors``)."""
    leaves = [leaf for tree in batch.sampled for leaf in tree.leaves()]
    too_long = sum(s.dropped_too_long for s in batch.stats)  # dropped: their messages did not fit
    at_budget = sum(leaf.finish_reason in ("max_length", "message_too_long") for leaf in leaves)
    cut = (at_budget + too_long) / max(len(leaves) + too_long, 1)
    if cut <= 0.5 or warned[0]:
        return
    warned[0] = True
    log.warning("step %d: %.0f%% of the episodes ended at the response budget, rollout.segment_tokens × "
                "rollout.max_depth = %d × %d = %d tokens (agent and environment messages count against it): "
                "their answers were cut, or their agent's messages did not fit. Raise rollout.segment_tokens or "
                "rollout.max_depth (response/max_length)",
                step, 100 * cut, rollout_cfg.segment_tokens, rollout_cfg.max_depth, rollout_cfg.max_response_tokens)
