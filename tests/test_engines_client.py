"""SGLangClient transport: retries, 4xx, timeouts, prefix affinity, fan-out, parsing.

A small fake SGLang server (aiohttp, in the test's event loop) fails on purpose.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from arbor.config_load import load_config
from arbor.engines.client import SGLangClient
from arbor.engines.connect import engine_client
from arbor.engines.errors import EngineError
from arbor.engines.ports import free_port
from arbor.engines.types import GenerateRequest, SamplingParams
from arbor.engines.wire import generate_payload, parse_output


def sglang_item(ids: list[int], cached: int = 0) -> dict:
    return {
        "text": "",
        "output_ids": ids,
        "meta_info": {
            "finish_reason": {"type": "length", "length": len(ids)},
            "prompt_tokens": 3,
            "cached_tokens": cached,
            "output_token_logprobs": [[-0.5 * (i + 1), t, None] for i, t in enumerate(ids)],
            "weight_version": "7",
        },
    }


class FakeServer:
    """Answers /generate after ``fail_first`` 503s (or a fixed status); records bodies."""

    def __init__(self, fail_first: int = 0, status: int = 200, delay_s: float = 0.0):
        self.fail_first, self.status, self.delay_s = fail_first, status, delay_s
        self.bodies: list[dict] = []
        self.calls: Counter[str] = Counter()

    async def generate(self, request: web.Request) -> web.Response:
        self.calls["/generate"] += 1
        self.bodies.append(await request.json())
        await asyncio.sleep(self.delay_s)
        if self.calls["/generate"] <= self.fail_first:
            return web.json_response({"error": {"message": "busy"}}, status=503)
        if self.status != 200:
            return web.json_response({"error": {"message": "bad ids"}}, status=self.status)
        body = self.bodies[-1]
        if isinstance(body["sampling_params"], dict) and body["sampling_params"].get("max_new_tokens") == 0:
            return web.json_response([sglang_item([]) for _ in body["input_ids"]])  # a prefix commit
        if isinstance(body["input_ids"][0], list):  # a batch: one item per prompt (n = 1)
            assert all(p.get("n", 1) == 1 for p in body["sampling_params"])
            return web.json_response([sglang_item([p[0], 5]) for p in body["input_ids"]])
        n = body["sampling_params"].get("n", 1)
        items = [sglang_item([4 + i, 5]) for i in range(n)]
        return web.json_response(items if n > 1 else items[0])

    async def simple(self, request: web.Request) -> web.Response:
        self.calls[request.path] += 1
        if request.path == "/get_weight_version":
            return web.json_response({"weight_version": "7"})
        return web.json_response({"success": True, "message": "ok"})

    async def start(self) -> tuple[str, web.AppRunner]:
        app = web.Application()
        app.router.add_post("/generate", self.generate)
        for path in ("/flush_cache", "/update_weights_from_disk"):
            app.router.add_post(path, self.simple)
        app.router.add_get("/get_weight_version", self.simple)
        app.router.add_get("/health", self.simple)
        runner = web.AppRunner(app)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        return f"http://127.0.0.1:{port}", runner


@contextlib.asynccontextmanager
async def fake_servers(count: int) -> AsyncIterator[tuple[list[FakeServer], list[str]]]:
    """``count`` running FakeServers and their URLs, cleaned up on exit."""
    fakes = [FakeServer() for _ in range(count)]
    started = [await f.start() for f in fakes]
    try:
        yield fakes, [url for url, _ in started]
    finally:
        for _, runner in started:
            await runner.cleanup()


REQUEST = GenerateRequest(
    [1, 2, 3], SamplingParams(max_new_tokens=2, n=1, seed=5, stop_token_ids=[9])
)


def test_payload_and_parsing_follow_sglang_fields():
    payload = generate_payload(REQUEST)
    assert payload == {
        "input_ids": [1, 2, 3],
        "sampling_params": {
            "max_new_tokens": 2,
            "temperature": 1.0,
            "top_p": 1.0,
            "top_k": -1,
            "n": 1,
            "stop_token_ids": [9],
            "sampling_seed": 5,
        },
        "return_logprob": True,
    }  # no logprob_start_len: asking for prompt logprobs disables prefix reuse
    out = parse_output(sglang_item([4, 5], cached=2))
    assert (out.output_ids, out.logprobs, out.finish_reason) == ([4, 5], [-0.5, -1.0], "length")
    assert (out.prompt_tokens, out.cached_tokens, out.weight_version) == (3, 2, "7")


def test_retries_5xx_then_succeeds():
    async def main():
        fake = FakeServer(fail_first=2)
        url, runner = await fake.start()
        try:
            async with SGLangClient([url], max_retries=3, backoff_s=0.01) as client:
                outs = await client.generate(REQUEST)
        finally:
            await runner.cleanup()
        return fake, outs

    fake, outs = asyncio.run(main())
    assert fake.calls["/generate"] == 3 and outs[0].output_ids == [4, 5]


def test_gives_up_after_max_retries_and_never_retries_4xx():
    async def main():
        busy, bad = FakeServer(fail_first=100), FakeServer(status=400)
        (busy_url, r1), (bad_url, r2) = await busy.start(), await bad.start()
        try:
            async with SGLangClient([busy_url], max_retries=2, backoff_s=0.01) as client:
                with pytest.raises(EngineError, match="after 3 attempts"):
                    await client.generate(REQUEST)
            async with SGLangClient([bad_url], max_retries=5, backoff_s=0.01) as client:
                with pytest.raises(EngineError, match="bad ids") as info:
                    await client.generate(REQUEST)
        finally:
            await r1.cleanup()
            await r2.cleanup()
        return busy, bad, info.value

    busy, bad, error = asyncio.run(main())
    assert busy.calls["/generate"] == 3
    assert bad.calls["/generate"] == 1 and error.status == 400


def test_connection_refused_is_retried_until_the_server_comes_up():
    async def main():
        fake = FakeServer()
        port = free_port()
        client = SGLangClient([f"http://127.0.0.1:{port}"], max_retries=6, backoff_s=0.05)

        async def start_late():
            await asyncio.sleep(0.2)  # the first attempts meet a closed port
            app = web.Application()
            app.router.add_post("/generate", fake.generate)
            runner = web.AppRunner(app)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", port).start()
            return runner

        starter = asyncio.create_task(start_late())
        try:
            outs = await client.generate(REQUEST)
        finally:
            await client.close()
            await (await starter).cleanup()
        return outs

    assert asyncio.run(main())[0].output_ids == [4, 5]


def test_a_server_that_stays_down_is_reported_unreachable_and_never_restarted_by_the_client():
    """Once the retries are spent the client raises, naming the server; restarting it is the
    run's decision (arbor.run.recovery), not the client's. A 4xx is the request's fault."""

    async def main():
        url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
        async with SGLangClient([url], max_retries=1, backoff_s=0.01) as client:
            with pytest.raises(EngineError) as down:
                await client.generate(REQUEST)
        bad = FakeServer(status=400)
        bad_url, runner = await bad.start()
        try:
            async with SGLangClient([bad_url], max_retries=1, backoff_s=0.01) as client:
                with pytest.raises(EngineError) as refused:
                    await client.generate(REQUEST)
        finally:
            await runner.cleanup()
        return url, down.value, refused.value

    url, down, refused = asyncio.run(main())
    assert (down.unreachable, down.server, down.status) == (True, url, None) and "after 2 attempts" in str(down)
    assert (refused.unreachable, refused.status) == (False, 400)


def test_requests_name_their_lora_adapter_one_name_per_batch_or_one_per_prompt():
    async def main():
        async with fake_servers(1) as (fakes, urls), SGLangClient(urls) as client:
            await client.generate(GenerateRequest([1], SamplingParams(2), adapter="arbor-lora-3"))
            await client.generate(GenerateRequest([1], SamplingParams(2)))
            await client.generate_many([GenerateRequest([i], SamplingParams(2, n=2), adapter="arbor-lora-3")
                                        for i in (1, 2)])
            await client.generate_many([GenerateRequest([7], SamplingParams(2), adapter=name)
                                        for name in ("arbor-lora-2", "arbor-lora-3")])
        return fakes[0].bodies

    single, base, commit, forks, mixed = asyncio.run(main())
    assert single["lora_path"] == "arbor-lora-3" and "lora_path" not in base
    # The forks' prompt is committed to the cache under the adapter they sample from.
    assert commit["lora_path"] == forks["lora_path"] == "arbor-lora-3"
    assert mixed["lora_path"] == ["arbor-lora-2", "arbor-lora-3"]


def test_engine_client_is_built_from_the_engine_section():
    cfg = load_config(None, ["engine.kind=external", "engine.urls=[http://10.0.0.1:30000]", "engine.api_key=k",
                             "engine.request_timeout_s=7", "engine.max_retries=2"])
    client = engine_client(cfg.engine, ["http://10.0.0.1:30000/"])
    assert (client.urls, client.timeout_s, client.max_retries) == (["http://10.0.0.1:30000"], 7, 2)
    assert client._headers == {"Authorization": "Bearer k"}


def test_timeout_raises():
    async def main():
        fake = FakeServer(delay_s=0.6)
        url, runner = await fake.start()
        try:
            async with SGLangClient([url], timeout_s=0.1, max_retries=0) as client:
                with pytest.raises(EngineError, match="TimeoutError|attempts"):
                    await client.generate(REQUEST)
        finally:
            await runner.cleanup()

    asyncio.run(main())


def test_n_outputs_and_affinity_pins_a_tree_to_one_server():
    async def main():
        async with fake_servers(3) as (fakes, urls), SGLangClient(urls) as client:
            forks = await client.generate(
                GenerateRequest([1000], SamplingParams(2, n=3), affinity_key="tree-1")
            )
            trees = [f"tree-{i}" for i in range(30)]
            requests = [
                GenerateRequest([i], SamplingParams(2), affinity_key=key)
                for i, key in enumerate(trees)
                for _ in range(2)
            ]
            await client.generate_many(requests)
            chosen = {key: client.server_for(key) for key in trees}
            again = {key: SGLangClient(urls).server_for(key) for key in trees}
            smaller = SGLangClient(urls[:2])
            moved = [
                k for k in trees if chosen[k] in urls[:2] and smaller.server_for(k) != chosen[k]
            ]
            await client.flush_cache()
            versions = await client.get_weight_version()
        return fakes, urls, forks, chosen, again, moved, versions

    fakes, urls, forks, chosen, again, moved, versions = asyncio.run(main())
    assert [o.output_ids for o in forks] == [[4, 5], [5, 5], [6, 5]]
    assert chosen == again and len(set(chosen.values())) == 3  # stable, and spread out
    for fake, url in zip(fakes, urls):
        prompts = [p for b in fake.bodies for p in (b["input_ids"] if isinstance(b["input_ids"][0], list) else [b["input_ids"]])]
        seen = Counter(p[0] for p in prompts)
        mine = {i for i in range(30) if chosen[f"tree-{i}"] == url}
        # Both requests of each tree reached its server, and no other tree's did.
        assert {i: c for i, c in seen.items() if i < 30} == {i: 2 for i in mine}
    assert moved == []  # rendezvous hashing: removing a server moves only its own keys
    assert all(f.calls["/flush_cache"] == 1 for f in fakes) and versions == ["7"] * 3


def test_one_client_across_event_loops():
    fake = FakeServer()

    async def once(client: SGLangClient):
        url, runner = await fake.start()
        client.urls = [url]
        try:
            return (await client.generate(REQUEST))[0].output_ids
        finally:
            await runner.cleanup()

    client = SGLangClient(["http://unused"])
    assert asyncio.run(once(client)) == [4, 5]
    assert asyncio.run(once(client)) == [4, 5]  # a fresh loop gets a fresh session


def test_generate_many_sends_one_batch_per_server_with_forks_as_seeded_items():
    async def main():
        async with fake_servers(2) as (fakes, urls), SGLangClient(urls) as client:
            requests = [
                GenerateRequest([10 + i], SamplingParams(2, n=2, seed=100 * i), f"tree-{i % 4}")
                for i in range(8)
            ]
            results = await client.generate_many(requests)
            homes = [client.server_for(r.affinity_key) for r in requests]
            calls = [fake.calls["/generate"] for fake in fakes]
            # The same prompts again, and children of the first round's outputs: all cached.
            children = [GenerateRequest([10 + i, 10 + i, 5], SamplingParams(2, n=2), f"tree-{i % 4}") for i in range(8)]
            await client.generate_many(requests + children)
            again = [fake.calls["/generate"] - before for fake, before in zip(fakes, calls)]
        return fakes, urls, results, homes, calls, again

    fakes, urls, results, homes, calls, again = asyncio.run(main())
    # Two forks per request, in request order (the fake echoes each prompt's first id).
    assert [[o.output_ids[0] for o in outs] for outs in results] == [[10 + i] * 2 for i in range(8)]
    for fake, url, first_round, second_round in zip(fakes, urls, calls, again):
        mine = [i for i in range(8) if homes[i] == url]
        if not mine:
            assert fake.calls["/generate"] == 0
            continue
        # The uncached prompts committed once (max_new_tokens 0), then the whole round in
        # one call; the second round finds every prefix cached: one call.
        assert (first_round, second_round) == (2, 1)
        commit, body = fake.bodies[0], fake.bodies[1]
        assert commit == {"input_ids": [[10 + i] for i in mine], "sampling_params": {"max_new_tokens": 0}}
        assert body["input_ids"] == [[10 + i] for i in mine for _ in range(2)]
        assert [p["sampling_seed"] for p in body["sampling_params"]] == [
            100 * i + j for i in mine for j in range(2)
        ]



def test_forks_of_an_uncached_prompt_all_find_it_cached(tmp_path):
    """Against a real `arbor serve`: the committed prompt is in the cache for every fork."""
    from tiny_model import build_tiny_model_dir

    from arbor.engines.embedded.engine import LocalEngine
    from arbor.engines.embedded.server import ServerThread

    engine = LocalEngine(build_tiny_model_dir(tmp_path / "tiny"))
    prompt = list(range(3, 35))

    async def forks(url: str) -> list[int]:
        async with SGLangClient([url]) as client:
            (outs,) = await client.generate_many([GenerateRequest(prompt, SamplingParams(4, n=4, seed=1))])
            return [out.cached_tokens for out in outs]

    try:
        with ServerThread(engine) as url:
            # Every fork reuses the whole prompt but the last token (which it recomputes).
            assert asyncio.run(forks(url)) == [len(prompt) - 1] * 4
    finally:
        engine.shutdown()
