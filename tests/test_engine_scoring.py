"""Input-token log-probs (a teacher scoring tokens it did not sample): `arbor serve` answers
SGLang's prefill-only ``/generate`` with ``logprob_start_len``, and the client reads it.

Checked against the model's own float64-free forward (float32 both sides) at a temperature
≠ 1, and for the cache: a child scored after its parent computes only its own tokens and the
one before them, as SGLang's radix cache would.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from tiny_model import build_tiny_model_dir
from transformers import AutoModelForCausalLM

from arbor.engines.client import SGLangClient
from arbor.engines.embedded.engine import LocalEngine
from arbor.engines.embedded.server import ServerThread
from arbor.engines.errors import EngineError
from arbor.engines.types import ScoreRequest
from arbor.engines.wire import parse_score, score_payload

PROMPT = [17, 42, 99, 5, 63, 120, 7, 88]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    model = build_tiny_model_dir(tmp_path_factory.mktemp("scoring") / "m", seed=0)
    engine = LocalEngine(model)
    with ServerThread(engine) as url:
        yield url, engine, model
    engine.shutdown()


def reference(model_dir, ids: list[int], temperature: float) -> list[float]:
    """log softmax(logits / T) of ids[i] given ids[:i], i = 1 .. len - 1, by one plain forward."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float() / temperature
    logprobs = torch.log_softmax(logits[:-1], dim=-1)
    return logprobs.gather(1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()


def score(url: str, requests: list[ScoreRequest]):
    async def main():
        async with SGLangClient(url) as client:
            return await client.score_many(requests)

    return asyncio.run(main())


def test_scores_are_the_models_at_the_temperature_and_cached_prefixes_are_reused(served):
    url, engine, model = served
    engine.flush_cache()
    expected = reference(model, PROMPT + [3, 4, 5], temperature=0.7)
    parent, child = PROMPT + [3], PROMPT + [3, 4, 5]
    (first,) = score(url, [ScoreRequest(parent, start=len(PROMPT), temperature=0.7)])
    assert first.cached_tokens == 0 and first.prompt_tokens == len(parent)
    assert first.logprobs == pytest.approx(expected[len(PROMPT) - 1 : len(PROMPT)], abs=1e-5)
    (second,) = score(url, [ScoreRequest(child, start=len(parent), temperature=0.7)])
    # Only the parent's last token is computed again (its row predicts the child's first token).
    assert second.cached_tokens == len(parent) - 1
    assert second.logprobs == pytest.approx(expected[len(parent) - 1 :], abs=1e-5)


def test_a_whole_sequence_scored_from_its_first_token(served):
    url, engine, model = served
    engine.flush_cache()
    (out,) = score(url, [ScoreRequest(PROMPT, start=1, temperature=1.0)])
    assert out.logprobs == pytest.approx(reference(model, PROMPT, 1.0), abs=1e-5)
    assert out.cached_tokens == 0


def test_sglangs_reply_shape_and_refusals(served):
    url = served[0]
    from test_server import call

    status, body = call(url, "POST", "/generate", {"input_ids": PROMPT, "return_logprob": True, "logprob_start_len": 5,
                                                   "sampling_params": {"max_new_tokens": 0}})
    assert status == 200 and body["output_ids"] == [] and body["meta_info"]["output_token_logprobs"] == []
    entries = body["meta_info"]["input_token_logprobs"]
    assert [e[1] for e in entries] == PROMPT[5:] and entries[0][0] is None and all(e[0] < 0 for e in entries[1:])
    status, body = call(url, "POST", "/generate", {"input_ids": PROMPT, "return_logprob": True, "logprob_start_len": 5})
    assert status == 400 and "prefill-only" in body["error"]["message"]
    status, body = call(url, "POST", "/generate", {"input_ids": PROMPT, "return_logprob": True,
                                                   "logprob_start_len": 8, "sampling_params": {"max_new_tokens": 0}})
    assert status == 400 and "logprob_start_len" in body["error"]["message"]
    with pytest.raises(EngineError):
        score(url, [ScoreRequest(PROMPT, start=1, temperature=-1.0)])


def test_wire_round_trip():
    request = ScoreRequest([1, 2, 3, 4], start=2, temperature=0.5)
    payload = score_payload([request])
    assert payload["logprob_start_len"] == [1] and payload["sampling_params"][0] == {"max_new_tokens": 0,
                                                                                      "temperature": 0.5}
    reply = {"meta_info": {"input_token_logprobs": [[None, 2, None], [-0.5, 3, None], [-1.5, 4, None]],
                           "prompt_tokens": 4, "cached_tokens": 1}}
    out = parse_score(reply, request)
    assert out.logprobs == [-0.5, -1.5] and out.cached_tokens == 1
    with pytest.raises(ValueError, match="one more"):
        parse_score({"meta_info": {"input_token_logprobs": [[-0.5, 3, None]]}}, request)
    with pytest.raises(ValueError, match="start"):
        score_payload([ScoreRequest([1, 2], start=0)])
