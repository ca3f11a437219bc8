"""Embedded engine: radix KV cache, batched decoding, sampling, weights."""

from __future__ import annotations

import math
import time

import pytest
import torch
from tiny_model import build_tiny_model_dir

from arbor.engines.embedded.decode_batch import sample_token as _sample
from arbor.engines.embedded.engine import LocalEngine
from arbor.engines.embedded.radix_cache import TOKENS, RadixKVCache, stack_kv
from arbor.engines.types import GenerateRequest, SamplingParams

PROMPT = [17, 42, 99, 5, 63, 120, 7, 88, 31, 200, 11, 54]


def kv(tokens: list[int], layers: int = 2) -> torch.Tensor:
    """Fake KV whose entries encode the token id, so slices can be checked: [2, L, 1, T, 1]."""
    t = torch.tensor(tokens, dtype=torch.float32).view(1, -1, 1)
    return stack_kv([t + layer for layer in range(layers)], [-t - layer for layer in range(layers)])


def test_radix_cache_match_split_and_lru_eviction():
    cache = RadixKVCache(max_tokens=10)
    cache.insert([1, 2, 3, 4], kv([1, 2, 3, 4]))
    cache.insert([1, 2, 7], kv([1, 2, 7]))  # splits the edge after [1, 2]
    assert cache.num_tokens == 5
    hit = cache.match([1, 2, 3, 9])
    assert hit.length == 3
    assert hit.keys[1].flatten().tolist() == [2.0, 3.0, 4.0]  # layer 1 = token + 1
    assert hit.values[0].flatten().tolist() == [-1.0, -2.0, -3.0]
    assert cache.match([1, 2, 7, 8]).length == 3
    assert cache.match([5]).length == 0
    cache.match([1, 2, 7])  # [1, 2, 7] is now more recent than [.., 3, 4]
    cache.insert([9, 8, 7, 6, 5], kv([9, 8, 7, 6, 5]))  # 10 tokens: still fits
    assert cache.num_tokens == 10
    cache.insert([4, 4], kv([4, 4]))  # 12 > 10: evict the least recently used leaf [3, 4]
    assert cache.num_tokens == 10
    assert cache.match([1, 2, 3, 4]).length == 2
    assert cache.match([1, 2, 7]).length == 3 and cache.match([9, 8, 7, 6, 5]).length == 5
    cache.flush()
    assert cache.num_tokens == 0 and cache.match([1, 2]).length == 0


def test_radix_hit_is_edge_views_and_upto_truncates():
    cache = RadixKVCache(max_tokens=100)
    cache.insert([1, 2, 3, 4], kv([1, 2, 3, 4]))
    cache.insert([1, 2, 7, 8], kv([1, 2, 7, 8]))  # edges [1, 2] | [3, 4] and [7, 8]
    hit = cache.match([1, 2, 3, 4, 5])
    assert hit.length == 4 and [p.shape[TOKENS] for p in hit.parts] == [2, 2]
    assert hit.keys[0].flatten().tolist() == [1.0, 2.0, 3.0, 4.0]
    head = hit.upto(3)  # all but the last token, as a fork's row needs
    assert head.length == 3 and [p.shape[TOKENS] for p in head.parts] == [2, 1]
    assert head.values[1].flatten().tolist() == [-2.0, -3.0, -4.0]
    cache.insert([9] * 99, kv([9] * 99))  # evicts the [1, 2, ...] edges: the views live on
    assert cache.match([1, 2]).length == 0
    assert head.keys[0].flatten().tolist() == [1.0, 2.0, 3.0]
    with pytest.raises(ValueError, match="covers 3"):
        head.upto(4)


def test_sample_top_k_top_p_and_logprob_semantics():
    logits = torch.tensor([2.0, 1.0, 0.5, -1.0])
    gen = torch.Generator().manual_seed(0)
    seen = {_sample(logits, 1.0, 1.0, 2, gen)[0] for _ in range(200)}
    assert seen == {0, 1}  # top-2
    # top_p 0.5: the first token alone holds 0.61 of the mass
    assert {_sample(logits, 1.0, 0.5, -1, gen)[0] for _ in range(50)} == {0}
    token, logprob = _sample(logits, 2.0, 1.0, -1, gen)
    # logprob under the temperature-scaled distribution, before top-k/top-p (SGLang's default)
    assert logprob == pytest.approx(torch.log_softmax(logits / 2.0, -1)[token].item())
    token, logprob = _sample(logits, 0.0, 1.0, -1, gen)  # greedy
    assert token == 0 and logprob == pytest.approx(torch.log_softmax(logits, -1)[0].item())


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("local")
    return build_tiny_model_dir(root / "a", seed=0), build_tiny_model_dir(root / "b", seed=1)


@pytest.fixture()
def engine(model_dirs):
    eng = LocalEngine(model_dirs[0], max_cached_tokens=10_000)
    yield eng
    eng.shutdown()


def req(ids, max_new_tokens=8, **kw) -> GenerateRequest:
    return GenerateRequest(list(ids), SamplingParams(max_new_tokens=max_new_tokens, **kw))


def teacher_forced(engine: LocalEngine, prompt: list[int], output: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = engine.model(torch.tensor([prompt + output])).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    rows = torch.arange(len(prompt) - 1, len(prompt) - 1 + len(output))
    return logprobs[rows, torch.tensor(output)]


def test_batched_rows_of_different_lengths_match_teacher_forcing(engine):
    # Rows with different prompt lengths and cache hits decode in one left-padded batch.
    engine.generate_sync([req(PROMPT[:6], 0)])  # a partial cache hit for the first two
    requests = [
        req(PROMPT, 10, seed=1),
        req(PROMPT[:8], 10, seed=2, n=2),
        req([3, 1, 4], 10, seed=3),
        req(PROMPT[:2] + [9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9], 5, seed=4),
    ]
    results = engine.generate_sync(requests)
    assert [len(r) for r in results] == [1, 2, 1, 1]
    for request, outs in zip(requests, results):
        for out in outs:
            assert out.output_ids and len(out.logprobs) == len(out.output_ids)
            expected = teacher_forced(engine, request.input_ids, out.output_ids)
            assert torch.allclose(torch.tensor(out.logprobs), expected, atol=1e-4)
    assert results[0][0].cached_tokens == 6
    assert results[1][0].cached_tokens == 7  # PROMPT[:8] fully inside PROMPT's cached prompt


def test_seed_reproducible_regardless_of_batching_and_cache(engine):
    alone = engine.generate_sync([req(PROMPT, 12, seed=99, top_p=0.9, top_k=50)])[0][0]
    engine.flush_cache()
    crowd = engine.generate_sync(
        [req([5, 6], 20, seed=1), req(PROMPT, 12, seed=99, top_p=0.9, top_k=50), req(PROMPT, 3)]
    )
    assert crowd[1][0].output_ids == alone.output_ids
    other_seed = engine.generate_sync([req(PROMPT, 12, seed=100)])[0][0]
    assert other_seed.output_ids != alone.output_ids


def test_prompts_admitted_together_prefill_in_one_batch_and_match_each_alone(engine):
    """One admission's uncached prompts (different lengths; two sharing a cached prefix; one
    inside another; one twice) run as batched forwards, not one forward each, and sample what
    each samples alone: the same tokens, teacher-forced logprobs, and prompt tokens cached."""
    prompts = [PROMPT, PROMPT[:9] + [3, 3, 3], [5, 6, 7, 8], PROMPT[:7], [5, 6, 7, 8], [9, 1]]
    requests = [req(p, 6, seed=10 + i, n=2 if i == 1 else 1) for i, p in enumerate(prompts)]
    alone = []
    for r in requests:
        engine.flush_cache()
        alone.append(engine.generate_sync([r])[0])
    engine.flush_cache()
    engine.generate_sync([req(PROMPT[:5], 0)])  # a cached prefix shared by the first, second and fourth
    calls = []
    hook = engine.model.base_model.register_forward_hook(lambda *_: calls.append(1))
    try:
        before = engine.stats.prefill_tokens
        together = engine.generate_sync(requests)
    finally:
        hook.remove()
    # Two groups (the cached PROMPT[:5], and no cached prefix), one forward each.
    assert len(calls) == 2
    for request, outs, outs_alone in zip(requests, together, alone):
        assert [o.output_ids for o in outs] == [o.output_ids for o in outs_alone]
        for out in outs:
            expected = teacher_forced(engine, request.input_ids, out.output_ids)
            assert torch.allclose(torch.tensor(out.logprobs), expected, atol=1e-4)
    # PROMPT[:7] is inside PROMPT and the second [5, 6, 7, 8] equals the first: neither ran.
    assert [outs[0].cached_tokens for outs in together] == [5, 5, 0, 6, 3, 0]
    ran = (12 - 5) + (12 - 5) + 4 + 2  # each prompt that ran, past its cached prefix
    fed = 2  # PROMPT[:7] and the second [5, 6, 7, 8] feed their last token in a decode step
    assert engine.stats.prefill_tokens - before == ran + fed


def test_forks_share_prefill_and_children_hit_the_cache(engine):
    before = engine.stats.prefill_tokens
    forks = engine.generate_sync([req(PROMPT, 6, n=4, seed=0)])[0]
    assert engine.stats.prefill_tokens - before == len(PROMPT)  # prefilled once for 4 forks
    assert [f.cached_tokens for f in forks] == [0] + [len(PROMPT)] * 3
    child_prompt = PROMPT + forks[2].output_ids
    child = engine.generate_sync([req(child_prompt, 4)])[0][0]
    # The finished fork's prompt + output (minus its last token) was cached.
    assert child.cached_tokens == len(child_prompt) - 1


def test_stop_tokens_eos_and_length(engine):
    out = engine.generate_sync([req(PROMPT, 16, seed=3)])[0][0]
    stop = out.output_ids[4]
    first = out.output_ids.index(stop)
    stopped = engine.generate_sync([req(PROMPT, 16, seed=3, stop_token_ids=[stop])])[0][0]
    assert stopped.output_ids == out.output_ids[: first + 1] and stopped.finish_reason == "stop"
    short = engine.generate_sync([req(PROMPT, 2, seed=3)])[0][0]
    assert short.output_ids == out.output_ids[:2] and short.finish_reason == "length"
    assert engine.eos_token_ids == {0}  # from the model config
    engine.eos_token_ids = {out.output_ids[2]}  # pretend the third token is EOS
    eos = engine.generate_sync([req(PROMPT, 16, seed=3)])[0][0]
    assert eos.output_ids[-1] == out.output_ids[2] and eos.finish_reason == "stop"
    assert len(eos.output_ids) <= 3


def test_bounded_cache_evicts(model_dirs):
    eng = LocalEngine(model_dirs[0], max_cached_tokens=20)
    try:
        eng.generate_sync([req(PROMPT, 4, seed=0)])
        assert eng.cache.num_tokens <= 20
        eng.generate_sync([req([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], 4, seed=0)])
        assert eng.cache.num_tokens <= 20
        again = eng.generate_sync([req(PROMPT, 1)])[0][0]
        assert again.cached_tokens < len(PROMPT) - 1  # the old prompt was (partly) evicted
    finally:
        eng.shutdown()


def test_load_weights_from_directory_flushes_and_bumps_version(engine, model_dirs):
    greedy = req(PROMPT, 8, temperature=0.0)
    before = engine.generate_sync([greedy])[0][0]
    assert before.weight_version == "default"
    engine.load_weights(model_dirs[1])
    after = engine.generate_sync([greedy])[0][0]
    assert after.weight_version == "1" and after.cached_tokens == 0
    assert after.output_ids != before.output_ids
    engine.load_weights(model_dirs[0], weight_version="back")
    assert engine.generate_sync([greedy])[0][0].output_ids == before.output_ids
    assert engine.weight_version == "back"
    with pytest.raises(ValueError, match="unknown parameter"):
        engine.load_weights({"not.a.weight": torch.zeros(1)})


@pytest.mark.parametrize(
    ("request_", "message"),
    [
        (req([], 4), "empty"),
        (req([1, 10_000], 4), "outside"),
        (req([1], -1), "max_new_tokens"),
        (req([1], 4, n=0), "n must"),
        (req([1], 4, top_p=0.0), "top_p"),
        (req([1], 4, top_k=0), "top_k"),
        (req([1], 5000), "context"),
        (req([1], 4, temperature=float("nan")), "temperature"),
        (req([1], 4, n=10_000), "max_batch_rows"),
    ],
)
def test_invalid_requests_raise_naming_the_problem(engine, request_, message):
    with pytest.raises(ValueError, match=message):
        engine.submit(request_)


def test_release_and_resume(engine):
    engine.generate_sync([req(PROMPT, 2)])
    engine.release_memory()
    assert engine.cache.num_tokens == 0
    with pytest.raises(RuntimeError, match="released"):
        engine.generate_sync([req(PROMPT, 2)])
    engine.resume_memory()
    assert len(engine.generate_sync([req(PROMPT, 2)])[0][0].output_ids) >= 1


def test_arrivals_join_a_running_batch_and_leave_when_done(engine):
    engine.eos_token_ids = set()  # the long request must run its full length
    long_request = req(PROMPT, 200, seed=8)
    alone = engine.generate_sync([long_request])[0][0]
    engine.flush_cache()
    long_future = engine.submit(long_request)
    while engine.stats.decode_tokens < 200 + 5:  # the long one is decoding now
        time.sleep(0.001)
    short_request = req([3, 1, 4, 1, 5, 9, 2, 6], 5, seed=1)
    short = engine.submit(short_request).result(timeout=60)[0]
    assert not long_future.done()  # the short one joined mid-batch and left first
    assert len(short.output_ids) == 5
    expected = teacher_forced(engine, short_request.input_ids, short.output_ids)
    assert torch.allclose(torch.tensor(short.logprobs), expected, atol=1e-4)
    assert long_future.result(timeout=60)[0].output_ids == alone.output_ids


def test_fully_cached_prompts_skip_prefill_and_sample_the_same_tokens(engine):
    cold = engine.generate_sync([req(PROMPT, 6, n=3, seed=21)])[0]  # prefill path
    engine.flush_cache()
    engine.generate_sync([req(PROMPT, 0)])  # commit the prefix
    before = engine.stats.prefill_tokens
    warm = engine.generate_sync([req(PROMPT, 6, n=3, seed=21)])[0]  # rows join the batch
    assert engine.stats.prefill_tokens - before == 3  # only the last prompt token, per row
    assert [o.cached_tokens for o in warm] == [len(PROMPT) - 1] * 3
    assert [o.output_ids for o in warm] == [o.output_ids for o in cold]
    for out in warm:
        expected = teacher_forced(engine, PROMPT, out.output_ids)
        assert torch.allclose(torch.tensor(out.logprobs), expected, atol=1e-4)


def test_commit_with_n_and_any_integer_seed(engine):
    commits = engine.generate_sync([req(PROMPT, 0, n=3)])[0]
    assert [c.output_ids for c in commits] == [[], [], []]
    big = engine.generate_sync([req(PROMPT, 4, seed=2**80 + 5), req(PROMPT, 4, seed=-7)])
    assert all(len(outs[0].output_ids) >= 1 for outs in big)


def test_shutdown_answers_every_request(model_dirs):
    eng = LocalEngine(model_dirs[0])
    eng.eos_token_ids = set()
    futures = [eng.submit(req(PROMPT, 50, seed=i)) for i in range(3)]
    eng.shutdown()
    for future in futures:  # finished, or failed with a reason: never left hanging
        assert future.done()
        assert future.exception() is None or "shut down" in str(future.exception())
    with pytest.raises(RuntimeError, match="shut down"):
        eng.submit(req(PROMPT, 2))


def test_entropies_equal_the_teacher_forced_sampling_distribution(engine):
    # Asked for, each output token's entropy is that of softmax(logits / T) at its position, in
    # a batch with a row that did not ask (and gets None); T = 0 (greedy) is measured at T = 1.
    requests = [req(PROMPT, 6, seed=1, temperature=0.7, return_entropy=True), req(PROMPT[:5], 6, seed=2),
                req([3, 1, 4], 4, temperature=0.0, return_entropy=True)]
    results = engine.generate_sync(requests)
    assert results[1][0].entropies is None
    for request, temperature in ((requests[0], 0.7), (requests[2], 1.0)):
        out = engine.generate_sync([request])[0][0]
        prompt = request.input_ids
        with torch.no_grad():
            logits = engine.model(torch.tensor([prompt + out.output_ids])).logits[0].float()
        logp = torch.log_softmax(logits[len(prompt) - 1 : -1] / temperature, dim=-1)
        expected = -(logp.exp() * logp).sum(dim=-1)
        assert len(out.entropies) == len(out.output_ids)
        assert torch.allclose(torch.tensor(out.entropies), expected, atol=1e-4)
    assert results[0][0].entropies == pytest.approx(engine.generate_sync([requests[0]])[0][0].entropies, abs=1e-5)


def test_token_entropies_by_hand():
    from arbor.engines.embedded.decode_batch import token_entropies

    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [0.0, -math.inf, -math.inf, -math.inf]])
    assert token_entropies(logits, [1.0, 1.0]) == pytest.approx([math.log(4), 0.0])
    # T = 0.5 doubles the logits: [log 2, 0] -> p = [2/3, 1/3] -> 0.6365.
    two = torch.tensor([[math.log(2) / 2, 0.0]])
    assert token_entropies(two, [0.5]) == pytest.approx([0.6365141683])
