"""Teacher scoring against a real SGLang 0.5.23 server: the same prefill-only requests for
input-token log-probs to SGLang and to `arbor serve`, over models/tiny-arith in float32.

SGLang scores input tokens at temperature 1 whatever ``sampling_params.temperature`` says
(its input log-probs skip the temperature its sampled ones apply): arbor refuses a SGLang
teacher with ``rollout.temperature ≠ 1``; here both servers score at 1. Checked: the reply's
shape (parsed by the same client), the values, and the radix reuse of a scored parent; then a
2-step distilling run whose teacher is the SGLang server.
"""

from __future__ import annotations

import asyncio

import pytest
from sglang_env import TINY_ARITH, sglang_python

from arbor.engines.client import SGLangClient
from arbor.engines.embedded.engine import LocalEngine
from arbor.engines.embedded.server import ServerThread
from arbor.engines.launch import launch_engines, sglang_cpu_flags
from arbor.engines.types import ScoreRequest

GAP_BOUND = 1e-4  # float32 on both sides, different attention kernels (test_sglang_real.py)


def scores(url: str, waves: list[list[ScoreRequest]]):
    async def main():
        async with SGLangClient(url, send_seeds=False) as client:
            await client.flush_cache()
            return [await client.score_many(wave) for wave in waves]

    return asyncio.run(main())


@pytest.fixture(scope="module")
def sglang_url(tmp_path_factory):
    with launch_engines("sglang", model_path=str(TINY_ARITH), device="cpu", dtype="float32", python=sglang_python(),
                        extra_args=sglang_cpu_flags(4096) + ["--random-seed", "0"],
                        log_dir=tmp_path_factory.mktemp("sglang-logs"), startup_timeout_s=600) as handle:
        yield handle.urls[0]


def test_sglang_and_arbor_serve_score_a_tree_alike(sglang_url):
    from transformers import AutoTokenizer

    prompt = AutoTokenizer.from_pretrained(TINY_ARITH)("What is 12 + 30?")["input_ids"]
    parent = prompt + [20, 21, 22]
    waves = [[ScoreRequest(parent, start=len(prompt))],
             [ScoreRequest(parent + [30, 31], start=len(parent)), ScoreRequest(parent + [40], start=len(parent))]]
    real = scores(sglang_url, waves)
    engine = LocalEngine(TINY_ARITH)
    try:
        with ServerThread(engine) as url:
            ours = scores(url, waves)
    finally:
        engine.shutdown()
    for real_wave, our_wave in zip(real, ours):
        for a, b in zip(real_wave, our_wave):
            assert len(a.logprobs) == len(b.logprobs)
            assert a.logprobs == pytest.approx(b.logprobs, abs=GAP_BOUND)
            assert a.prompt_tokens == b.prompt_tokens
    # The children find the scored parent cached up to its last token, on both servers.
    assert [o.cached_tokens for o in real[1]] == [o.cached_tokens for o in ours[1]] == [len(parent) - 1] * 2


def test_a_distilling_run_with_a_sglang_teacher(sglang_url, tmp_path, monkeypatch):
    """configs/distill.yaml for 2 steps with the teacher on the SGLang server (kind external)."""
    from arbor.config_load import load_config
    from arbor.run.trainer import train

    repo = TINY_ARITH.parents[1]
    monkeypatch.chdir(repo)
    cfg = load_config(repo / "configs" / "distill.yaml", [
        "run.steps=2", "data.prompts_per_step=2", "run.eval_every=0", "run.save_trees_every=0", "reward.workers=1",
        f"run.output_dir={tmp_path / 'out'}", "algorithm.distill.teacher.model=null",
        "algorithm.distill.teacher.kind=external", f"algorithm.distill.teacher.urls=[{sglang_url}]"])
    history = train(cfg)
    assert [m["distill/teacher_tokens"] < m["distill/linearised_tokens"] for m in history] == [True, True]
    # The teacher is the student's own starting weights: before any update they agree.
    assert abs(history[0]["distill/reverse_kl"]) < 1e-3
