"""The phases of one RL step, each a function the trainer calls by name (ARCHITECTURE.md).

    batch = collect_rollouts(ctx, step)          # sample trees, score leaves, dynamic sampling
    advantages = batch_advantages(batch.trees, cfg.algorithm)
    train = train_on_batch(ctx, batch.trees, advantages, step)   # PPO epochs × minibatches
    sync = sync_weights(ctx, version=str(step), probe=batch.trees[:2])

``ctx`` (:class:`arbor.trainer.RunContext`) holds the config, the engine client, the
learner group, the reward pool and the tokenizer; the phases own nothing.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from arbor.advantage import compute_advantages, dynamic_sampling_filter
from arbor.agents import episode_inputs, tool_turns
from arbor.answers import has_final_answer
from arbor.config import AlgorithmConfig
from arbor.learner import sums_metrics
from arbor.packing import assign_to_ranks, loss_denominator, pack_trees
from arbor.rewards import check_failure_fraction, failed_checks
from arbor.sampler import SampleStats, sample_trees
from arbor.tree import RolloutTree

if TYPE_CHECKING:
    from arbor.trainer import RunContext

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
    reward_failures: list[str] = field(default_factory=list)  # one line per timed-out / crashed check
    rounds: int = 0


def step_seed(seed: int, step: int, round_: int = 0) -> int:
    """Sampling seed of a step's round: a run with the same seed samples the same trees."""
    return (seed * 1_000_003 + step * 1_009 + round_) % (2**31)


def collect_rollouts(ctx: RunContext, step: int) -> Batch:
    """Sample ``data.prompts_per_step`` trees, score them; refill what dynamic sampling drops.

    Raises :class:`~arbor.rewards.RewardFailureError` when more than
    ``reward.max_failure_fraction`` of the step's reward checks timed out or crashed.
    """
    cfg = ctx.cfg
    target = cfg.data.prompts_per_step
    rounds = 1 + (cfg.algorithm.max_refill_rounds if cfg.algorithm.dynamic_sampling else 0)
    batch = Batch(trees=[])
    for round_ in range(rounds):
        problems = ctx.stream.next_batch(target - len(batch.trees))
        with ctx.log.phase("rollout"):
            trees, stats = sample(ctx, problems, cfg.rollout, step_seed(cfg.run.seed, step, round_))
        with ctx.log.phase("reward"):
            correct = score_trees(ctx, trees, batch)
        batch.sampled += trees
        batch.stats += stats
        batch.correct += correct
        batch.rounds = round_ + 1
        batch.trees += dynamic_sampling_filter(trees) if cfg.algorithm.dynamic_sampling else trees
        if len(batch.trees) >= target:
            break
    check_failure_fraction(batch.reward_timeouts + batch.reward_crashed, len(batch.correct),
                           cfg.reward.max_failure_fraction, batch.reward_failures)
    return batch


def sample(ctx: RunContext, problems: list[dict], rollout_cfg: Any, seed: int) -> tuple[list[RolloutTree], list[SampleStats]]:
    """Trees for ``problems`` from the engines (progress on the console)."""
    cfg, tokenizer = ctx.cfg, ctx.tokenizer
    # With rollout.agent, multi-turn episodes from the agent's start; else one prompt each.
    prompts, render = episode_inputs(problems, ctx.agent, tokenizer, cfg.data, cfg.model.chat_template)
    done = [0]

    def progress(*_: Any) -> None:
        done[0] += 1
        ctx.log.status(f"rollout: {done[0]}/{len(problems)} trees")

    def decode(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=True)

    return ctx.run_async(sample_trees(
        ctx.client, problems, prompts, rollout_cfg, eos_token_ids=ctx.eos_token_ids, seed=seed,
        is_final_answer=lambda ids: has_final_answer(decode(ids)), decode=decode, on_progress=progress,
        agent=ctx.agent, render=render,
    ))


def score_trees(ctx: RunContext, trees: list[RolloutTree], batch: Batch) -> list[bool]:
    """Set every leaf's reward; returns per-leaf correctness (first reward term > 0).

    Timed-out and crashed checks (scored 0) are counted in ``batch`` and warned about by problem id.
    """
    leaves = [(tree, leaf) for tree in trees for leaf in tree.leaves()]
    items = [
        (tree.problem, ctx.tokenizer.decode(tree.response_ids(leaf), skip_special_tokens=True))
        for tree, leaf in leaves
    ]
    result = ctx.rewards.score(items, lambda d, n: ctx.log.status(f"rewards: {d}/{n}"))
    for (_, leaf), score in zip(leaves, result.scores):
        leaf.reward = score
    failures = failed_checks(result, items)
    for line in failures:
        log.warning("%s", line)
    batch.reward_timeouts += len(result.timed_out)
    batch.reward_crashed += len(result.crashed)
    batch.reward_failures += failures
    first = next(iter(result.term_scores.values()), result.scores)
    return [v > 0 for v in first]


def batch_advantages(trees: list[RolloutTree], algorithm: AlgorithmConfig) -> list:
    return compute_advantages(
        trees, algorithm.advantage, treepo_aggregate=algorithm.treepo_aggregate,
        std_normalize=algorithm.std_normalize, whiten_tokens=algorithm.whiten,
    )


def train_on_batch(ctx: RunContext, trees: list[RolloutTree], advantages: list, step: int) -> dict[str, float]:
    """``ppo_epochs`` × ``minibatches`` learner updates over the batch; loss metrics."""
    cfg = ctx.cfg
    sums, norms, lrs = [], [], []
    order = list(range(len(trees)))
    for epoch in range(cfg.algorithm.ppo_epochs):
        if epoch:
            random.Random(step_seed(cfg.run.seed, step, 100 + epoch)).shuffle(order)
        size = -(-len(order) // cfg.algorithm.minibatches)
        for start in range(0, len(order), size):
            chosen = order[start : start + size]
            sub_trees, sub_adv = [trees[i] for i in chosen], [advantages[i] for i in chosen]
            if cfg.loss.mode == "linear":
                from arbor.packing import linearise_trees

                sub_trees, sub_adv = linearise_trees(sub_trees, sub_adv)
            packs = pack_trees(sub_trees, sub_adv, pack_tokens=cfg.learner.pack_tokens,
                               normalize=cfg.loss.normalize)
            per_rank = [[packs[i] for i in r] for r in assign_to_ranks(packs, ctx.learners.world_size)]
            denominator = loss_denominator(sub_trees, cfg.loss.normalize)
            results = ctx.learners.step(per_rank, denominator, filler=packs[0])
            sums += results
            norms.append(results[0]["grad_norm"])
            lrs.append(results[0]["lr"])
    metrics = {f"train/{k}": v for k, v in sums_metrics(sums).items()}
    metrics["train/grad_norm"] = sum(norms) / len(norms)
    metrics["train/lr"] = lrs[-1]
    metrics["train/updates"] = float(len(norms))
    return metrics


def sync_weights(ctx: RunContext, version: str, probe: list[RolloutTree]) -> dict[str, float]:
    """Learner weights → every engine (cache flushed, version checked), then the probe gap."""
    from arbor.weight_sync import probe_samples

    cfg = ctx.cfg
    ctx.recovery.revive_dead()  # a server that died after its last request is restarted first
    ctx.learners.push_weights(ctx.engines.urls, version)
    metrics: dict[str, float] = {"sync/weight_version": float(version)}
    if probe:
        prompts = [t.prompt_ids for t in probe]
        samples = ctx.run_async(probe_samples(ctx.client, prompts, max_new_tokens=cfg.rollout.segment_tokens,
                                              temperature=cfg.rollout.temperature))
        metrics["sync/logprob_gap"] = ctx.learners.logprob_gap(samples)
        # The probe's KV must not make the next step's cache state differ from a resumed run's.
        ctx.run_async(ctx.client.flush_cache())
    return metrics


def evaluate(ctx: RunContext, problems: list[dict]) -> dict[str, float]:
    """``eval/*`` metrics (pass@k, maj@k, accuracy, length; tool calls with an agent) on
    ``problems``: :mod:`arbor.evaluate`."""
    from arbor.evaluate import run_eval

    cfg, tokenizer = ctx.cfg, ctx.tokenizer
    problems = problems[: cfg.eval.max_problems or None]
    prompts, render = episode_inputs(problems, ctx.agent, tokenizer, cfg.data, cfg.model.chat_template)

    def decode(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=True)

    report = run_eval(
        ctx.client, ctx.rewards, problems, prompts, cfg.eval, cfg.rollout, decode=decode,
        eos_token_ids=ctx.eos_token_ids, seed=cfg.run.seed, run_async=ctx.run_async, status=ctx.log.status,
        agent=ctx.agent, render=render,
    )
    # As after the probe: the next step starts from the cache state a resumed run has.
    ctx.run_async(ctx.client.flush_cache())
    return report.metrics


def rollout_metrics(batch: Batch) -> dict[str, float]:
    """Reward, response, tree and rollout-cost metrics of everything sampled this step."""
    leaves = [leaf for tree in batch.sampled for leaf in tree.leaves()]
    rewards = [leaf.reward for leaf in leaves]
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
        "rollout/tokens_generated": float(sum(s.tokens_generated for s in batch.stats)),
        "rollout/tokens_computed": float(computed),
        "rollout/cached_ratio": sum(s.cached_tokens for s in batch.stats) / max(prompt, 1),
        "train/tokens_saved": float(sum(s.linearised_tokens - s.unique_tokens for s in trained)),
        # Multi-turn episodes (rollout.agent): tool turns on each trajectory's path, errors.
        "agent/tool_calls_per_episode": sum(tool_turns(tree, leaf) for tree in batch.sampled for leaf in tree.leaves()) / n,
        "agent/tool_errors": float(sum(s.tool_errors for s in batch.stats)),
        "agent/timeouts": float(sum(s.agent_timeouts for s in batch.stats)),  # steps past rollout.agent_timeout_s
    }
