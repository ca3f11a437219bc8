"""Teacher scoring against a real SGLang 0.5.23 server: the same prefill-only requests for
input-token log-probs to SGLang and to `arbor serve`, over models/tiny-arith in float32.

SGLang scores input tokens at temperature 1 whatever ``sampling_params.temperature`` says
(its input log-probs skip the temperature its sampled ones apply): arbor refuses a SGLang
teacher with ``rollout.temperature ≠ 1``; here both servers score at 1. Checked: the reply's
shape (parsed by the same client), the values, and the radix reuse of a scored parent.
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


def test_sglang_and_arbor_serve_score_a_tree_alike(tmp_path):
    from transformers import AutoTokenizer

    prompt = AutoTokenizer.from_pretrained(TINY_ARITH)("What is 12 + 30?")["input_ids"]
    parent = prompt + [20, 21, 22]
    waves = [[ScoreRequest(parent, start=len(prompt))],
             [ScoreRequest(parent + [30, 31], start=len(parent)), ScoreRequest(parent + [40], start=len(parent))]]
    with launch_engines("sglang", model_path=str(TINY_ARITH), device="cpu", dtype="float32", python=sglang_python(),
                        extra_args=sglang_cpu_flags(4096) + ["--random-seed", "0"], log_dir=tmp_path,
                        startup_timeout_s=600) as handle:
        real = scores(handle.urls[0], waves)
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
