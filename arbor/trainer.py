"""``arbor train CONFIG``: the RL loop. It knows the order of the phases, nothing of their insides.

    problems → tree rollouts → rewards → dynamic sampling → advantages → packs →
    learner update → weight sync → metrics → periodic eval, trees and checkpoint

:class:`RunContext` starts and stops everything the phases use (Ray, learner ranks,
engines, the reward pool, TensorBoard); :mod:`arbor.phases` holds the phases.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Callable, Coroutine, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from arbor import checkpoint, phases
from arbor.agents import fitting_problems, rollout_agent
from arbor.config import Config, save_config
from arbor.data import ProblemStream, load_problems, stop_token_ids
from arbor.engine_recovery import EngineFailedError, EngineRecovery
from arbor.metrics import MetricsLog
from arbor.orchestration import LearnerFailedError, closing
from arbor.rewards import RewardFailureError

T = TypeVar("T")


def train(cfg: Config, after_step: Callable[[RunContext, int, dict], None] | None = None) -> list[dict[str, float]]:
    """Run (or resume) ``cfg``; returns the metrics of the steps this call ran.

    ``after_step(ctx, step, metrics)`` is called after each step (notebooks, tests).
    """
    history = []
    with RunContext(cfg) as ctx:
        if ctx.start_step == 0 and cfg.run.eval_every and ctx.eval_problems:
            with ctx.log.phase("eval"):  # where the policy starts
                start = phases.evaluate(ctx, ctx.eval_problems)
            ctx.log.write(0, start)
        for step in range(ctx.start_step + 1, cfg.run.steps + 1):
            batch = phases.collect_rollouts(ctx, step)  # times its "rollout" and "reward" phases
            metrics = phases.rollout_metrics(batch)
            if batch.trees:  # else every prompt's leaves scored the same: nothing to learn
                with ctx.log.phase("advantage"):
                    advantages = phases.batch_advantages(batch.trees, cfg.algorithm)
                with ctx.log.phase("train"), ctx.engines_released():
                    metrics |= phases.train_on_batch(ctx, batch.trees, advantages, step)
                with ctx.log.phase("sync"):
                    metrics |= phases.sync_weights(ctx, str(step), probe=batch.trees[:2])
            if cfg.run.eval_every and step % cfg.run.eval_every == 0 and ctx.eval_problems:
                with ctx.log.phase("eval"):
                    metrics |= phases.evaluate(ctx, ctx.eval_problems)
            metrics |= ctx.recovery.step_metrics()  # engine/restarts
            history.append(ctx.log.write(step, metrics | ctx.throughput(batch) | ctx.data_metrics))
            if after_step is not None:
                after_step(ctx, step, history[-1])
            if cfg.run.save_trees_every and step % cfg.run.save_trees_every == 0:
                ctx.save_trees(step, batch.trees + [t for t in batch.sampled if t not in batch.trees])
            if step == cfg.run.steps or (cfg.run.save_every and step % cfg.run.save_every == 0):
                ctx.save_checkpoint(step)
        ctx.export_hf()
    return history


@dataclass
class RunContext:
    """Everything one run holds: config, data, engines, learners, rewards, metrics."""

    cfg: Config
    start_step: int = 0
    schedule_steps: int = 0  # run.steps the LR schedule spans (kept from the first run on resume)
    eval_problems: list[dict] = field(default_factory=list)
    data_metrics: dict[str, float] = field(default_factory=dict)  # problems skipped at start-up
    _closers: list[Any] = field(default_factory=list)

    def __enter__(self) -> RunContext:
        from transformers import AutoTokenizer

        from arbor.engines.client import SGLangClient
        from arbor.orchestration import EngineGroup, LearnerGroup, Placement, start_ray
        from arbor.plugins import default_search_dirs
        from arbor.rewards import RewardPool, RewardTerm

        cfg = self.cfg
        out = Path(cfg.run.output_dir)
        previous = checkpoint.latest_checkpoint(out)
        if previous is not None and not cfg.run.resume:
            raise SystemExit(
                f"arbor train: {out} already holds a run (checkpoint {previous.name}); set "
                "run.resume=true to continue it, or choose another run.output_dir"
            )
        out.mkdir(parents=True, exist_ok=True)
        save_config(cfg, out / "config.yaml")
        try:
            search = default_search_dirs(cfg.source)  # where rewards/ and agents/ specs resolve
            self.tokenizer = AutoTokenizer.from_pretrained(cfg.model.path, trust_remote_code=cfg.model.trust_remote_code)
            self.eos_token_ids = stop_token_ids(self.tokenizer, cfg.model.path, cfg.model.trust_remote_code)
            self.agent = rollout_agent(cfg.rollout, search)  # multi-turn episodes, or None
            problems = self.fitting(load_problems(cfg.data.train_path, cfg.data), "data.train_path", "data/skipped_long_prompts")
            self.stream = ProblemStream(problems, cfg.run.seed, cfg.data.shuffle)
            eval_path = cfg.eval.path or cfg.data.eval_path
            if eval_path and cfg.run.eval_every:
                self.eval_problems = self.fitting(load_problems(eval_path, cfg.data), "eval.path" if cfg.eval.path else "data.eval_path",
                                                  "data/skipped_long_eval_prompts")
            self.log = MetricsLog(cfg.run, cfg.run.steps)
            self._closers.append(self.log.close)
            self.rewards = RewardPool([RewardTerm(t.fn, t.weight) for t in cfg.reward.functions],
                                      workers=cfg.reward.workers, timeout_s=cfg.reward.timeout_s, search_dirs=search)
            self._closers.append(self.rewards.close)
            self.log.status("starting Ray, engines and learner ranks…")
            start_ray(cfg.ray, needs_cpus=cfg.learner.num_ranks + cfg.engine.num_engines)
            self.placement = Placement(cfg)
            self._closers.append(self.placement.remove)
            self.engines = EngineGroup(cfg, self.placement, str(out / "logs"))
            self._closers.append(self.engines.shutdown)
            self.client = SGLangClient(self.engines.urls, timeout_s=cfg.engine.request_timeout_s,
                                       max_retries=cfg.engine.max_retries, api_key=cfg.engine.api_key)
            # A resumed run keeps the schedule's original horizon (README: run.resume).
            self.schedule_steps = cfg.run.steps if previous is None else checkpoint.schedule_horizon(previous, cfg.run.steps)
            if self.schedule_steps != cfg.run.steps and cfg.optim.schedule != "constant":
                print(f"arbor train: run.steps is {cfg.run.steps}, but the {cfg.optim.schedule} learning-rate schedule "
                      f"keeps the horizon of {self.schedule_steps} steps it started with (past it: optim.min_lr_ratio)")
            self.learners = LearnerGroup(cfg, self.placement, total_steps=self.schedule_steps * self.updates_per_step())
            self._closers.append(self.learners.shutdown)
            # A server that dies mid-step is restarted with the run's weights; its requests are sent again.
            self.recovery = EngineRecovery(self.engines, self.learners, cfg.engine.max_restarts,
                                           cfg.learner.weight_sync, cfg.run.output_dir)
            self.client.recover = self.recovery.recover
            if previous is not None:
                self.resume(previous)
            elif cfg.run.resume:
                print(f"arbor train: run.resume=true but {out} has no checkpoint yet: starting at step 1")
            le = cfg.learner
            print(
                f"arbor train: {cfg.run.name}, steps {self.start_step + 1}..{cfg.run.steps} -> {out}; "
                f"engines {', '.join(self.engines.urls)}; {le.num_ranks} learner rank(s), "
                + (f"DeepSpeed ZeRO-{le.zero_stage}" if le.backend == "deepspeed" else "plain torch"),
                flush=True,
            )
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        while self._closers:
            try:
                self._closers.pop()()
            except Exception as e:  # keep closing the rest
                print(f"arbor train: while shutting down: {e!r}", file=sys.stderr)

    def fitting(self, problems: list[dict], source: str, metric: str) -> list[dict]:
        """The problems whose prompt fits data.max_prompt_tokens; the others are counted in ``metric``."""
        kept, skipped = fitting_problems(problems, self.agent, self.tokenizer, self.cfg.data,
                                         self.cfg.model.chat_template, source)
        self.data_metrics[metric] = float(len(skipped))
        return kept

    def run_async(self, coroutine: Coroutine[Any, Any, T]) -> T:
        """Run a coroutine on the engine client from this synchronous loop."""
        return asyncio.run(closing(self.client, coroutine))

    @contextmanager
    def engines_released(self) -> Iterator[None]:
        """With ``ray.colocate``, the engines free their memory while the learners train."""
        if not self.cfg.ray.colocate:
            yield
            return
        self.run_async(self.client.release_memory_occupation())
        try:
            yield
        finally:
            self.run_async(self.client.resume_memory_occupation())

    def updates_per_step(self) -> int:
        return self.cfg.algorithm.ppo_epochs * self.cfg.algorithm.minibatches

    def output_dir(self, name: str) -> str:
        return str(Path(self.cfg.run.output_dir) / name)

    def throughput(self, batch: phases.Batch) -> dict[str, float]:
        seconds = sum(self.log.phases.values()) or 1e-9
        leaves = sum(len(t.leaves()) for t in batch.sampled)
        tokens = sum(s.tokens_generated for s in batch.stats)
        return {"throughput/trajectories_per_s": leaves / seconds, "throughput/tokens_per_s": tokens / seconds}

    def save_trees(self, step: int, trees: list) -> None:
        """A few trees of the step as JSON lines, for ``arbor view`` (trained ones first: their
        leaves disagree, which is what is worth looking at)."""
        path = Path(self.output_dir("trees")) / f"step-{step:06d}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(t.to_json() + "\n" for t in trees[:4]))

    def save_checkpoint(self, step: int) -> None:
        self.log.status(f"saving checkpoint of step {step}…")
        directory = checkpoint.step_dir(self.cfg.run.output_dir, step)
        self.learners.save(str(directory / "learner"))
        checkpoint.write_driver_state(directory, {"step": step, "stream": self.stream.state_dict(),
                                                  "schedule_steps": self.schedule_steps})
        checkpoint.mark_latest(self.cfg.run.output_dir, step, keep=self.cfg.run.keep_checkpoints)

    def resume(self, directory: Path) -> None:
        """Continue from a checkpoint: learner state, data cursor, RNG, engine weights."""
        state = checkpoint.read_driver_state(directory)
        self.learners.load(str(directory / "learner"))
        self.stream.load_state_dict(state["stream"])
        self.start_step = int(state["step"])
        self.learners.push_weights(self.engines.urls, str(self.start_step))
        self.run_async(self.client.flush_cache())
        print(f"arbor train: resumed from {directory} (step {self.start_step})", flush=True)

    def export_hf(self) -> None:
        """The final policy as an HF directory (safetensors + tokenizer): ``<output_dir>/hf``."""
        self.log.status("exporting the policy…")
        self.learners.export_hf(self.output_dir("hf"))


def main(cfg: Config) -> int:
    try:
        history = train(cfg)
    except (EngineFailedError, LearnerFailedError, RewardFailureError) as e:  # the message says what broke and how to go on
        print(f"arbor train: stopped: {e}", file=sys.stderr)
        return 1
    if history:
        last = history[-1]
        summary = {k: round(last[k], 4) for k in ("reward/mean", "reward/accuracy") if k in last}
        print(f"arbor train: done; output in {cfg.run.output_dir}; last step {json.dumps(summary)}")
    return 0
