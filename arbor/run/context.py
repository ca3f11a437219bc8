"""The pieces one ``arbor train`` run holds, declared in one record, and their start and stop.

    with start_run(cfg) as ctx:          # Ray, engines, learner ranks, reward pool, TensorBoard
        batch = phases.collect_rollouts(ctx.sampling, ctx.rewards, ctx.stream, ctx.log, ctx.cfg, step)
        ctx.save_checkpoint(step)
    # everything started is stopped again, in reverse order, also after an error

:func:`start_run` begins with the start-up every command shares
(:func:`arbor.run.startup.start_command`: the settled config, written to the output directory;
a used directory refused unless ``run.resume``; the tokenizer), loads the problems and
resumes from the latest checkpoint. The phases (:mod:`arbor.run.phases`) never see this
record: the trainer hands each the pieces it uses.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Coroutine, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from arbor.config import Config, config_to_dict
from arbor.data import ProblemStream, load_problems, used_columns
from arbor.engines.client import SGLangClient
from arbor.engines.connect import engine_client
from arbor.rollout.agents import Agent, fitting_problems
from arbor.rollout.environments import require_reward, rollout_env
from arbor.rollout.programs import load_program, model_name
from arbor.rollout.rewards import RewardPool, reward_pool
from arbor.run import checkpoint
from arbor.run.engine_group import EngineGroup
from arbor.run.learner_group import LearnerGroup
from arbor.run.metrics import MetricsLog
from arbor.run.nodes import mark_output_dir, with_absolute_paths
from arbor.run.orchestration import Placement, ray_cpus, start_groups, start_ray
from arbor.run.phases import Sampling
from arbor.run.recovery import EngineRecovery, RecoveringEngine
from arbor.run.startup import StartupClock, problem_files, start_command
from arbor.run.teacher import Teacher
from arbor.run.weight_sync import EngineWeights

T = TypeVar("T")


@dataclass
class RunContext:
    """Everything one run holds: config, data, engines, learners, rewards, metrics."""

    cfg: Config  # settled (arbor.run.startup.settled): what this run runs with, as config.yaml holds it
    sampling: Sampling  # the run's engines with the tokenizer, environment and prompt format
    stream: ProblemStream  # training problems, batch after batch (its cursor is checkpointed)
    eval_problems: list[dict]  # eval.path (or data.eval_path) when run.eval_every; else empty
    data_metrics: dict[str, float]  # problems skipped at start-up (data/skipped_long_prompts, ...)
    log: MetricsLog
    rewards: RewardPool
    placement: Placement
    engines: EngineGroup
    learners: LearnerGroup
    weights: EngineWeights  # the weights the engines serve: pushes, restores, the adapter name
    recovery: EngineRecovery  # restarts a dead engine with the run's weights
    schedule_steps: int  # run.steps the LR schedule spans (kept from the first run on resume)
    startup: StartupClock  # seconds per start-up phase (printed once everything is up)
    # algorithm.distill's teacher engines (arbor.run.teacher); None: the run does not distil.
    teacher: Teacher | None = None
    start_step: int = 0  # the last step done before this process started (0: a fresh run)
    checkpoint_cleanup_failures: int = 0  # old checkpoints that could not be removed, so far

    @property
    def client(self) -> SGLangClient:
        """The trainer's HTTP client of the engines (control calls; rollouts go through ``sampling.engine``)."""
        return self.sampling.engine.client

    def run_async(self, coroutine: Coroutine[Any, Any, T]) -> T:
        """Run a coroutine on the engine client from this synchronous loop."""
        return self.sampling.run(coroutine)

    @contextmanager
    def engines_released(self) -> Iterator[None]:
        """With ``ray.colocate``, the engines free their memory while the learners train; an
        asynchronous run's engines keep sampling meanwhile, so they keep it (both must fit)."""
        if not self.cfg.ray.colocate or self.cfg.algorithm.max_staleness:
            yield
            return
        self.run_async(self.client.release_memory_occupation())
        try:
            yield
        finally:
            self.run_async(self.client.resume_memory_occupation())

    def output_dir(self, name: str) -> str:
        return str(Path(self.cfg.run.output_dir) / name)

    def save_trees(self, step: int, trees: list) -> None:
        """A few trees of the step as JSON lines, for ``arbor view`` (trained ones first: their
        leaves disagree, which is what is worth looking at)."""
        path = Path(self.output_dir("trees")) / f"step-{step:06d}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(t.to_json() + "\n" for t in trees[:4]))

    def save_checkpoint(self, step: int, stream_state: dict[str, int] | None = None) -> None:
        """Learner state, problem cursor (``stream_state``, default the stream's own: an
        asynchronous run gives the cursor before its first untrained batch) and step."""
        self.log.status(f"saving checkpoint of step {step}…")
        directory = checkpoint.step_dir(self.cfg.run.output_dir, step)
        self.learners.save(str(directory / "learner"))
        stream_state = self.stream.state_dict() if stream_state is None else stream_state
        checkpoint.write_driver_state(directory, {"step": step, "stream": stream_state,
                                                  "schedule_steps": self.schedule_steps})
        failed = checkpoint.mark_latest(self.cfg.run.output_dir, step, keep=self.cfg.run.keep_checkpoints)
        self.checkpoint_cleanup_failures += len(failed)

    def resume(self, directory: Path) -> None:
        """Continue from a checkpoint: learner state, data cursor, RNG, engine weights."""
        state = checkpoint.read_driver_state(directory)
        self.learners.load(str(directory / "learner"))
        self.stream.load_state_dict(state["stream"])
        self.start_step = int(state["step"])
        self.weights.push(str(self.start_step))
        print(f"arbor train: resumed from {directory} (step {self.start_step})", flush=True)

    def export_hf(self) -> None:
        """The final policy as an HF directory (safetensors + tokenizer): ``<output_dir>/hf``."""
        self.log.status("exporting the policy…")
        self.learners.export_hf(self.output_dir("hf"))


def updates_per_step(cfg: Config) -> int:
    """Optimizer updates of one RL step: ``algorithm.ppo_epochs`` × ``algorithm.minibatches``."""
    return cfg.algorithm.ppo_epochs * cfg.algorithm.minibatches


@contextmanager
def start_run(cfg: Config, clock: StartupClock | None = None) -> Iterator[RunContext]:
    """Start everything ``cfg`` runs on, yield it as a :class:`RunContext`, stop it all after.

    ``clock`` times the start-up phases (default: one started now); ``ctx.startup`` holds it.
    """
    closers: list[Callable[[], Any]] = []  # stopped in reverse order
    try:
        ctx = _start(cfg, closers, clock or StartupClock())
    except BaseException:
        _close(closers)
        raise
    try:
        yield ctx
    finally:
        _close(closers)


def _start(cfg: Config, closers: list[Callable[[], Any]], clock: StartupClock) -> RunContext:
    from arbor.plugins import default_search_dirs

    started = start_command(cfg, "train", clock)
    cfg, tokenizer, eos_token_ids, previous = started.cfg, started.tokenizer, started.stop_ids, started.previous
    out = Path(cfg.run.output_dir)
    # Actors on other nodes read the paths as the driver resolves them, and check they see them.
    cfg = with_absolute_paths(cfg)
    output_token = mark_output_dir(cfg.run.output_dir)
    search = default_search_dirs(cfg.source)  # where rewards/ and agents/ specs resolve
    env = rollout_env(cfg.rollout, search)  # multi-turn episodes (rollout.env, or rollout.agent), or None
    program = load_program(cfg.rollout, search)  # agent programs (rollout.program / program_command), or None
    if program is None:
        require_reward(env, cfg.reward)
    with clock.phase("data"):
        stream, eval_problems, data_metrics = _load_problems(cfg, None if env is None else env.agent, tokenizer,
                                                             skip_check=(env is not None and env.agent is None) or program is not None)
    with clock.phase("metrics"):
        log = MetricsLog(cfg.run, cfg.run.steps, config=config_to_dict(cfg))  # the settled config
        closers.append(log.close)
    with clock.phase("rewards"):
        rewards = reward_pool(cfg.reward, search)
        closers.append(rewards.close)
    log.status("starting Ray, engines and learner ranks…")
    with clock.phase("ray"):
        start_ray(cfg.ray, needs_cpus=ray_cpus(cfg))
    with clock.phase("placement"):
        placement = Placement(cfg)
        closers.append(placement.remove)
    # A resumed run keeps the schedule's original horizon (docs/scale.md, Resume).
    schedule_steps = cfg.run.steps if previous is None else checkpoint.schedule_horizon(previous, cfg.run.steps)
    if schedule_steps != cfg.run.steps and cfg.optim.schedule != "constant":
        print(f"arbor train: run.steps is {cfg.run.steps}, but the {cfg.optim.schedule} learning-rate schedule "
              f"keeps the horizon of {schedule_steps} steps it started with (past it: optim.min_lr_ratio)")
    # Engines and learner ranks start together (model load and DeepSpeed init overlap); both
    # are stopped when either fails.
    clock.begin("engines")
    engines = EngineGroup(cfg, placement, str(out.resolve() / "logs"), wait=False, output_token=output_token)
    closers.append(engines.shutdown)
    clock.begin("learners")
    learners = LearnerGroup(cfg, placement, total_steps=schedule_steps * updates_per_step(cfg), wait=False,
                            output_token=output_token)
    closers.append(learners.shutdown)
    teacher = None
    if cfg.algorithm.distill.enabled:  # its engines start beside the policy's, on bundles of their own
        teacher = Teacher(cfg, placement, str(out.resolve() / "logs"), output_token)
        closers.append(teacher.shutdown)
    start_groups(engines, learners, clock)
    if teacher is not None:
        with clock.phase("teacher"):
            teacher.wait_started()
    # A server that dies mid-step is restarted with the run's weights; its requests are sent again.
    weights = EngineWeights(cfg, learners, engines.urls)
    recovery = EngineRecovery(engines, weights, cfg.engine, cfg.run.output_dir)
    engine = RecoveringEngine(engine_client(cfg.engine, engines.urls), recovery, weights)
    ctx = RunContext(
        cfg=cfg, sampling=Sampling(engine, tokenizer, env, eos_token_ids, cfg.data, cfg.model.chat_template,
                                   env_weight=cfg.reward.env_weight, env_reward_only=not cfg.reward.functions,
                                   program=program, model_name=model_name(cfg)),
        stream=stream, eval_problems=eval_problems, data_metrics=data_metrics, log=log, rewards=rewards,
        placement=placement, engines=engines, learners=learners, weights=weights, recovery=recovery,
        schedule_steps=schedule_steps, startup=clock, teacher=teacher,
    )
    if previous is not None:
        with clock.phase("resume"):
            ctx.resume(previous)
    elif cfg.run.resume:
        print(f"arbor train: run.resume=true but {out} has no checkpoint yet: starting at step 1")
    le = cfg.learner
    print(
        f"arbor train: {cfg.run.name}, steps {ctx.start_step + 1}..{cfg.run.steps} -> {out}; "
        f"engines {', '.join(engines.urls)}; {le.num_ranks} learner rank(s) on {learners.node_addresses()}, "
        + (f"DeepSpeed ZeRO-{le.zero_stage}" if le.backend == "deepspeed" else "plain torch")
        + f"; {clock.summary()}",
        flush=True,
    )
    return ctx


def _load_problems(
    cfg: Config, agent: Agent | None, tokenizer: Any, skip_check: bool = False,
) -> tuple[ProblemStream, list[dict], dict[str, float]]:
    """The training stream, the eval problems (``eval.path`` or ``data.eval_path``, when
    ``run.eval_every``) and the start-up's data metrics: problems whose prompt does not fit
    ``data.max_prompt_tokens`` are skipped, never cut, and counted. ``skip_check``: an
    environment's prompts are its reset's, known only when an episode starts (checked then)."""
    data_metrics: dict[str, float] = {}

    def fitting(problems: list[dict], source: str, metric: str) -> list[dict]:
        if skip_check:
            return problems
        kept, skipped = fitting_problems(problems, agent, tokenizer, cfg.data, cfg.model.chat_template, source)
        data_metrics[metric] = float(len(skipped))
        return kept

    files = problem_files(cfg, "train")  # data.train_path, and the eval set when the run evaluates
    columns = used_columns(cfg.rollout.env, len(cfg.reward.functions))  # an environment may write the prompt
    problems = fitting(load_problems(files.pop("data.train_path"), cfg.data, "data.train_path", columns),
                       "data.train_path", "data/skipped_long_prompts")
    stream = ProblemStream(problems, cfg.run.seed, cfg.data.shuffle)
    eval_problems: list[dict] = []
    for key, path in files.items():
        eval_problems = fitting(load_problems(path, cfg.data, key, columns), key, "data/skipped_long_eval_prompts")
    return stream, eval_problems, data_metrics


def _close(closers: list[Callable[[], Any]]) -> None:
    while closers:
        try:
            closers.pop()()
        except Exception as e:  # keep closing the rest
            print(f"arbor train: while shutting down: {e!r}", file=sys.stderr)
