"""``arbor eval CONFIG``: pass@k, maj@k and response length of a model on a jsonl set.

    arbor eval configs/quickstart.yaml                                  # greedy accuracy
    arbor eval configs/quickstart.yaml eval.samples=8 eval.temperature=1.0 \\
        model.path=runs/quickstart/hf eval.output=runs/quickstart/eval-hf.json

It starts the engine(s) of ``engine``/``model`` (no Ray), samples ``eval.samples`` answers
per problem of ``eval.path`` (default ``data.eval_path``), scores them with
``reward.functions``, prints a summary and writes ``<run.output_dir>/eval.json`` (metrics
plus one record per problem) and, with ``tensorboard`` in ``run.loggers``, TensorBoard
scalars under ``<run.output_dir>/tensorboard/eval`` (W&B and MLflow get a training run's
``eval/*`` metrics, not ``arbor eval``'s). The trainer calls :func:`run_eval` every
``run.eval_every`` steps (``arbor.run.phases.evaluate``) and logs the same ``eval/*`` metrics.

In code, with any :class:`~arbor.engines.types.RolloutEngine` and a reward pool:

    report = run_eval(engine, rewards, problems, prompts, cfg.eval, cfg.rollout, decode=decode)
    report.metrics["eval/pass@4"], report.problems[0].majority

Definitions (n = k = ``eval.samples`` answers per problem, c of them correct):
- a sample is **correct** when the first reward term scores it > 0 (as in training);
- ``eval/accuracy``: mean correctness over all samples (= the unbiased pass@1);
- ``eval/pass@k``: mean over problems of 1 − C(n−c, k)/C(n, k), which with n = k is the
  fraction of problems with at least one correct sample;
- ``eval/maj@k``: fraction of problems whose majority answer is correct. A sample's answer
  is its last ``\\boxed{}`` with whitespace and enclosing ``$`` removed (samples without one
  do not vote); the most frequent answer wins, ties go to the answer given first, and it
  counts as correct when the first sample giving it is correct. Answers are compared as
  strings: ``0.5`` and ``\\frac12`` vote apart even though the reward accepts both;
- ``eval/length_mean`` / ``eval/length_max``: response tokens per sample (EOS included);
- ``eval/finished``: samples that ended on EOS; ``eval/answered``: samples with an answer.

With ``rollout.env`` (or ``rollout.agent``) every sample is one multi-turn episode, run to
its end as in the trainer's ``mode: independent`` (one path each; ``eval.max_response_tokens``
bounds the whole episode, tool turns included). The scored text is the episode's whole
response, decoded — what the reward sees in training — plus ``reward.env_weight`` × the
environment's reward, and the report adds ``eval/tool_calls_per_episode``,
``eval/tool_errors`` and ``eval/agent_timeouts`` (with ``rollout.env``: ``eval/env_timeouts``,
``eval/env_errors``).

With ``rollout.program`` (or ``rollout.program_command``) every sample is one run of the agent
program from its first call (no forks), sampled at ``eval.temperature``; the scored text is the
run's last answer's path, and the program's returned reward is added as an environment's.
Runs that fail are counted in ``eval/failures`` (``eval/program_errors``, ``eval/program_timeouts``).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
import sys
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Protocol

from arbor.config import Config, EvalConfig, RolloutConfig
from arbor.engines.types import RolloutEngine
from arbor.rollout.agents import Agent, Render, tool_turns
from arbor.rollout.answers import final_boxes
from arbor.rollout.episodes import EpisodeSetup
from arbor.rollout.programs import ProgramSampler
from arbor.rollout.rewards import Item, ScoreResult
from arbor.rollout.sampler import sample_trees
from arbor.tree import RolloutTree


class Scorer(Protocol):
    """What scoring needs: :class:`arbor.rollout.rewards.RewardPool` is one."""

    def score(self, items: Sequence[Item], on_progress: Callable[[int, int], None] | None = None) -> ScoreResult: ...


@dataclass
class SampleRecord:
    """One answer to a problem."""

    response: str
    answer: str | None  # normalised last \boxed{} content; None: no (well-formed) box
    reward: float  # Σ weight · term (+ reward.env_weight × the environment's reward)
    correct: bool  # first reward term > 0 (no reward functions: reward > 0)
    tokens: int  # response length (an agent's tool turns included)
    finish_reason: str  # "stop" (EOS) | "max_length" | "repetition" | "abort" | "agent_timeout"
    tool_calls: int  # agent turns in the episode; 0 without an agent


@dataclass
class ProblemRecord:
    """A problem's samples and its verdicts."""

    id: str
    gold: Any
    samples: list[SampleRecord]
    correct: int  # c: correct samples
    pass_at_k: float  # 1 − C(n−c, k)/C(n, k)
    majority: str | None  # the winning answer; None when no sample has one
    majority_correct: bool


@dataclass
class EvalReport:
    k: int
    metrics: dict[str, float]  # eval/accuracy, eval/pass@k, eval/maj@k, eval/length_mean, ...
    problems: list[ProblemRecord]

    def to_dict(self) -> dict[str, Any]:
        return {"k": self.k, "metrics": self.metrics, "problems": [asdict(p) for p in self.problems]}


# -- the metrics: pure functions ----------------------------------------------------------


def pass_at_k(n: int, c: int, k: int) -> float:
    """Chance that k of the n samples, drawn without replacement, hold a correct one.

    The unbiased estimator 1 − C(n−c, k)/C(n, k) (Chen et al., 2021):
    ``pass_at_k(3, 1, 3) == 1.0``, ``pass_at_k(4, 1, 1) == 0.25``, ``pass_at_k(4, 1, 2) == 0.5``.
    """
    if not 1 <= k <= n or not 0 <= c <= n:
        raise ValueError(f"pass@k needs 1 ≤ k ≤ n and 0 ≤ c ≤ n, got n={n}, c={c}, k={k}")
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def normalise_answer(completion: str) -> str | None:
    """The completion's final answer for voting, as the reward reads it, no whitespace or ``$``.

    The final run of boxes (``arbor.rollout.answers.final_boxes``, joined with ", " as
    ``rewards/math.py`` joins them): ``normalise_answer(r"so \\boxed{ \\frac{1}{2} }.") ==
    r"\\frac{1}{2}"``, ``normalise_answer(r"\\boxed{1}, \\boxed{2}") == "1,2"``; no box: None.
    """
    boxes = final_boxes(completion)
    if boxes is None:
        return None
    answer = re.sub(r"\s+", "", ", ".join(boxes)).strip("$")
    return answer or None


def majority_vote(answers: Sequence[str | None]) -> int | None:
    """Index of the first sample giving the most frequent answer (ties: the earliest answer).

    ``majority_vote(["4", "3", "3"]) == 1``, ``majority_vote(["4", "3"]) == 0``,
    ``majority_vote([None, None]) is None`` (samples without an answer do not vote).
    """
    counts: dict[str, int] = {}
    first: dict[str, int] = {}
    for i, answer in enumerate(answers):
        if answer is not None:
            counts[answer] = counts.get(answer, 0) + 1
            first.setdefault(answer, i)
    if not counts:
        return None
    # max() keeps the first of equal keys, and dicts iterate in first-occurrence order.
    return first[max(counts, key=lambda a: counts[a])]


def problem_record(problem: dict, samples: list[SampleRecord], k: int) -> ProblemRecord:
    """A problem's samples scored; with fewer than ``k`` left (the others dropped: a failed
    environment call, a diverged replay), pass@k is pass@n over what is left."""
    correct = sum(s.correct for s in samples)
    winner = majority_vote([s.answer for s in samples])
    return ProblemRecord(
        id=str(problem.get("id")),
        gold=problem.get("answer"),
        samples=samples,
        correct=correct,
        pass_at_k=pass_at_k(len(samples), correct, min(k, len(samples))),
        majority=None if winner is None else samples[winner].answer,
        majority_correct=winner is not None and samples[winner].correct,
    )


def summarise(records: Sequence[ProblemRecord], k: int) -> dict[str, float]:
    """The ``eval/*`` metrics of scored problems (means over problems or over samples)."""
    samples = [s for r in records for s in r.samples]
    problems, n = max(len(records), 1), max(len(samples), 1)
    return {
        "eval/accuracy": sum(s.correct for s in samples) / n,
        f"eval/pass@{k}": sum(r.pass_at_k for r in records) / problems,
        f"eval/maj@{k}": sum(r.majority_correct for r in records) / problems,
        "eval/reward_mean": sum(s.reward for s in samples) / n,
        "eval/length_mean": sum(s.tokens for s in samples) / n,
        "eval/length_max": float(max((s.tokens for s in samples), default=0)),
        "eval/finished": sum(s.finish_reason == "stop" for s in samples) / n,
        "eval/answered": sum(s.answer is not None for s in samples) / n,
        "eval/problems": float(len(records)),
    }


# -- sampling and scoring through an engine -----------------------------------------------


def eval_rollout_config(eval_cfg: EvalConfig, rollout_cfg: RolloutConfig) -> RolloutConfig:
    """The sampler's settings for eval: ``eval.samples`` independent answers (episodes, with
    an agent), started by one request each; the agent's step limit stays the rollout's."""
    budget = eval_cfg.max_response_tokens or rollout_cfg.max_response_tokens
    return replace(
        rollout_cfg, mode="independent", width=eval_cfg.samples, branch=1, segment_tokens=budget,
        max_depth=1, temperature=eval_cfg.temperature, top_p=eval_cfg.top_p, top_k=-1,
    )


def run_eval(
    engine: RolloutEngine,
    rewards: Scorer,
    problems: Sequence[dict],
    prompts: Sequence[Sequence[int]] | None,
    eval_cfg: EvalConfig,
    rollout_cfg: RolloutConfig,
    *,
    decode: Callable[[list[int]], str],
    eos_token_ids: Sequence[int] = (),
    seed: int = 0,
    run_async: Callable[[Coroutine[Any, Any, Any]], Any] = asyncio.run,
    status: Callable[[str], None] = lambda text: None,
    agent: Agent | None = None,
    render: Render | None = None,
    env: EpisodeSetup | None = None,
    env_weight: float = 1.0,
    programs: ProgramSampler | None = None,
) -> EvalReport:
    """Sample ``eval_cfg.samples`` answers per problem, score them, compute the metrics.

    ``prompts[i]`` are problem i's prompt token ids; ``decode(ids) -> str`` gives the text
    the reward sees; ``run_async`` runs the sampling coroutine (the trainer's closes its
    client's session); ``status(text)`` reports progress. With an ``env`` (its reset gives the
    prompts: ``prompts`` None), or an ``agent`` (and its ``render``, as from
    :func:`arbor.rollout.agents.episode_inputs`), each answer is an episode; ``env_weight``
    (``reward.env_weight``) weighs the environment's reward. With ``programs`` (agent programs:
    :func:`~arbor.rollout.programs.program_sampler`) every answer is one run of the program, from the root (no forks).
    """
    k = eval_cfg.samples
    done = [0]

    def sampled(*_: Any) -> None:
        done[0] += 1
        status(f"eval: sampled {done[0]}/{len(problems)} problems")

    trees: list[RolloutTree]
    settings = eval_rollout_config(eval_cfg, rollout_cfg)
    trees, stats = run_async(sample_trees(
        engine, list(problems), prompts, settings, eos_token_ids=eos_token_ids, seed=seed, decode=decode,
        on_progress=sampled, agent=agent, render=render, env=env,
    ) if programs is None else programs(list(problems), settings, seed, sampled))
    # A problem whose every episode was dropped (its messages over the response budget, a
    # diverged replay) has no answer to score: counted in eval/dropped_problems, left out of
    # the accuracy; when no problem kept one, the eval stops naming the budget's keys.
    kept = [tree for tree in trees if tree.leaves()]
    if not kept and trees:
        from arbor.rollout.episodes import check_some_kept

        check_some_kept(stats, rollout_cfg, "eval", "evaluate")
    dropped_problems, trees = len(trees) - len(kept), kept
    leaves = [(tree, leaf) for tree in trees for leaf in tree.leaves()]
    texts = [decode(tree.response_ids(leaf)) for tree, leaf in leaves]
    result = rewards.score([(tree.problem or {}, text) for (tree, _), text in zip(leaves, texts)],
                           lambda d, n: status(f"eval: scored {d}/{n} answers"))
    scores = [score + (0.0 if leaf.env_reward is None else env_weight * leaf.env_reward)
              for score, (_, leaf) in zip(result.scores, leaves)]
    first_term = next(iter(result.term_scores.values()), scores)
    records, at = [], 0
    for tree in trees:
        samples = []
        for leaf in tree.leaves():
            samples.append(SampleRecord(
                response=texts[at], answer=normalise_answer(texts[at]), reward=scores[at],
                correct=first_term[at] > 0, tokens=leaf.end, finish_reason=leaf.finish_reason or "?",
                tool_calls=tool_turns(tree, leaf),
            ))
            at += 1
        records.append(problem_record(tree.problem or {}, samples, k))
    metrics = summarise(records, k) | {"eval/reward_timeouts": float(result.timeouts),
                                       "eval/dropped_problems": float(dropped_problems),
                                       # episodes dropped because user code failed (arbor.errors)
                                       "eval/failures": float(sum(len(s.failures) for s in stats))}
    if agent is not None or env is not None:
        metrics |= {
            "eval/tool_calls_per_episode": sum(s.tool_calls for r in records for s in r.samples)
            / max(len(leaves), 1),
            "eval/tool_errors": float(sum(s.tool_errors for s in stats)),
            "eval/agent_timeouts": float(sum(s.agent_timeouts for s in stats)),
        }
    if programs is not None:
        metrics |= {"eval/program_errors": float(sum(s.program_errors for s in stats)),
                    "eval/program_timeouts": float(sum(s.program_timeouts for s in stats))}
    if env is not None and not env.source.is_agent:
        metrics |= {"eval/env_timeouts": float(sum(s.env_timeouts for s in stats)),
                    "eval/env_errors": float(sum(s.env_errors for s in stats))}
    return EvalReport(k, metrics, records)


# -- arbor eval CONFIG ---------------------------------------------------------------------


def main(cfg: Config) -> int:
    """Start the engines of ``cfg``, evaluate ``eval.path``, write the JSON and TensorBoard.

    The start-up is every command's (:func:`arbor.run.startup.start_command`: the settled
    config, the tokenizer and stop ids; the agent, reward pool and engine launch options as
    ``arbor train`` builds them), but the engines run in this process, without Ray."""
    from arbor.data import format_prompt, load_problems, used_columns
    from arbor.engines.connect import closing, engine_client
    from arbor.engines.launch import launch_engines
    from arbor.plugins import default_search_dirs
    from arbor.rollout.agents import fitting_problems
    from arbor.rollout.environments import require_reward, rollout_env
    from arbor.rollout.episodes import run_episodes
    from arbor.rollout.programs import load_program, model_name, program_sampler
    from arbor.rollout.rewards import reward_pool
    from arbor.run.engine_group import launch_options
    from arbor.run.orchestration import cpu_threads
    from arbor.run.startup import engine_device, problem_files, start_command

    e = cfg.eval
    ((key, path),) = problem_files(cfg, "eval").items()  # eval.path, else data.eval_path (else a ConfigError)
    started = start_command(cfg, "eval")
    cfg, tokenizer, eos = started.cfg, started.tokenizer, started.stop_ids
    search = default_search_dirs(cfg.source)
    env = rollout_env(cfg.rollout, search)  # the episodes the run trains on
    program = load_program(cfg.rollout, search)  # or runs of an agent program (it writes its own prompts)
    if program is None:
        require_reward(env, cfg.reward)
    columns = used_columns(cfg.rollout.env, len(cfg.reward.functions))
    problems, skipped = load_problems(path, cfg.data, key, columns), list[str]()
    if program is None and (env is None or env.agent is not None):  # an environment's prompts: known at its reset
        # As arbor train does: prompts longer than data.max_prompt_tokens are skipped (and counted), never cut.
        problems, skipped = fitting_problems(problems, None if env is None else env.agent, tokenizer, cfg.data,
                                             cfg.model.chat_template, key)
    problems = problems[: e.max_problems or None]
    episodes = None if env is None else run_episodes(env, tokenizer, cfg.data, needs_reward=not cfg.reward.functions)
    prompts = None if env is not None or program is not None else [
        format_prompt(p, cfg.data, tokenizer, cfg.model.chat_template) for p in problems]
    out_dir = Path(cfg.run.output_dir)
    output = Path(e.output) if e.output else out_dir / "eval.json"
    print(f"arbor eval: {cfg.model.path} on {path}: {len(problems)} problems x {e.samples} answer(s), "
          + (f"temperature {e.temperature}" if e.temperature > 0 else "greedy")
          + (f", {env.key} {env.spec}" if env is not None else "")
          + (f", {program.key} {cfg.rollout.program or ' '.join(program.command)}" if program is not None else ""),
          flush=True)

    def decode(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=True)

    if engine_device(cfg) == "cpu":  # the servers inherit it: the cores split with this process (run.cpu_threads)
        os.environ["OMP_NUM_THREADS"] = str(cpu_threads(cfg, processes=cfg.engine.num_engines + 1))
    t0 = time.perf_counter()
    with reward_pool(cfg.reward, search) as rewards, launch_engines(
        **launch_options(cfg), num_engines=cfg.engine.num_engines, host=cfg.engine.host, log_dir=out_dir / "logs" / "eval",
    ) as engines:
        print(f"arbor eval: engines {', '.join(engines.urls)}", flush=True)
        client = engine_client(cfg.engine, engines.urls)
        programs = None if program is None else program_sampler(
            client, program, tokenizer, eos, model_name(cfg), needs_reward=not cfg.reward.functions)
        report = run_eval(
            client, rewards, problems, prompts, e, cfg.rollout, decode=decode, eos_token_ids=eos,
            seed=cfg.run.seed, run_async=lambda coroutine: asyncio.run(closing(client, coroutine)),
            status=_console_status, env=episodes, env_weight=cfg.reward.env_weight, programs=programs,
        )
    _console_status("")
    report.metrics["eval/seconds"] = time.perf_counter() - t0
    report.metrics["eval/skipped_long_prompts"] = float(len(skipped))
    write_report(output, report, cfg, str(path))
    if "tensorboard" in cfg.run.loggers:
        write_scalars(out_dir / "tensorboard" / "eval", report.metrics, e.step)
    m, k = report.metrics, report.k
    print(f"arbor eval: pass@{k} {m[f'eval/pass@{k}']:.3f}  maj@{k} {m[f'eval/maj@{k}']:.3f}  "
          f"accuracy {m['eval/accuracy']:.3f}  length {m['eval/length_mean']:.1f} tokens  "
          + (f"tool calls {m['eval/tool_calls_per_episode']:.2f}/episode ({m['eval/tool_errors']:.0f} errors, "
             f"{m['eval/agent_timeouts']:.0f} agent timeouts)  " if env is not None else "")
          + f"({m['eval/seconds']:.1f} s) -> {output}", flush=True)
    return 0


def write_report(output: Path, report: EvalReport, cfg: Config, data_path: str) -> None:
    """``eval.json``: what was evaluated, how, the metrics and every problem's record."""
    e = cfg.eval
    settings = {"model": cfg.model.path, "data": data_path, "samples": e.samples, "temperature": e.temperature,
                "top_p": e.top_p, "seed": cfg.run.seed, "step": e.step, "agent": cfg.rollout.agent,
                "env": cfg.rollout.env, "program": cfg.rollout.program or cfg.rollout.program_command or None}
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(settings | report.to_dict(), indent=1) + "\n")


def write_scalars(directory: Path, metrics: dict[str, float], step: int) -> None:
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(directory))
    try:
        for key, value in metrics.items():
            writer.add_scalar(key, value, step)
    finally:
        writer.close()


def _console_status(text: str) -> None:
    """Progress on a terminal: one line rewritten in place (nothing in logs)."""
    if sys.stdout.isatty():
        sys.stdout.write(f"\r\033[K{text}")
        sys.stdout.flush()
