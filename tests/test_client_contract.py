"""Client contract: what arbor relies on from an SGLang-API server, checked through the client.

By default the server is `arbor serve` (a real subprocess started by the launcher, with a
tiny random model). Set ``ARBOR_SGLANG_URL=http://host:port`` to run the same tests
against a real SGLang server instead; ``ARBOR_SGLANG_MODEL_PATH`` (the model it serves,
readable here) enables the logprob recompute there. Tests that need our tiny model's
files (weight reload) skip against SGLang.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
import torch
from tiny_model import build_tiny_model_dir

from arbor.engines.client import SGLangClient
from arbor.engines.errors import EngineError
from arbor.engines.launch import launch_engines
from arbor.engines.types import GenerateRequest, SamplingParams

SGLANG_URL = os.environ.get("ARBOR_SGLANG_URL")
PROMPT = [17, 42, 99, 5, 63, 120, 7, 88, 31, 200, 11, 54, 76, 150, 9, 33]  # valid in any vocab


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """(url, model_dir or None, alternative weights dir or None)."""
    if SGLANG_URL:
        model = os.environ.get("ARBOR_SGLANG_MODEL_PATH")
        yield SGLANG_URL.rstrip("/"), Path(model) if model else None, None
        return
    root = tmp_path_factory.mktemp("contract")
    model = build_tiny_model_dir(root / "model", seed=0)
    other = build_tiny_model_dir(root / "model-b", seed=1)
    with launch_engines(
        "embedded", model_path=str(model), log_dir=root / "logs", startup_timeout_s=120
    ) as handle:
        yield handle.urls[0], model, other


def run(server_url, make_call):
    async def main():
        async with SGLangClient([server_url], max_retries=1, backoff_s=0.05) as client:
            await client.flush_cache()  # every test starts cold
            return await make_call(client)

    return asyncio.run(main())


def request(ids, max_new_tokens=8, **sampling) -> GenerateRequest:
    return GenerateRequest(list(ids), SamplingParams(max_new_tokens=max_new_tokens, **sampling))


def test_fork_after_prefix_commit_prefills_prefix_once(server):
    url = server[0]

    async def call(client):
        commit = (await client.generate(request(PROMPT, 0)))[0]
        forks = await client.generate_many([request(PROMPT, 6, seed=i) for i in range(4)])
        return commit, [f[0] for f in forks]

    commit, forks = run(url, call)
    assert commit.output_ids == [] and commit.cached_tokens == 0
    for out in forks:
        assert out.cached_tokens >= len(PROMPT) - 1  # the prefix was computed once, by the commit
        assert len(out.output_ids) == len(out.logprobs) >= 1


def test_n_forks_share_one_prefill(server):
    outs = run(server[0], lambda c: c.generate(request(PROMPT, 6, n=4, seed=3)))
    assert len(outs) == 4
    # One prefill for the four: together they computed fewer than 2 prompts' worth.
    computed = sum(o.prompt_tokens - o.cached_tokens for o in outs)
    assert computed < 2 * len(PROMPT)
    assert len({tuple(o.output_ids) for o in outs}) > 1  # forks are different samples


def test_child_request_hits_parent_prefix_and_output(server):
    async def call(client):
        parent = (await client.generate(request(PROMPT, 12, seed=1, temperature=1.0)))[0]
        child_prompt = PROMPT + parent.output_ids
        child = (await client.generate(request(child_prompt, 4, seed=2)))[0]
        return parent, child

    parent, child = run(server[0], call)
    assert child.prompt_tokens == len(PROMPT) + len(parent.output_ids)
    assert child.cached_tokens >= len(PROMPT) - 1


def test_same_seed_same_tokens_regardless_of_batching(server):
    async def call(client):
        alone = (await client.generate(request(PROMPT, 10, seed=1234)))[0]
        await client.flush_cache()
        crowd = await client.generate_many(
            [request(PROMPT[:5], 14, seed=1), request(PROMPT, 10, seed=1234), request([3, 4], 3)]
        )
        return alone, crowd[1][0]

    alone, batched = run(server[0], call)
    assert alone.output_ids == batched.output_ids
    assert alone.logprobs == pytest.approx(batched.logprobs, abs=1e-4)


def test_logprobs_equal_teacher_forced_recompute(server):
    url, model_dir, _ = server
    if model_dir is None:
        pytest.skip("set ARBOR_SGLANG_MODEL_PATH to recompute logprobs against SGLang")
    from transformers import AutoModelForCausalLM

    outs = run(url, lambda c: c.generate(request(PROMPT, 12, n=2, seed=7)))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for out in outs:
        sequence = torch.tensor([PROMPT + out.output_ids])
        with torch.no_grad():
            logprobs = torch.log_softmax(model(sequence).logits[0].float(), dim=-1)
        rows = torch.arange(len(PROMPT) - 1, len(PROMPT) - 1 + len(out.output_ids))
        expected = logprobs[rows, torch.tensor(out.output_ids)]
        assert torch.allclose(torch.tensor(out.logprobs), expected, atol=1e-4), (
            out.logprobs,
            expected.tolist(),
        )


def test_stop_token_ends_the_segment(server):
    async def call(client):
        free = (await client.generate(request(PROMPT, 12, seed=5)))[0]
        stop_at = free.output_ids[3]
        stopped = (await client.generate(request(PROMPT, 12, seed=5, stop_token_ids=[stop_at])))[0]
        return free, stopped, stop_at

    free, stopped, stop_at = run(server[0], call)
    first = free.output_ids.index(stop_at)
    assert stopped.finish_reason == "stop"
    assert stopped.output_ids == free.output_ids[: first + 1]
    assert free.finish_reason in ("length", "stop")


@pytest.mark.parametrize(
    "body",
    [
        {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": -1}},
        {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": "many"}},
        {"input_ids": "1 2 3"},
        {"input_ids": [1, 10**9]},
        {"input_ids": [1, 2], "sampling_params": {"temperature": -1.0}},
        {},
    ],
)
def test_malformed_requests_get_4xx_and_server_keeps_serving(server, body):
    async def call(client):
        with pytest.raises(EngineError) as info:
            await client._call(client.urls[0], "POST", "/generate", body, retries=0)
        after = (await client.generate(request(PROMPT, 2)))[0]
        return info.value, after

    error, after = run(server[0], call)
    assert error.status is not None and 400 <= error.status < 500, error
    assert error.message
    assert len(after.output_ids) >= 1


def test_weight_update_from_disk_changes_outputs_bumps_version_and_flushes(server):
    url, model_dir, other_dir = server
    if other_dir is None:
        pytest.skip("needs the tiny model's alternative weights (arbor serve only)")

    async def call(client):
        before = (await client.generate(request(PROMPT, 8, seed=11, temperature=0.0)))[0]
        await client.update_weights_from_disk(str(other_dir), weight_version="step-1")
        after = (await client.generate(request(PROMPT, 8, seed=11, temperature=0.0)))[0]
        versions = await client.get_weight_version()
        with pytest.raises(EngineError):
            await client.update_weights_from_disk(str(other_dir / "missing"))
        await client.update_weights_from_disk(str(model_dir))  # back, for other tests
        restored = (await client.generate(request(PROMPT, 8, seed=11, temperature=0.0)))[0]
        return before, after, versions, restored

    before, after, versions, restored = run(url, call)
    assert before.weight_version != "step-1" and after.weight_version == "step-1"
    assert versions == ["step-1"]
    assert after.cached_tokens == 0  # the cache was flushed with the old weights
    assert after.output_ids != before.output_ids
    assert restored.output_ids == before.output_ids
    assert restored.weight_version not in ("step-1", before.weight_version)


def test_model_info_and_health(server):
    async def call(client):
        return await client.model_info(), await client.health()

    infos, healthy = run(server[0], call)
    assert healthy
    assert infos and "model_path" in infos[0]


def test_batched_round_equals_single_requests(server):
    """generate_many sends one batched /generate (n forks as n seeded items); each result
    equals the single request it stands for: fork j of a seeded request is seed + j."""

    async def call(client):
        await client.flush_cache()
        child = PROMPT + [5, 6, 7]
        batched = await client.generate_many(
            [request(PROMPT, 6, n=3, seed=11), request(child, 4, seed=40)]
        )
        await client.flush_cache()
        singles = [(await client.generate(request(PROMPT, 6, seed=11 + j)))[0] for j in range(3)]
        alone = (await client.generate(request(child, 4, seed=40)))[0]
        return batched, singles, alone

    batched, singles, alone = run(server[0], call)
    assert [len(outs) for outs in batched] == [3, 1]
    assert [o.output_ids for o in batched[0]] == [o.output_ids for o in singles]
    assert batched[1][0].output_ids == alone.output_ids
    for got, want in zip(batched[0] + batched[1], singles + [alone]):
        assert got.logprobs == pytest.approx(want.logprobs, abs=1e-4)
