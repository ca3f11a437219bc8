"""``arbor train CONFIG``: the RL loop. It knows the order of the phases, nothing of their insides.

    problems → tree rollouts → rewards → dynamic sampling → advantages → packs →
    learner update → weight sync → metrics → periodic eval, trees and checkpoint

:func:`arbor.run.context.start_run` starts and stops everything the phases use (Ray,
learner ranks, engines, the reward pool, TensorBoard); :mod:`arbor.run.phases` holds the
phases, each handed the pieces it uses.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable

from arbor.config import Config
from arbor.run import phases
from arbor.run.async_rollouts import busy_metrics, producer_for
from arbor.run.context import RunContext, start_run
from arbor.run.step_report import EmptySteps, dropped_summary
from arbor.train.dfs import pack_budget


def train(cfg: Config, after_step: Callable[[RunContext, int, dict], None] | None = None) -> list[dict[str, float]]:
    """Run (or resume) ``cfg``; returns the metrics of the steps this call ran.

    ``after_step(ctx, step, metrics)`` is called after each step (notebooks, tests). With
    ``algorithm.max_staleness`` ≥ 1 a producer thread samples ahead (:mod:`arbor.run.async_rollouts`)
    and the loss is the decoupled off-policy objective (``loss.behaviour_cap``, or the treatment
    ``loss.rollout_correction`` chooses for the same weight: docs/rollout-correction.md).
    """
    history = []
    with start_run(cfg) as ctx, producer_for(ctx.cfg, ctx.sampling, ctx.rewards, ctx.stream,
                                             ctx.start_step + 1) as producer:
        cfg = ctx.cfg  # settled: what this run runs with (arbor.run.startup.start_command)

        def evaluate() -> dict[str, float]:
            with ctx.log.phase(phases.EVAL_PHASE):
                return phases.evaluate(ctx.sampling, ctx.rewards, ctx.eval_problems, cfg.eval, cfg.rollout,
                                       cfg.run.seed, ctx.log.status)

        if ctx.start_step == 0 and cfg.run.eval_every and ctx.eval_problems:
            ctx.log.write(0, evaluate())  # where the policy starts
        behaviour_cap = cfg.loss.behaviour_cap if producer else None  # None: on-policy PPO
        empty = EmptySteps(cfg.run.max_empty_steps)
        pack_tokens = pack_budget(cfg.learner.tree_execution, cfg.learner.pack_tokens)  # dfs: whole trees
        for step in range(ctx.start_step + 1, cfg.run.steps + 1):
            started = time.perf_counter()
            if producer is None:
                # times its "rollout" and "reward" phases
                batch = phases.collect_rollouts(ctx.sampling, ctx.rewards, ctx.stream, ctx.log, cfg, step)
                metrics = phases.rollout_metrics(batch)
            else:  # sampled while the last steps trained; trees over the staleness bound dropped
                with ctx.log.phase("wait"):
                    taken = producer.take(step)
                batch, metrics = taken.batch, phases.rollout_metrics(taken.batch) | taken.metrics
            dropped = dropped_summary(batch, metrics.get("async/dropped", 0.0), cfg)
            counts, said = empty.update(batch, dropped)  # trained nothing, not by dynamic sampling: said
            metrics |= counts
            if said or dropped:
                ctx.log.note(step, said or dropped)
            if batch.trees:  # else every prompt's leaves scored the same: nothing to learn
                if ctx.teacher is not None:  # distillation: the teacher scores each tree node by node
                    with ctx.log.phase("teacher"):
                        metrics |= ctx.teacher.score(batch.trees, cfg.rollout.temperature, cfg.algorithm.distill.kind)
                with ctx.log.phase("advantage"):
                    advantages = phases.batch_advantages(batch.trees, cfg.algorithm)
                with ctx.weights.changing():  # a restarted engine waits for the push (arbor.run.weight_sync)
                    with ctx.log.phase("train"), ctx.engines_released():
                        metrics |= phases.train_on_batch(ctx.learners, batch.trees, advantages, step, cfg.algorithm,
                                                         cfg.loss, pack_tokens=pack_tokens,
                                                         seed=cfg.run.seed, behaviour_cap=behaviour_cap)
                    with ctx.log.phase("sync"):
                        metrics |= phases.push_weights(ctx.weights, ctx.recovery, str(step))
                if probe_due(step, cfg.run.sync_probe_every, producer is not None, first=ctx.start_step + 1):
                    with ctx.log.phase("sync"):
                        metrics |= phases.probe_weights(ctx.learners, ctx.sampling, cfg.rollout,
                                                        probe=batch.trees[:2], flush=producer is None)
            if producer is not None:
                producer.step_done(step, pushed=bool(batch.trees))  # the next batch may start sampling
            if cfg.run.eval_every and step % cfg.run.eval_every == 0 and ctx.eval_problems:
                metrics |= evaluate()
            metrics |= ctx.recovery.step_metrics()  # engine/restarts
            metrics["run/checkpoint_cleanup_failures"] = float(ctx.checkpoint_cleanup_failures)  # so far
            # Neither counts the periodic eval: throughput is the training's.
            metrics |= phases.throughput_metrics(batch, ctx.log.phases)
            engine_s = producer.engine_seconds() if producer else ctx.log.phases.get("rollout", 0.0)
            wall_s = time.perf_counter() - started - ctx.log.phases.get(phases.EVAL_PHASE, 0.0)
            metrics |= busy_metrics(engine_s, ctx.log.phases.get("train", 0.0), wall_s)
            history.append(ctx.log.write(step, metrics | ctx.data_metrics))
            if after_step is not None:
                after_step(ctx, step, history[-1])
            empty.check(step)  # run.max_empty_steps in a row: stops, the step's metrics written
            if cfg.run.save_trees_every and step % cfg.run.save_trees_every == 0:
                ctx.save_trees(step, batch.trees + [t for t in batch.sampled if t not in batch.trees])
            if step == cfg.run.steps or (cfg.run.save_every and step % cfg.run.save_every == 0):
                # An asynchronous run keeps no samples in flight: their problems come again on resume.
                ctx.save_checkpoint(step, stream_state=producer.stream_state(step + 1) if producer else None)
        ctx.export_hf()
    return history


def probe_due(step: int, every: int | None, asynchronous: bool, first: int = 1) -> bool:
    """Whether ``step`` runs the weight-sync probe (``run.sync_probe_every``; None: 1 when
    synchronous, 10 when asynchronous). The run's ``first`` step always does (a push that
    never reaches the engines shows at once), unless ``every`` is 0.

    >>> [s for s in range(1, 25) if probe_due(s, None, True)], [s for s in range(31, 42) if probe_due(s, 5, True, 31)]
    ([1, 10, 20], [31, 35, 40])
    >>> probe_due(3, None, False), probe_due(1, 0, False)
    (True, False)
    """
    if every is None:
        every = 10 if asynchronous else 1
    return every > 0 and (step == first or step % every == 0)


def main(cfg: Config) -> int:
    """``arbor train``: an error that stops the run (:class:`arbor.errors.RunStopped`) goes up to the
    command line, which prints it as one line and keeps its traceback in the run's ``arbor.log``."""
    history = train(cfg)
    if history:
        last = history[-1]
        summary = {k: round(last[k], 4) for k in ("reward/mean", "reward/accuracy") if k in last}
        print(f"arbor train: done; output in {cfg.run.output_dir}; last step {json.dumps(summary)}")
    return 0
