"""`arbor eval`: pass@k / maj@k / length worked by hand on a scripted engine, agent episodes
on the multi-turn tests' scripted engine and agent, then the CLI on tiny-arith."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from agent_fixtures import PROBLEMS as EPISODE_PROBLEMS
from agent_fixtures import TOOL_TURNS, HangingAgent
from agent_fixtures import ScriptedEngine as EpisodeEngine
from transformers import AutoTokenizer

from arbor.config_load import load_config
from arbor.engines.types import GenerateOutput, GenerateRequest
from arbor.errors import ConfigError
from arbor.rollout.agents import episode_inputs
from arbor.rollout.environments import agent_source
from arbor.rollout.rewards import RewardPool, RewardTerm
from arbor.run import phases
from arbor.run.evaluate import majority_vote, normalise_answer, pass_at_k, run_eval

REPO = Path(__file__).resolve().parents[1]
MODEL = REPO / "models" / "tiny-arith"
EOS = 0

# Problem → gold answer and the scripted engine's three answers (one character a token).
SCRIPT = {
    "p1": ("3", ["\\boxed{3}", "x=\\boxed{3}", "\\boxed{4}"]),  # c=2, votes 3,3,4: majority 3 ✓
    "p2": ("5", ["\\boxed{5}", "\\boxed{6}", "\\boxed{ 6 }"]),  # c=1, votes 5,6,6: majority 6 ✗
    "p3": ("7", ["\\boxed{1}", "\\boxed{2}", "no idea"]),  # c=0, tie 1/2: first (1) ✗
    "p4": ("8", ["\\boxed{8}", "\\boxed{9}", "hmm " * 5]),  # c=1, tie 8/9: first (8) ✓; cut at 16
}
BUDGET = 16  # eval.max_response_tokens: "hmm hmm hmm hmm " (16 tokens) ends at max_length
# Lengths: p1 9+11+9, p2 9+9+11, p3 9+9+7, p4 9+9+16 = 117 characters, + EOS on the 11 answers
# that stopped (the engine returns it, as SGLang does) = 128 tokens over 12 samples.


class CharTokenizer:
    """One token per character (EOS = 0), so lengths can be counted by hand."""

    eos_token_id = EOS
    chat_template = None

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": [ord(c) for c in text]}

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids if i != EOS)


class ScriptedEngine:
    """Answers problem ``pN`` (its prompt) with SCRIPT's texts, cut at ``max_new_tokens``."""

    def __init__(self) -> None:
        self.requests: list[GenerateRequest] = []
        self.flushes = 0

    async def flush_cache(self) -> None:
        self.flushes += 1

    async def close(self) -> None:  # the trainer's phases close the client after each run
        pass

    async def generate(self, request: GenerateRequest) -> list[GenerateOutput]:
        self.requests.append(request)
        _, answers = SCRIPT[CharTokenizer().decode(request.input_ids)]
        outs = []
        for text in answers[: request.sampling.n]:
            ids = [ord(c) for c in text]
            cut = len(ids) > request.sampling.max_new_tokens
            ids = ids[: request.sampling.max_new_tokens] if cut else ids + [EOS]
            outs.append(GenerateOutput(ids, [-0.1] * len(ids), "length" if cut else "stop",
                                       len(request.input_ids), 0, "v0"))
        return outs


PROBLEMS = [{"id": pid, "prompt": pid, "answer": gold} for pid, (gold, _) in SCRIPT.items()]


@pytest.fixture(scope="module")
def rewards():
    with RewardPool([RewardTerm(f"{REPO}/rewards/math.py:boxed_accuracy")], workers=1, timeout_s=30) as pool:
        yield pool


def eval_config(*overrides: str):
    return load_config(None, ["eval.samples=3", "eval.temperature=0.7", "eval.top_p=0.9",
                              f"eval.max_response_tokens={BUDGET}", "model.chat_template=false", *overrides])


def test_pass_at_k_unbiased_estimator():
    assert pass_at_k(3, 1, 3) == 1.0  # n = k: any correct sample passes
    assert pass_at_k(3, 0, 3) == 0.0
    assert pass_at_k(4, 1, 1) == 0.25  # pass@1 = c / n
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - 3 / 6)  # 1 − C(3,2)/C(4,2)
    assert pass_at_k(5, 2, 3) == pytest.approx(1 - 1 / 10)  # 1 − C(3,3)/C(5,3)
    with pytest.raises(ValueError):
        pass_at_k(2, 1, 3)


def test_answers_are_normalised_boxes_and_votes_break_ties_by_first_answer():
    assert normalise_answer("so \\boxed{ \\frac{1}{2} }.") == "\\frac{1}{2}"
    assert normalise_answer("\\boxed{$3$}") == "3"
    assert normalise_answer("\\boxed{1}, no: \\boxed{2}") == "2"  # the last box counts
    # A run of boxes is one answer, as the reward reads it (a hedge votes as a set).
    assert normalise_answer("\\boxed{1} or \\boxed{2}") == "1,2"
    assert normalise_answer("no box") is None and normalise_answer("\\boxed{ }") is None
    assert majority_vote(["4", "3", "3"]) == 1  # the first sample of the winning answer
    assert majority_vote(["4", "3"]) == 0  # tie: the answer given first
    assert majority_vote([None, "3", None, "5", "5"]) == 3  # no answer: no vote
    assert majority_vote([None, None]) is None and majority_vote([]) is None


def test_metrics_match_a_hand_count_on_a_scripted_engine(rewards):
    cfg = eval_config()
    engine, tok = ScriptedEngine(), CharTokenizer()
    prompts = [tok(p["prompt"])["input_ids"] for p in PROBLEMS]
    report = run_eval(engine, rewards, PROBLEMS, prompts, cfg.eval, cfg.rollout, decode=tok.decode,
                      eos_token_ids=[EOS], seed=5)
    m = report.metrics
    assert m["eval/pass@3"] == 3 / 4  # p1, p2, p4 have a correct sample
    assert m["eval/maj@3"] == 2 / 4  # p1 (3 of 3,3,4) and p4 (tie 8/9: 8 came first)
    assert m["eval/accuracy"] == pytest.approx(4 / 12)  # 2 + 1 + 0 + 1 correct samples
    assert m["eval/reward_mean"] == pytest.approx(4 / 12)
    assert m["eval/length_mean"] == pytest.approx(128 / 12) and m["eval/length_max"] == 16
    assert m["eval/finished"] == pytest.approx(11 / 12)  # the cut "hmm hmm …" did not end on EOS
    assert m["eval/answered"] == pytest.approx(10 / 12)
    assert m["eval/problems"] == 4 and m["eval/reward_timeouts"] == 0
    by_id = {r.id: r for r in report.problems}
    assert [by_id[p].correct for p in SCRIPT] == [2, 1, 0, 1]
    assert [by_id[p].majority for p in SCRIPT] == ["3", "6", "1", "8"]
    assert by_id["p4"].samples[2].finish_reason == "max_length" and by_id["p4"].samples[2].answer is None
    assert by_id["p1"].samples[1].response == "x=\\boxed{3}" and by_id["p1"].gold == "3"
    # One request per problem: all k answers at once, the eval sampling settings, EOS as a stop.
    assert len(engine.requests) == 4
    for request in engine.requests:
        s = request.sampling
        assert (s.n, s.temperature, s.top_p, s.max_new_tokens, s.stop_token_ids) == (3, 0.7, 0.9, BUDGET, [EOS])
    json.dumps(report.to_dict())  # the JSON report is plain data


def test_greedy_eval_is_one_answer_at_temperature_zero(rewards):
    cfg = load_config(None, ["model.chat_template=false"])  # defaults: samples 1, temperature 0
    engine, tok = ScriptedEngine(), CharTokenizer()
    prompts = [tok(p["prompt"])["input_ids"] for p in PROBLEMS]
    report = run_eval(engine, rewards, PROBLEMS, prompts, cfg.eval, cfg.rollout, decode=tok.decode)
    assert report.metrics["eval/pass@1"] == report.metrics["eval/maj@1"] == report.metrics["eval/accuracy"] == 3 / 4
    assert {(r.sampling.n, r.sampling.temperature) for r in engine.requests} == {(1, 0.0)}
    assert {r.sampling.max_new_tokens for r in engine.requests} == {cfg.rollout.max_response_tokens}


class BatchingEngine(ScriptedEngine):
    """The scripted answers through a batch call, as the HTTP client sends a batched ``/generate``."""

    def __init__(self) -> None:
        super().__init__()
        self.batches: list[int] = []  # requests per batch call

    async def generate_many(self, requests: list[GenerateRequest]) -> list[list[GenerateOutput]]:
        self.batches.append(len(requests))
        return [await self.generate(r) for r in requests]


def test_an_eval_is_one_batch_of_every_problem(rewards):
    cfg = load_config(None, ["model.chat_template=false"])  # greedy: one answer per problem
    engine, tok = BatchingEngine(), CharTokenizer()
    prompts = [tok(p["prompt"])["input_ids"] for p in PROBLEMS]
    report = run_eval(engine, rewards, PROBLEMS, prompts, cfg.eval, cfg.rollout, decode=tok.decode)
    assert engine.batches == [len(PROBLEMS)]  # one call: the engine batches every problem at once
    assert report.metrics["eval/accuracy"] == 3 / 4  # the same answers as one request each


def test_the_trainers_eval_phase_logs_the_same_metrics(rewards):
    cfg = eval_config("eval.max_problems=3")
    statuses: list[str] = []
    sampling = phases.Sampling(ScriptedEngine(), CharTokenizer(), None, [EOS], cfg.data, cfg.model.chat_template)
    metrics = phases.evaluate(sampling, rewards, PROBLEMS, cfg.eval, cfg.rollout, cfg.run.seed, statuses.append)
    assert metrics["eval/problems"] == 3  # eval.max_problems: the first three
    assert metrics["eval/pass@3"] == 2 / 3 and metrics["eval/maj@3"] == 1 / 3
    assert metrics["eval/accuracy"] == pytest.approx(3 / 9)
    assert "eval: sampled 3/3 problems" in statuses
    assert sampling.engine.flushes == 1  # the next step starts from an empty cache, as a resumed run does


def test_eval_with_an_agent_runs_one_episode_per_sample(rewards):
    """rollout.agent in the trainer's eval: each sample is an independent episode started
    from data.system_prompt + the agent's start; the scored text is the whole response (as
    the reward sees it in training); tool calls and agent timeouts are reported. p1's first
    agent step hangs: its episodes end there ("agent_timeout") and p0's go on."""
    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    cfg = load_config(None, ["eval.samples=3", "eval.temperature=1.0", "eval.max_response_tokens=200",
                             "data.system_prompt=Be brief.", "rollout.agent_timeout_s=0.3"])
    agent, engine = HangingAgent(), EpisodeEngine(tokenizer)
    sampling = phases.Sampling(engine, tokenizer, agent_source(agent), [tokenizer.eos_token_id], cfg.data,
                               cfg.model.chat_template)
    try:
        metrics = phases.evaluate(sampling, rewards, EPISODE_PROBLEMS, cfg.eval, cfg.rollout, cfg.run.seed,
                                  lambda text: None)
    finally:
        agent.release.set()
    starts = [r for r in engine.requests if r.sampling.n == 3]  # one per problem; then n = 1 per turn
    assert [r.input_ids for r in starts] == [tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, *agent.start(p)], add_generation_prompt=True, tokenize=True,
    )["input_ids"] for p in EPISODE_PROBLEMS]
    assert {r.sampling.n for r in engine.requests} == {1, 3} and all(
        r.sampling.max_new_tokens <= 200 for r in engine.requests)
    # p0: 3 episodes of 2 tool calls; p1: 3 episodes dropped at their hung first step.
    assert metrics["eval/tool_calls_per_episode"] == TOOL_TURNS
    assert metrics["eval/agent_timeouts"] == 3 and metrics["eval/tool_errors"] == 0
    assert metrics["eval/failures"] == 3 and metrics["eval/dropped_problems"] == 1
    assert metrics["eval/finished"] == 1.0  # what is left ended on EOS


def test_eval_report_records_each_episode_and_its_whole_text(rewards):
    """The report's samples: an episode's tool calls, finish reason and whole decoded text,
    whose last box is the answer scored."""
    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    cfg = load_config(None, ["eval.samples=3", "eval.temperature=1.0", "eval.max_response_tokens=200",
                             "rollout.agent_timeout_s=0.3"])
    agent, engine = HangingAgent(), EpisodeEngine(tokenizer)
    prompts, render = episode_inputs(EPISODE_PROBLEMS, agent, tokenizer, cfg.data, cfg.model.chat_template)
    try:
        report = run_eval(engine, rewards, EPISODE_PROBLEMS, prompts, cfg.eval, cfg.rollout, agent=agent, render=render,
                          decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
                          eos_token_ids=[tokenizer.eos_token_id], seed=1)
    finally:
        agent.release.set()
    (p0,) = report.problems  # p1's episodes timed out at their first step: dropped, counted
    assert report.metrics["eval/dropped_problems"] == 1 and report.metrics["eval/failures"] == 3
    assert [s.tool_calls for s in p0.samples] == [TOOL_TURNS] * 3
    for sample in p0.samples:
        # Two code turns, two tool results, the final answer: one text, as in training.
        assert sample.response.count("ran: ") == TOOL_TURNS and sample.finish_reason == "stop"
        assert sample.answer == normalise_answer(sample.response) and sample.response.endswith(f"\\boxed{{{sample.answer}}}")
        assert sample.correct == (sample.answer == "0")
    assert report.metrics["eval/reward_mean"] == report.metrics["eval/accuracy"]


def test_config_checks_the_eval_section():
    with pytest.raises(ConfigError, match="eval.samples must be 1 with eval.temperature: 0"):
        load_config(None, ["eval.samples=4"])
    for bad, key in (("eval.top_p=0", "eval.top_p"), ("eval.max_problems=-1", "eval.max_problems"),
                     ("eval.temperature=-1", "eval.temperature"), ("eval.max_response_tokens=0", "eval.max_response_tokens")):
        with pytest.raises(ConfigError, match=key):
            load_config(None, [bad])


def test_arbor_eval_command_on_the_quickstart_model(tmp_path):
    """`arbor eval configs/quickstart.yaml`: `arbor serve` on tiny-arith, JSON report, TensorBoard."""
    out = tmp_path / "ev"
    command = [sys.executable, "-m", "arbor", "eval", "configs/quickstart.yaml", "eval.max_problems=8",
               "eval.samples=4", "eval.temperature=1.0", "eval.step=7", f"run.output_dir={out}"]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "pass@4" in done.stdout and "maj@4" in done.stdout
    report = json.loads((out / "eval.json").read_text())
    m = report["metrics"]
    assert report["k"] == 4 and report["step"] == 7 and len(report["problems"]) == 8
    assert all(len(p["samples"]) == 4 for p in report["problems"])
    for key in ("eval/pass@4", "eval/maj@4", "eval/accuracy", "eval/finished", "eval/answered"):
        assert 0 <= m[key] <= 1, key
    # maj@k ≤ pass@k (a correct majority is a correct sample) and accuracy ≤ pass@k.
    assert m["eval/maj@4"] <= m["eval/pass@4"] and m["eval/accuracy"] <= m["eval/pass@4"]
    assert 0 < m["eval/length_mean"] <= m["eval/length_max"] <= 24  # quickstart: 8 tokens x 3 segments
    assert list((out / "tensorboard" / "eval").glob("events.out.tfevents.*"))
    assert (out / "logs" / "eval" / "engine-0.log").exists()


def test_arbor_eval_runs_agent_episodes_on_the_quickstart_model(tmp_path):
    """`arbor eval` with rollout.agent: episodes on tiny-arith, agent metrics in the report."""
    out, agent = tmp_path / "ev", f"{REPO}/tests/agent_fixtures.py:Recheck"
    command = [sys.executable, "-m", "arbor", "eval", "configs/quickstart.yaml", "eval.max_problems=4",
               "eval.samples=2", "eval.temperature=1.0", "eval.max_response_tokens=64", f"rollout.agent={agent}",
               f"run.output_dir={out}"]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"agent {agent}" in done.stdout and "tool calls" in done.stdout
    report = json.loads((out / "eval.json").read_text())
    m, samples = report["metrics"], [s for p in report["problems"] for s in p["samples"]]
    assert report["agent"] == agent and len(samples) == 8
    # The tiny model ends its first answer with <|im_end|> almost always: one check each.
    assert 0.5 < m["eval/tool_calls_per_episode"] <= 1.0
    assert m["eval/tool_calls_per_episode"] == sum(s["tool_calls"] for s in samples) / 8
    assert m["eval/tool_errors"] == sum(s["tool_calls"] for s in samples)  # every check is marked an error
    assert m["eval/agent_timeouts"] == 0
    assert all("checked" in s["response"] for s in samples if s["tool_calls"])


def test_arbor_eval_runs_environment_episodes_scored_by_the_environment(tmp_path):
    """`arbor eval` with rollout.env and no reward function: the environment's prompts (its reset,
    not checked at start-up), its steps, and its reward as the whole score."""
    out, env = tmp_path / "ev", f"{REPO}/tests/env_fixtures.py:Recheck"
    command = [sys.executable, "-m", "arbor", "eval", "configs/quickstart.yaml", "eval.max_problems=4",
               "eval.samples=2", "eval.temperature=1.0", "eval.max_response_tokens=64", f"rollout.env={env}",
               "reward.functions=[]", f"run.output_dir={out}"]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"rollout.env {env}" in done.stdout
    report = json.loads((out / "eval.json").read_text())
    m, samples = report["metrics"], [s for p in report["problems"] for s in p["samples"]]
    assert report["env"] == env and len(samples) == 8 and m["eval/env_errors"] == 0
    assert 0.5 < m["eval/tool_calls_per_episode"] <= 1.0  # "Check your answer." once per episode
    assert all("Check your answer." in s["response"] for s in samples if s["tool_calls"])
    # The environment's reward is the score: 1 when an answer boxes the gold one.
    assert all(s["reward"] in (0.0, 1.0) and s["correct"] == (s["reward"] > 0) for s in samples)


def test_arbor_eval_without_a_set_says_so(tmp_path):
    command = [sys.executable, "-m", "arbor", "eval", "configs/quickstart.yaml", "data.eval_path=null", "run.eval_every=0",
               f"run.output_dir={tmp_path}"]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "eval.path or data.eval_path" in done.stderr


def test_a_problem_that_lost_some_samples_scores_pass_at_k_over_what_is_left():
    """With the failure policy a sample can be dropped (its environment failed): a problem with 2
    of its 3 samples left is pass@2 over them, not an error of pass@3 over 2."""
    from arbor.run.evaluate import SampleRecord, problem_record

    def sample(correct: bool) -> SampleRecord:
        return SampleRecord(response="r", answer="1" if correct else "2", reward=float(correct), correct=correct,
                            tokens=3, finish_reason="stop", tool_calls=0)

    record = problem_record({"id": "p", "answer": "1"}, [sample(False), sample(True)], k=3)
    assert record.pass_at_k == 1.0 and record.correct == 1
    assert problem_record({"id": "p"}, [sample(False), sample(False)], k=3).pass_at_k == 0.0
