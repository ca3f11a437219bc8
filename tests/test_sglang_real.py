"""arbor's engine client against a real SGLang 0.5.23 server (CPU engine, torch_native).

One server for the module (models/tiny-arith, float32, a 4,096-token KV pool, a bearer key),
started by arbor's own launcher with the interpreter in ``$ARBOR_SGLANG_PYTHON``
(tests/sglang_env.py: skipped without it locally, failed without it under CI). Every
endpoint arbor uses is exercised: generation in token ids with ``n``, log-probs and stop
ids, the shared-prompt commit, cache flushes while requests run, server info, health,
weight updates by broadcast (per tensor and flattened, in sessions) and from disk, pausing
around an update, aborts, and the key rules. Log-probs are checked against the learner's
own float32 forward of the same weights.
"""

from __future__ import annotations

import asyncio
import json
import urllib.request
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import pytest
import torch
from sglang_env import TINY_ARITH, sglang_python

from arbor.engines.client import SGLangClient, parse_output
from arbor.engines.errors import EngineError
from arbor.engines.launch import launch_engines, sglang_cpu_flags
from arbor.engines.types import GenerateRequest, SamplingParams
from arbor.run.weight_sync import WeightSync, probe_logprob_gap
from arbor.train.weight_sync import gathered_buckets

T = TypeVar("T")
KEY = "sglang-test-key-0123456789"
# float32 on both sides, different kernels (SGLang's torch_native attention vs the HF forward):
# what one token's log-prob may differ by (measured: ~1e-7 mean).
GAP_BOUND = 1e-4


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    python = sglang_python()
    logs = tmp_path_factory.mktemp("sglang-logs")
    with launch_engines(
        "sglang", model_path=str(TINY_ARITH), device="cpu", dtype="float32", python=python,
        extra_args=sglang_cpu_flags(4096) + ["--random-seed", "0"], log_dir=logs, startup_timeout_s=600,
        api_key=KEY,
    ) as handle:
        yield handle


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(TINY_ARITH)


def learner_model() -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(TINY_ARITH, dtype=torch.float32).eval()


def run(server, call: Callable[[SGLangClient], Awaitable[T]], **kw: Any) -> T:
    """``call(client)`` on a fresh keyed client (no seeds: SGLang's CPU engine ignores them)."""

    async def main() -> T:
        async with SGLangClient(server.urls, api_key=kw.pop("api_key", KEY), send_seeds=False, **kw) as client:
            return await call(client)

    return asyncio.run(main())


def prompt(tokenizer, text: str) -> list[int]:
    return tokenizer(text)["input_ids"]


def post(url: str, path: str, body: dict[str, Any], key: str | None = KEY) -> tuple[int, str]:
    request = urllib.request.Request(url + path, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json",
                                              **({"Authorization": f"Bearer {key}"} if key else {})})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


LONG = 240  # decode steps of long_generation's requests (the model's context is 256)


async def long_generation(url: str, ids: list[int], n: int = 16) -> list[dict[str, Any]]:
    """``n`` requests that each run ``LONG`` decode steps (EOS ignored), from a thread; the raw replies."""
    body = {"input_ids": ids, "return_logprob": True,
            "sampling_params": {"max_new_tokens": LONG, "ignore_eos": True, "n": n}}
    status, text = await asyncio.to_thread(post, url, "/generate", body)
    assert status == 200, text
    return json.loads(text)


async def started(url: str) -> None:
    """Until the server has a request running (``num_running_reqs`` in its ``/v1/loads``)."""

    def running(load: Any) -> int:
        if isinstance(load, dict):
            return sum(v if k == "num_running_reqs" else running(v) for k, v in load.items())
        return sum(map(running, load)) if isinstance(load, list) else 0

    for _ in range(1200):
        status, text = await asyncio.to_thread(get, url, "/v1/loads")
        if status == 200 and running(json.loads(text)["loads"]) > 0:
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the long request never started")


def get(url: str, path: str) -> tuple[int, str]:
    request = urllib.request.Request(url + path, headers={"Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return response.status, response.read().decode()


def test_health_server_info_and_model_info(server):
    assert run(server, lambda c: c.health())
    info, = run(server, lambda c: c.server_info())
    assert info["version"] == "0.5.23" and info["device"] == "cpu" and info["tp_size"] == 1
    assert info["attention_backend"] == "torch_native" and info["max_total_tokens"] == 4096
    model, = run(server, lambda c: c.model_info())
    assert model["model_path"] == str(TINY_ARITH) and model["weight_version"] == "default"


def test_generation_in_token_ids_with_n_logprobs_and_stop_ids(server, tokenizer):
    ids = prompt(tokenizer, "12+23=")
    outs = run(server, lambda c: c.generate(GenerateRequest(ids, SamplingParams(8, n=4))))
    assert len(outs) == 4
    for out in outs:
        assert 1 <= len(out.output_ids) == len(out.logprobs) <= 8
        assert all(lp <= 0 for lp in out.logprobs) and out.prompt_tokens == len(ids)
        assert out.finish_reason in ("length", "stop") and out.weight_version == "default"
    # Greedy twice: the same tokens; then stopping at the second greedy token ends there.
    greedy = SamplingParams(6, temperature=0.0)
    first, = run(server, lambda c: c.generate(GenerateRequest(ids, greedy)))
    again, = run(server, lambda c: c.generate(GenerateRequest(ids, greedy)))
    assert first.output_ids == again.output_ids and len(first.output_ids) >= 2
    stop = first.output_ids[1]
    stopped, = run(server, lambda c: c.generate(GenerateRequest(ids, SamplingParams(6, temperature=0.0, stop_token_ids=[stop]))))
    assert stopped.finish_reason == "stop" and stopped.output_ids[-1] == stop
    assert stopped.output_ids == first.output_ids[: first.output_ids.index(stop) + 1]


def test_engine_logprobs_are_the_learners(server, tokenizer):
    prompts = [prompt(tokenizer, f"{a}+{b}=") for a, b in [(3, 4), (12, 30), (7, 58)]]
    gap = run(server, lambda c: probe_logprob_gap(c, learner_model(), prompts, max_new_tokens=8))
    assert gap < GAP_BOUND


def test_forks_of_a_new_prompt_share_one_committed_prefill(server, tokenizer):
    ids = prompt(tokenizer, "41+17= Put the answer in \\boxed{}.")

    async def forks(client: SGLangClient):
        await client.flush_cache()
        return await client.generate_many([GenerateRequest(ids, SamplingParams(4, n=4))])

    outs, = run(server, forks)
    # The prompt was committed first (max_new_tokens 0), so every fork finds it cached
    # (all but its last token, which the fork's own forward needs).
    assert [out.cached_tokens for out in outs] == [len(ids) - 1] * 4


def test_flush_is_retried_while_requests_run(server, tokenizer):
    ids = prompt(tokenizer, "5+5=")

    async def flush_while_generating(client: SGLangClient):
        long = asyncio.ensure_future(long_generation(server.urls[0], ids))
        await started(server.urls[0])
        refused = await asyncio.to_thread(post, server.urls[0], "/flush_cache", {})  # what SGLang answers now
        await client.flush_cache()
        return refused, long.done(), await long

    (status, text), finished, replies = run(server, flush_while_generating)
    # SGLang 0.5.23 says only "Flush cache failed." (the reason, pending requests, goes to its log).
    assert (status, text) == (400, "Flush cache failed.\n")
    assert finished and [len(r["output_ids"]) for r in replies] == [LONG] * 16  # the client's flush waited
    again, = run(server, lambda c: c.generate(GenerateRequest(ids, SamplingParams(1))))
    assert again.cached_tokens == 0  # flushed


def perturbed(model: torch.nn.Module, scale: float) -> torch.nn.Module:
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("weight") and param.dim() == 2:
                param.mul_(scale)
    return model


@pytest.mark.parametrize("flatten", [True, False], ids=["flattened", "per-tensor"])
def test_weights_by_broadcast_in_sessions_move_the_logprobs(server, tokenizer, flatten):
    prompts = [prompt(tokenizer, "9+8=")]
    model = perturbed(learner_model(), 1.5 if flatten else 0.7)
    version = "flat-1" if flatten else "tensor-1"

    async def push_and_probe(client: SGLangClient):
        sync = WeightSync(client, master_address="127.0.0.1", flatten=flatten)
        try:
            await sync.push(gathered_buckets(model, zero_stage=0, bucket_mb=0.05), version=version)
            assert await client.get_weight_version() == [version]
            return await probe_logprob_gap(client, model, prompts, max_new_tokens=8), \
                await probe_logprob_gap(client, learner_model(), prompts, max_new_tokens=8)
        finally:
            await sync.close()

    new_gap, old_gap = run(server, push_and_probe)
    assert new_gap < GAP_BOUND < old_gap  # the engine now serves the pushed weights, not the old ones


def test_weights_from_disk_and_an_update_while_requests_run(server, tokenizer, tmp_path):
    ids = prompt(tokenizer, "6+6=")
    model = perturbed(learner_model(), 1.2)
    model.save_pretrained(tmp_path / "pushed")

    async def update_while_generating(client: SGLangClient):
        sync = WeightSync(client)
        before, = await client.get_weight_version()
        long = asyncio.ensure_future(long_generation(server.urls[0], ids))
        await started(server.urls[0])
        await sync.push_directory(tmp_path / "pushed", version="disk-1")  # pauses generation around it
        replies = await long
        gap = await probe_logprob_gap(client, model, [ids], max_new_tokens=8)
        await sync.push_directory(TINY_ARITH, version="default")  # the module's other tests expect it
        return before, replies, gap

    before, replies, gap = run(server, update_while_generating)
    assert gap < GAP_BOUND
    # Requests that ran across the update were retracted, resumed with their KV recomputed
    # under the new weights, and list both; arbor tags each with its first token's weights.
    for reply in replies:
        spans = reply["meta_info"]["weight_versions"]
        assert [span["version"] for span in spans] == [before, "disk-1"] and spans[-1]["end"] == LONG
        out = parse_output(reply)
        assert out.weight_version == before and out.finish_reason == "length" and len(out.logprobs) == LONG


def test_an_aborted_request_comes_back_as_abort(server, tokenizer):
    ids = prompt(tokenizer, "2+2=")

    async def abort_while_generating(client: SGLangClient):
        long = asyncio.ensure_future(long_generation(server.urls[0], ids))
        await started(server.urls[0])
        status, _ = await asyncio.to_thread(post, server.urls[0], "/abort_request", {"abort_all": True})
        return status, await long

    status, replies = run(server, abort_while_generating)
    outs = [parse_output(reply) for reply in replies]  # what the sampler sees of segments the engine aborted
    assert status == 200 and [out.finish_reason for out in outs] == ["abort"] * 16
    assert all(len(out.output_ids) == len(out.logprobs) < LONG for out in outs)


def test_the_key_is_required_except_for_health(server, tokenizer):
    with urllib.request.urlopen(server.urls[0] + "/health", timeout=30) as response:
        assert response.status == 200  # no key needed
    with pytest.raises(EngineError, match="requires a bearer key") as keyless:
        run(server, lambda c: c.generate(GenerateRequest([1, 2, 3], SamplingParams(2))), api_key="wrong-key")
    assert keyless.value.status == 401
    status, _ = post(server.urls[0], "/flush_cache", {}, key=None)  # admin endpoints too
    assert status == 401
    assert KEY not in server.log_files[0].read_text()  # SGLang logs its server_args: redacted


def test_parse_output_reads_sglangs_version_spans():
    item = {"output_ids": [5, 6, 7], "meta_info": {
        "finish_reason": {"type": "length"}, "prompt_tokens": 4, "cached_tokens": 3, "weight_version": "2",
        "output_token_logprobs": [[-0.1, 5, None], [-0.2, 6, None], [-0.3, 7, None]],
        "weight_versions": [{"version": "1", "start": 0, "end": 2}, {"version": "2", "start": 2, "end": 3}]}}
    out = parse_output(item)
    assert out.weight_version == "1" and out.cached_tokens == 3 and out.logprobs == [-0.1, -0.2, -0.3]
