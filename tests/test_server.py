"""`arbor serve` HTTP surface: SGLang's request/response shapes, errors, weight transfer.

The server runs in a thread of the test process (``ServerThread``) so tests can look at
the engine directly; the subprocess path is covered by test_client_contract.py.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import textwrap

import aiohttp
import pytest
import torch
from tiny_model import build_tiny_model_dir
from transformers import AutoModelForCausalLM, AutoTokenizer

from arbor.engines.embedded.engine import LocalEngine
from arbor.engines.embedded.server import ServerThread, parse_args

PROMPT = [17, 42, 99, 5, 63, 120, 7, 88]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("server")
    model_a = build_tiny_model_dir(root / "a", seed=0)
    model_b = build_tiny_model_dir(root / "b", seed=1)
    engine = LocalEngine(model_a)
    with ServerThread(engine, AutoTokenizer.from_pretrained(model_a)) as url:
        yield url, engine, model_b
    engine.shutdown()


def call(url: str, method: str, path: str, body=None, raw: bytes | None = None, key: str | None = None):
    """(status, decoded body) of one HTTP call (with ``Authorization: Bearer key`` when given)."""

    async def main():
        async with aiohttp.ClientSession() as session:
            data = raw if raw is not None else (None if body is None else json.dumps(body))
            headers = {"Content-Type": "application/json"}
            if key is not None:
                headers["Authorization"] = f"Bearer {key}"
            async with session.request(method, url + path, data=data, headers=headers) as resp:
                text = await resp.text()
                try:
                    return resp.status, json.loads(text)
                except json.JSONDecodeError:
                    return resp.status, text

    return asyncio.run(main())


def test_generate_shapes_single_n_and_batch(served):
    url = served[0]
    status, one = call(url, "POST", "/generate", {"input_ids": PROMPT, "return_logprob": True})
    assert status == 200 and isinstance(one, dict)
    meta = one["meta_info"]
    assert meta["completion_tokens"] == len(one["output_ids"]) <= 128
    assert [t for _, t, _ in meta["output_token_logprobs"]] == one["output_ids"]
    assert meta["finish_reason"]["type"] in ("stop", "length")
    assert isinstance(one["text"], str)

    params = {"max_new_tokens": 3, "n": 2, "sampling_seed": 1}
    status, forks = call(url, "POST", "/generate", {"input_ids": PROMPT, "sampling_params": params})
    assert (
        status == 200 and len(forks) == 2 and "output_token_logprobs" not in forks[0]["meta_info"]
    )

    batch = {"input_ids": [PROMPT, PROMPT[:3]], "sampling_params": params}
    status, items = call(url, "POST", "/generate", batch)
    assert status == 200 and [i["meta_info"]["prompt_tokens"] for i in items] == [8, 8, 3, 3]

    per_prompt = [{"max_new_tokens": 1}, {"max_new_tokens": 4, "temperature": 0}]
    status, items = call(
        url, "POST", "/generate", {"input_ids": [PROMPT, PROMPT], "sampling_params": per_prompt}
    )
    assert status == 200 and [len(i["output_ids"]) for i in items][0] == 1


def test_text_prompts_are_tokenised_server_side(served):
    url = served[0]
    tokenizer = AutoTokenizer.from_pretrained(served[1].model_path)
    body = {"text": "the answer is 4", "sampling_params": {"max_new_tokens": 0}}
    status, out = call(url, "POST", "/generate", body)
    assert status == 200 and out["output_ids"] == []
    assert out["meta_info"]["prompt_tokens"] == len(tokenizer("the answer is 4")["input_ids"])
    # The commit put the prompt in the cache: the same text now hits it.
    body["sampling_params"] = {"max_new_tokens": 2}
    status, out = call(url, "POST", "/generate", body)
    assert out["meta_info"]["cached_tokens"] == out["meta_info"]["prompt_tokens"] - 1
    status, outs = call(
        url, "POST", "/generate", {"text": ["a b", "c"], "sampling_params": body["sampling_params"]}
    )
    assert status == 200 and len(outs) == 2


@pytest.mark.parametrize(
    ("raw", "fragment"),
    [
        (b"", "empty"),
        (b"{not json", "JSON"),
        (b"[1, 2]", "object"),
        (b'{"input_ids": [1, -2]}', "outside"),
        (b'{"input_ids": [[1, 2], []]}', "non-empty"),
        (b'{"input_ids": [1, 2.5]}', "integer"),
        (b'{"input_ids": [1], "sampling_params": {"n": 0}}', "n must"),
        (b'{"input_ids": [1], "sampling_params": {"top_k": 0}}', "top_k"),
        (b'{"input_ids": [1], "sampling_params": {"stop_token_ids": 3}}', "stop_token_ids"),
        (b'{"input_ids": [1], "sampling_params": [{}, {}]}', "2 sampling_params"),
        (b'{"input_ids": [1], "stream": true}', "stream"),
        (b'{"text": 5}', "text"),
        (b'{"sampling_params": {}}', "input_ids or text"),
    ],
)
def test_malformed_generate_is_400_with_a_message(served, raw, fragment):
    status, body = call(served[0], "POST", "/generate", raw=raw)
    assert status == 400, body
    assert fragment in body["error"]["message"]
    assert call(served[0], "GET", "/health")[0] == 200


def test_info_endpoints(served):
    url, engine, _ = served
    status, info = call(url, "GET", "/model_info")
    assert status == 200 and info["model_path"] == engine.model_path and info["is_generation"]
    assert call(url, "GET", "/get_model_info")[1] == info
    assert call(url, "GET", "/get_weight_version")[1] == {"weight_version": engine.weight_version}
    assert call(url, "GET", "/health_generate")[0] == 200
    status, stats = call(url, "GET", "/get_server_info")
    assert stats["prefill_tokens"] > 0 and stats["decode_tokens"] > 0
    assert call(url, "POST", "/update_weights_from_disk", {"model_path": 3})[0] == 400
    assert call(url, "GET", "/no_such_endpoint")[0] == 404


def test_release_resume_and_flush(served):
    url, engine, _ = served
    call(url, "POST", "/generate", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 0}})
    assert engine.cache.num_tokens > 0
    assert call(url, "POST", "/flush_cache")[0] == 200 and engine.cache.num_tokens == 0
    assert call(url, "POST", "/release_memory_occupation", {})[0] == 200
    status, body = call(url, "POST", "/generate", {"input_ids": PROMPT})
    assert status == 409 and "released" in body["error"]["message"]
    assert call(url, "POST", "/resume_memory_occupation", {})[0] == 200
    assert call(url, "POST", "/generate", {"input_ids": PROMPT})[0] == 200


LEARNER = textwrap.dedent(
    """
    import asyncio, os, sys
    from transformers import AutoModelForCausalLM
    from arbor.engines.client import SGLangClient
    from arbor.run.weight_sync import WeightSync
    from arbor.train.weight_sync import named_tensor_buckets
    url, model_dir = sys.argv[1], sys.argv[2]
    state = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()

    async def main():
        async with SGLangClient([url]) as client:
            sync = WeightSync(client, master_address="127.0.0.1")
            await sync.push(named_tensor_buckets(iter(state.items()), bucket_mb=0.05), "dist-1")
            print("sent", len(state), sync._load_format, await client.get_weight_version(), flush=True)
            print("group", sync.group_name, flush=True)

    asyncio.run(main())
    # Skip interpreter teardown: destroying a gloo group whose peer still holds it can
    # abort() the process after the work is done (a real learner keeps its group open).
    os._exit(0)
    """
)


def test_update_weights_from_distributed_with_a_learner_process(served):
    """A separate learner process joins as rank 0 and sends model B's weights in flat buckets."""
    url, engine, model_b = served
    state_b = AutoModelForCausalLM.from_pretrained(model_b).state_dict()
    learner = subprocess.run(
        [sys.executable, "-c", LEARNER, url, str(model_b)], capture_output=True, text=True, timeout=120
    )
    assert learner.returncode == 0, learner.stdout + learner.stderr
    assert f"sent {len(state_b)} flattened_bucket ['dist-1']" in learner.stdout
    served_state = engine.model.state_dict()
    for name, tensor in state_b.items():
        assert torch.equal(served_state[name], tensor), name  # bit-exact
    assert engine.cache.num_tokens == 0  # flushed with the new weights
    assert call(url, "POST", "/destroy_weights_update_group", {"group_name": "other"})[0] == 400
    group_name = learner.stdout.split("group ")[1].split()[0]
    assert call(url, "POST", "/destroy_weights_update_group", {"group_name": group_name})[0] == 200


def test_weight_updates_only_inside_a_session(served):
    """SGLang 0.5.23's rules: updates between begin and end only, one session at a time."""
    url, _, _ = served
    update = {"names": ["x"], "dtypes": ["float32"], "shapes": [[1]]}
    status, body = call(url, "POST", "/update_weights_from_distributed", update)
    assert status == 400 and body["success"] is False and "begin_weight_update" in body["message"]
    assert call(url, "POST", "/end_weight_update", {}) [0] == 400  # nothing to end
    assert call(url, "POST", "/begin_weight_update", {}) == (200, {"success": True, "message": "Success"})
    status, body = call(url, "POST", "/begin_weight_update", {})
    assert status == 400 and "already open" in body["message"]
    assert call(url, "POST", "/end_weight_update", {})[0] == 200
    info = call(url, "GET", "/server_info")[1]
    assert (info["engine"], info["tp_size"]) == ("arbor", 1)


def test_cli_arguments():
    args = parse_args(["--model", "m", "--port", "5", "--max-cached-tokens", "7"])
    assert (args.model, args.port, args.max_cached_tokens, args.host) == ("m", 5, 7, "127.0.0.1")
    with pytest.raises(SystemExit):
        parse_args(["--port", "5"])  # --model is required


def test_a_failure_of_the_servers_own_is_500_with_a_logged_traceback(tmp_path, caplog):
    """A valid request the server cannot serve (here: its engine was shut down under it)
    is the server's failure, not the client's: 500 naming the exception, traceback in the
    log, and the server keeps answering. An invalid request on the same server stays 400."""
    engine = LocalEngine(build_tiny_model_dir(tmp_path / "m", seed=0))
    with ServerThread(engine, None) as url:
        engine.shutdown()
        with caplog.at_level("ERROR", logger="arbor.engines.embedded.server"):
            status, body = call(url, "POST", "/generate", {"input_ids": PROMPT})
        assert status == 500, body
        assert body["error"]["message"].startswith("internal server error: RuntimeError: engine is shut down")
        [record] = [r for r in caplog.records if "POST /generate failed inside arbor serve" in r.getMessage()]
        assert record.exc_info is not None and record.exc_info[0] is RuntimeError
        assert call(url, "POST", "/generate", {"input_ids": [1, -2]})[0] == 400
        assert call(url, "GET", "/health")[0] == 200


def test_a_malformed_weight_update_is_400_not_500(served):
    """The weight group's own checks of a request are the client's mistakes."""
    url = served[0]
    status, body = call(url, "POST", "/init_weights_update_group", {"backend": "mpi"})
    assert status == 400 and "backend must be 'gloo' or 'nccl'" in body["error"]["message"]
