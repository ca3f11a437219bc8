"""Reward terms scored by served models (``reward.functions`` kinds judge, classifier, http):
a judge on a real `arbor serve`, a reward server over HTTP, a sequence-classification model;
failures scored ``failure_value`` and counted; and a 2-step run scored by a judge and an http
reward server together."""

from __future__ import annotations

import asyncio
import json
import re
import threading
from pathlib import Path

import pytest
import torch
from aiohttp import web
from tiny_model import build_tiny_model_dir
from transformers import AutoTokenizer

from arbor.config import RewardConfig, RewardTermConfig
from arbor.config_load import load_config
from arbor.engines.embedded.engine import LocalEngine
from arbor.engines.embedded.server import ServerThread
from arbor.engines.ports import free_port
from arbor.engines.types import GenerateRequest, SamplingParams
from arbor.rollout.rewards import reward_pool
from arbor.rollout.served_rewards import ServedTerm, fill_template, parse_verdict

TINY_ARITH = Path(__file__).resolve().parents[1] / "models" / "tiny-arith"
ITEMS = [({"id": "a", "prompt": "What is 1+2?", "answer": "3"}, "1+2=3"),
         ({"id": "b", "prompt": "What is 4+4?", "answer": "8"}, "4+4=9"),
         ({"id": "c", "prompt": "What is 1+2?", "answer": "3"}, "1+2=3")]


class RewardServer:
    """A user's reward server in a thread: ``POST /score`` answers ``{"scores": [...]}``, the
    length of each completion, null for completions that contain "9" and for problems marked
    ``unscored`` (it cannot judge them)."""

    def __init__(self) -> None:
        self.port, self.calls = free_port("127.0.0.1"), 0
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()

    async def score(self, request: web.Request) -> web.Response:
        self.calls += 1
        items = (await request.json())["items"]
        return web.json_response({"scores": [None if "9" in i["completion"] or i["problem"].get("unscored")
                                             else len(i["completion"]) for i in items]})

    def run(self) -> None:
        asyncio.set_event_loop(self.loop)
        app = web.Application()
        app.router.add_post("/score", self.score)
        runner = web.AppRunner(app)
        self.loop.run_until_complete(runner.setup())
        self.loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", self.port).start())
        self.ready.set()
        self.loop.run_forever()

    def __enter__(self) -> str:
        threading.Thread(target=self.run, daemon=True).start()
        self.ready.wait(10)
        return f"http://127.0.0.1:{self.port}/score"

    def __exit__(self, *exc: object) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)


@pytest.fixture(scope="module")
def judge():
    engine = LocalEngine(TINY_ARITH)
    tokenizer = AutoTokenizer.from_pretrained(TINY_ARITH)
    with ServerThread(engine, tokenizer) as url:
        yield url, engine, tokenizer
    engine.shutdown()


def test_template_and_parser():
    assert fill_template("{prompt}|{response}|{answer} \\boxed{}", ITEMS[0][0], "x") == "What is 1+2?|x|3 \\boxed{}"
    assert fill_template("{prompt}", {"prompt": [{"role": "user", "content": "hi"}]}, "") == "hi"
    parser = re.compile(r"score: (-?\d+(?:\.\d+)?)")
    assert parse_verdict("... score: 7.5 then score: 2", parser) == 7.5
    assert parse_verdict("no verdict", parser) is None


def test_a_judge_scores_with_the_engines_greedy_verdicts(judge):
    url, engine, tokenizer = judge
    term = RewardTermConfig(kind="judge", url=url, template="What is {prompt}", parser=r"(\d+)", max_new_tokens=12,
                            failure_value=-1.0)
    values, failures = ServedTerm(term, 0, url=url).score(ITEMS)
    expected = []
    for problem, completion in ITEMS:  # the same verdicts, asked of the engine directly
        ids = tokenizer(fill_template(term.template, problem, completion), add_special_tokens=False)["input_ids"]
        (out,) = engine.generate_sync([GenerateRequest(ids, SamplingParams(12, temperature=0.0))])[0:1]
        verdict = parse_verdict(tokenizer.decode(out[0].output_ids), re.compile(r"(\d+)"))
        expected.append(-1.0 if verdict is None else verdict)
    assert values == expected and failures == sum(v is None for v in expected)
    never = RewardTermConfig(kind="judge", url=url, parser="(NEVER)", failure_value=0.25)
    assert ServedTerm(never, 0, url=url).score(ITEMS) == ([0.25] * 3, 3)
    gone = RewardTermConfig(kind="judge", url=f"http://127.0.0.1:{free_port('127.0.0.1')}", timeout_s=5.0)
    assert ServedTerm(gone, 0, url=gone.url).score(ITEMS) == ([0.0] * 3, 3)


def test_an_http_reward_server_with_nulls_and_a_broken_one():
    with RewardServer() as url:
        term = RewardTermConfig(kind="http", url=url, failure_value=-0.5)
        assert ServedTerm(term, 0, url=url).score(ITEMS) == ([5.0, -0.5, 5.0], 1)
        broken = RewardTermConfig(kind="http", url=url.replace("/score", "/missing"))
        assert ServedTerm(broken, 0, url=broken.url).score(ITEMS) == ([0.0] * 3, 3)


def test_a_classifier_reward_model_and_the_pool_combines_terms_in_config_order(tmp_path):
    from transformers import AutoModelForSequenceClassification, Qwen2Config

    tokenizer = AutoTokenizer.from_pretrained(TINY_ARITH)
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, num_labels=1, pad_token_id=tokenizer.pad_token_id)
    model = AutoModelForSequenceClassification.from_config(config).eval()
    model.save_pretrained(tmp_path / "rm")
    tokenizer.save_pretrained(tmp_path / "rm")
    with torch.no_grad():
        expected = [float(model(**tokenizer(p["prompt"] + c, return_tensors="pt")).logits[0, 0]) for p, c in ITEMS]
    with RewardServer() as url:
        cfg = RewardConfig(functions=[
            RewardTermConfig(kind="classifier", model=str(tmp_path / "rm"), weight=2.0),
            RewardTermConfig(fn="rewards/math.py:boxed_format", weight=1.0),
            RewardTermConfig(kind="http", url=url, weight=0.5)], workers=1)
        with reward_pool(cfg) as pool:
            result = pool.score(ITEMS)
    assert list(result.term_scores) == [f"classifier:{tmp_path / 'rm'}", "rewards/math.py:boxed_format", f"http:{url}"]
    assert result.term_scores[f"classifier:{tmp_path / 'rm'}"] == pytest.approx(expected, abs=1e-4)
    assert result.served_failures == 1
    assert result.scores == pytest.approx([2 * e + 0.0 + 0.5 * h for e, h in zip(expected, [5.0, 0.0, 5.0])], abs=1e-4)


def test_a_two_step_run_scored_by_a_judge_and_a_reward_server(judge, tmp_path):
    from arbor.run.trainer import train

    url = judge[0]
    model = build_tiny_model_dir(tmp_path / "model")
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"q{i} " * 3, "answer": "1", "unscored": i % 2 == 1})
                            + "\n" for i in range(8)))
    with RewardServer() as http_url:
        functions = (f"[{{kind: judge, url: '{url}', template: 'What is {{response}}', parser: '([0-9])', "
                     f"max_new_tokens: 8}}, {{kind: http, url: '{http_url}', weight: 0.1}}]")
        cfg = load_config(None, [
            f"model.path={model}", "model.chat_template=true", f"data.train_path={data}", "data.prompts_per_step=2",
            "rollout.width=4", "rollout.branch=2", "rollout.segment_tokens=4", "rollout.max_depth=2",
            "engine.kind=embedded", f"reward.functions={functions}", "reward.workers=1", "reward.max_failure_fraction=1.0",
            "algorithm.dynamic_sampling=false", "learner.backend=torch", "learner.device=cpu", "learner.dtype=float32",
            "learner.pack_tokens=256", "data.max_prompt_tokens=64", "run.steps=2", f"run.output_dir={tmp_path / 'out'}",
            "run.eval_every=0", "run.save_trees_every=0"])
        history = train(cfg)
    assert len(history) == 2
    # Every leaf is scored by both; the reward server answers null for the unscored problems
    # (half of them), the judge finds no digit in some verdicts: failures are counted.
    assert all("reward/served_failures" in m for m in history)
    assert sum(m["reward/served_failures"] for m in history) > 0
