"""`arbor serve`: the embedded engine behind the subset of SGLang's native HTTP API arbor uses.

Run:  python -m arbor.engines.embedded.server --model PATH [--host 127.0.0.1] [--port 30000]
      (``arbor serve --model PATH`` calls :func:`main`.)

Endpoints (request / response fields as SGLang 0.5 names them):
- ``POST /generate`` ``{"input_ids": [..] | [[..], ..], "text": str | [str], "sampling_params":
  {max_new_tokens, temperature, top_p, top_k, n, stop_token_ids, sampling_seed},
  "return_logprob", "top_logprobs_num", "logprob_start_len"}`` -> one object, or a list for
  batches / ``n > 1`` (prompt-major). ``logprob_start_len: k`` with ``max_new_tokens: 0`` scores
  the prompt: ``meta_info.input_token_logprobs`` as SGLang's (:mod:`arbor.engines.embedded.scoring`). ``top_logprobs_num > 0`` returns each output token's exact entropy as
  ``meta_info.output_token_entropy`` (an arbor field) instead of SGLang's top-k lists.
  ``max_new_tokens: 0`` commits the prompt into the radix cache and returns no tokens.
- ``POST /update_weights_from_disk`` ``{model_path, weight_version?}``;
  ``POST /init_weights_update_group`` ``{master_address, master_port, rank_offset, world_size,
  group_name, backend}`` (the group built as SGLang builds it) + ``POST
  /update_weights_from_distributed`` ``{names, dtypes, shapes, group_name, flush_cache,
  weight_version?, load_format?}`` (the learner is rank 0 and broadcasts each tensor, or the
  whole list as one ``"flattened_bucket"``), allowed only between ``POST /begin_weight_update``
  and ``POST /end_weight_update`` (400 outside, 400 on a second begin), as in SGLang 0.5.23;
- ``POST /load_lora_adapter`` ``{lora_name, lora_path}`` (a peft directory, merged into the
  weights: :mod:`arbor.engines.embedded.lora`), ``/unload_lora_adapter`` ``{lora_name}``,
  ``/update_weight_version`` ``{new_version}``; ``/generate``'s ``lora_path`` names the adapter;
- ``POST /flush_cache``, ``/release_memory_occupation``, ``/resume_memory_occupation``;
- ``GET /model_info`` (= ``/get_model_info``), ``/get_weight_version``, ``/server_info`` (=
  ``/get_server_info``: ``tp_size`` 1 and engine counters), ``/health``, ``/health_generate``.
Malformed requests get ``400 {"error": {"message": ...}}`` and the server keeps serving; a
failure of the server's own (a bug, an engine that stopped) is ``500`` with the exception's
type and message, its traceback in the server's log.

Keys (:mod:`arbor.engines.auth`, SGLang's rules): with ``ARBOR_ENGINE_API_KEY`` (and/or
``ARBOR_ENGINE_ADMIN_API_KEY``) in the server's environment, requests need ``Authorization:
Bearer <key>`` (401 without); the weight, cache and memory endpoints are SGLang's admin ones;
``/health*`` stays open. Without a key the server is open, and warns unless on loopback.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import threading
import time
from dataclasses import replace
from typing import Any

import torch
from aiohttp import web

from arbor.engines.auth import (
    ADMIN_API_KEY_ENV,
    API_KEY_ENV,
    Level,
    middleware,
    unprotected_warning,
)
from arbor.engines.distributed import DEFAULT_GROUP, WeightUpdateGroup
from arbor.engines.embedded.engine import LocalEngine
from arbor.engines.embedded.jobs import EngineReleased
from arbor.engines.embedded.lora import add_lora_routes
from arbor.engines.embedded.request_body import (
    BadRequest,
    checking_request,
    json_body,
    parse_sampling_params,
    prompt_ids,
)
from arbor.engines.ports import free_port
from arbor.engines.types import GenerateOutput, GenerateRequest, SamplingParams

log = logging.getLogger(__name__)

# The endpoints SGLang 0.5.23 marks ADMIN_OPTIONAL (they change weights, cache or memory);
# the rest are NORMAL, /health* open.
ADMIN_PATHS = (
    "/update_weights_from_disk", "/init_weights_update_group", "/destroy_weights_update_group",
    "/update_weights_from_distributed", "/begin_weight_update", "/end_weight_update",
    "/flush_cache", "/release_memory_occupation", "/resume_memory_occupation",
    "/load_lora_adapter", "/unload_lora_adapter", "/update_weight_version",
)


def _error(status: int, message: str) -> web.Response:
    body = {"error": {"message": message, "code": status}}
    return web.json_response(body, status=status)


class ServerState:
    """What the handlers share: the engine, its tokenizer, the weight-update group."""

    def __init__(self, engine: LocalEngine, tokenizer: Any) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.group = WeightUpdateGroup()
        self.updating = False  # inside /begin_weight_update ... /end_weight_update

    def to_json(self, out: GenerateOutput, return_logprob: bool, latency: float) -> dict[str, Any]:
        finish: dict[str, Any] = {"type": out.finish_reason}
        if out.finish_reason == "stop" and out.output_ids:
            finish["matched"] = out.output_ids[-1]
        elif out.finish_reason == "length":
            finish["length"] = len(out.output_ids)
        meta: dict[str, Any] = {
            "finish_reason": finish,
            "prompt_tokens": out.prompt_tokens,
            "completion_tokens": len(out.output_ids),
            "cached_tokens": out.cached_tokens,
            "weight_version": out.weight_version,
            "e2e_latency": latency,
        }
        if return_logprob:
            meta["output_token_logprobs"] = [
                [lp, tok, None] for lp, tok in zip(out.logprobs, out.output_ids)
            ]
        if out.entropies is not None:
            meta["output_token_entropy"] = out.entropies
        text = self.tokenizer.decode(out.output_ids) if self.tokenizer is not None else ""
        return {"text": text, "output_ids": out.output_ids, "meta_info": meta}


async def score_replies(
    state: ServerState, prompts: list[list[int]], params: list[SamplingParams], starts: Any
) -> list[dict[str, Any]]:
    """SGLang's replies to prefill-only requests for input-token log-probs
    (:mod:`arbor.engines.embedded.scoring`), scored in order: a prompt sent after its prefix
    finds the prefix cached."""
    starts = starts if isinstance(starts, list) else [starts] * len(prompts)
    if len(starts) != len(prompts) or not all(isinstance(k, int) and not isinstance(k, bool) for k in starts):
        raise BadRequest(f"logprob_start_len must be an int or one per prompt, got {starts!r}")
    if any(sp.max_new_tokens != 0 or sp.n != 1 for sp in params):
        raise BadRequest("arbor serve returns input_token_logprobs only for prefill-only requests "
                         "(max_new_tokens 0, n 1)")
    loop = asyncio.get_running_loop()
    items = []
    for prompt, sp, start in zip(prompts, params, starts):
        with checking_request():
            values, cached = await loop.run_in_executor(None, state.engine.score, prompt, start, sp.temperature)
        meta = {
            "finish_reason": {"type": "length", "length": 0}, "prompt_tokens": len(prompt),
            "completion_tokens": 0, "cached_tokens": cached, "weight_version": state.engine.weight_version,
            "input_token_logprobs": [[v, t, None] for v, t in zip(values, prompt[start:])],
            "output_token_logprobs": [],
        }
        items.append({"text": "", "output_ids": [], "meta_info": meta})
    return items


def build_app(
    engine: LocalEngine, tokenizer: Any = None, *, api_key: str | None = None,
    admin_api_key: str | None = None,
) -> web.Application:
    """The HTTP app; requests need the keys given (SGLang's ``--api-key``/``--admin-api-key``).

    Long on purpose: one short route per SGLang endpoint, each reading the shared ``state``
    and wrapped by ``handler``, listed in one place as SGLang's own ``http_server.py`` does;
    a route is read on its own, never the function as a whole."""
    state = ServerState(engine, tokenizer)
    levels = dict.fromkeys(ADMIN_PATHS, Level.ADMIN_OPTIONAL)
    app = web.Application(client_max_size=1 << 28, middlewares=[middleware(api_key, admin_api_key, levels)])
    routes = web.RouteTableDef()

    def handler(fn):
        """An invalid request (BadRequest) is 400, a released engine 409, and any other
        exception the server's own failure: 500, its traceback logged."""

        async def wrapped(request: web.Request) -> web.StreamResponse:
            try:
                return await fn(request)
            except BadRequest as exc:
                return _error(400, str(exc))
            except EngineReleased as exc:
                return _error(409, str(exc))
            except Exception as exc:  # noqa: BLE001 -- answered and logged, the server keeps serving
                log.exception("%s %s failed inside arbor serve", request.method, request.path)
                return _error(500, f"internal server error: {type(exc).__name__}: {exc} (traceback in the server log)")

        return wrapped

    @routes.post("/generate")
    @handler
    async def generate(request: web.Request) -> web.Response:
        body = await json_body(request)
        if body.get("stream"):
            raise BadRequest("stream is not supported by arbor serve")
        prompts, batch = prompt_ids(body, state.tokenizer)
        raw_params = body.get("sampling_params")
        params = (
            [parse_sampling_params(p) for p in raw_params] if isinstance(raw_params, list) else None
        )
        if params is not None and len(params) != len(prompts):
            raise BadRequest(f"{len(params)} sampling_params for {len(prompts)} prompts")
        if params is None:
            params = [parse_sampling_params(raw_params)] * len(prompts)
        starts = body.get("logprob_start_len")
        if body.get("return_logprob") and starts not in (None, -1):  # a teacher's scoring request
            items = await score_replies(state, prompts, params, starts)
            return web.json_response(items if batch or len(items) > 1 else items[0])
        # top_logprobs_num > 0 (the client's request for entropies) is answered with the
        # exact per-token entropy ("output_token_entropy"), not SGLang's top-k lists.
        top = body.get("top_logprobs_num") or 0
        tops = top if isinstance(top, list) else [top] * len(prompts)
        if len(tops) != len(prompts) or not all(isinstance(k, int) and k >= 0 for k in tops):
            raise BadRequest(f"top_logprobs_num must be an int >= 0 or one per prompt, got {top!r}")
        params = [replace(sp, return_entropy=True) if k > 0 else sp for sp, k in zip(params, tops)]
        requests = [GenerateRequest(p, sp) for p, sp in zip(prompts, params)]
        adapters = body.get("lora_path")  # SGLang's: one name for all prompts, or one each
        with checking_request():
            engine.adapters.check_requested(adapters if isinstance(adapters, list) else [adapters] * len(prompts))
            for r in requests:
                engine.validate(r)
        start = time.perf_counter()
        results = await asyncio.gather(*(engine.generate(r) for r in requests))
        latency = time.perf_counter() - start
        return_logprob = bool(body.get("return_logprob", False))
        items = [state.to_json(o, return_logprob, latency) for outs in results for o in outs]
        if not batch and len(items) == 1:
            return web.json_response(items[0])
        return web.json_response(items)

    def refused(message: str) -> web.Response:
        """SGLang's answer to a weight call it refuses: 400 with success false."""
        return web.json_response({"success": False, "message": message}, status=400)

    @routes.post("/update_weights_from_disk")
    @handler
    async def update_from_disk(request: web.Request) -> web.Response:
        body = await json_body(request)
        path = body.get("model_path")
        if not isinstance(path, str):
            raise BadRequest("model_path must be a string")
        version = body.get("weight_version")
        loop = asyncio.get_running_loop()
        try:
            await loop.run_in_executor(None, engine.load_weights, path, version)
        except (OSError, ValueError) as exc:
            return web.json_response({"success": False, "message": str(exc)}, status=400)
        return web.json_response(
            {"success": True, "message": f"loaded {path}", "num_paused_requests": 0}
        )

    add_lora_routes(routes, engine, handler, refused)  # /load_lora_adapter, /unload_lora_adapter

    @routes.post("/update_weight_version")
    @handler
    async def update_weight_version(request: web.Request) -> web.Response:
        version = (await json_body(request)).get("new_version")
        if not isinstance(version, str) or not version:
            raise BadRequest("new_version must be a non-empty string")
        engine.weight_version = version
        return web.json_response({"success": True, "message": f"weight version {version}"})

    @routes.post("/init_weights_update_group")
    @handler
    async def init_group(request: web.Request) -> web.Response:
        body = await json_body(request)
        loop = asyncio.get_running_loop()
        with checking_request():
            message = await loop.run_in_executor(None, state.group.init_from_request, body)
        return web.json_response({"success": True, "message": message})

    @routes.post("/destroy_weights_update_group")
    @handler
    async def destroy_group(request: web.Request) -> web.Response:
        name = (await json_body(request)).get("group_name", DEFAULT_GROUP)
        if name != state.group.group_name:
            return refused(f"no weight update group {name!r} to destroy")
        state.group.destroy()
        return web.json_response({"success": True, "message": "destroyed"})

    def session(opening: bool) -> Any:
        """``/begin_weight_update`` (opening) or ``/end_weight_update``: one session at a time."""

        async def switch(request: web.Request) -> web.Response:
            if state.updating == opening:
                return refused(
                    "a weight-update session is already open; call end_weight_update() first"
                    if opening
                    else "no weight-update session is open; call begin_weight_update() first"
                )
            state.updating = opening
            return web.json_response({"success": True, "message": "Success"})

        return switch

    routes.post("/begin_weight_update")(session(True))
    routes.post("/end_weight_update")(session(False))

    @routes.post("/update_weights_from_distributed")
    @handler
    async def update_distributed(request: web.Request) -> web.Response:
        body = await json_body(request)
        if not state.updating:  # refused before joining any broadcast, as SGLang does
            return refused("update_weights_from_distributed must run between "
                           "begin_weight_update() and end_weight_update()")
        loop = asyncio.get_running_loop()
        with checking_request():  # names, shapes and dtypes the model does not have
            tensors = await loop.run_in_executor(None, state.group.receive, body)
            flush = bool(body.get("flush_cache", True))
            version = body.get("weight_version")
            await loop.run_in_executor(None, lambda: engine.load_weights(tensors, version, flush=flush))
        return web.json_response({"success": True, "message": f"updated {len(tensors)} tensors"})

    @routes.route("*", "/flush_cache")
    @handler
    async def flush_cache(request: web.Request) -> web.Response:
        engine.flush_cache()
        return web.Response(text="Cache flushed.\n")

    @routes.post("/release_memory_occupation")
    @handler
    async def release(request: web.Request) -> web.Response:
        engine.release_memory()
        return web.json_response({"success": True})

    @routes.post("/resume_memory_occupation")
    @handler
    async def resume(request: web.Request) -> web.Response:
        engine.resume_memory()
        return web.json_response({"success": True})

    async def model_info(request: web.Request) -> web.Response:
        return web.json_response(
            {
                "model_path": engine.model_path,
                "tokenizer_path": engine.model_path if tokenizer is not None else None,
                "is_generation": True,
                "weight_version": engine.weight_version,
                "vocab_size": engine.vocab_size,
                "max_context_length": engine.max_context,
                "eos_token_ids": sorted(engine.eos_token_ids),
            }
        )

    routes.get("/model_info")(model_info)
    routes.get("/get_model_info")(model_info)

    @routes.get("/get_weight_version")
    async def weight_version(request: web.Request) -> web.Response:
        return web.json_response({"weight_version": engine.weight_version})

    async def server_info(request: web.Request) -> web.Response:
        stats = engine.stats
        return web.json_response(
            {
                "engine": "arbor",
                "tp_size": 1,
                "dp_size": 1,
                "model_path": engine.model_path,
                "weight_version": engine.weight_version,
                "cached_tokens_in_cache": engine.cache.num_tokens,
                "max_cached_tokens": engine.cache.max_tokens,
                "prefill_tokens": stats.prefill_tokens,
                "cached_tokens": stats.cached_tokens,
                "decode_tokens": stats.decode_tokens,
                "requests": stats.requests,
                "decode_steps": stats.decode_steps,
                "row_steps": stats.row_steps,
            }
        )

    routes.get("/server_info")(server_info)
    routes.get("/get_server_info")(server_info)

    @routes.get("/health")
    async def health(request: web.Request) -> web.Response:
        return web.Response(text="")

    @routes.get("/health_generate")
    @handler
    async def health_generate(request: web.Request) -> web.Response:
        await engine.generate(GenerateRequest([0], SamplingParams(max_new_tokens=1)))
        return web.Response(text="")

    app.add_routes(routes)
    return app


def load_engine(args: argparse.Namespace) -> tuple[LocalEngine, Any]:
    torch.manual_seed(args.seed)
    engine = LocalEngine(
        args.model,
        device=args.device,
        dtype=args.dtype,
        max_cached_tokens=args.max_cached_tokens,
        seed=args.seed,
    )
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.model)
    except (OSError, ValueError):  # a model directory without a tokenizer: ids only
        tokenizer = None
    return engine, tokenizer


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="arbor serve", description=__doc__.splitlines()[0])
    parser.add_argument("--model", "--model-path", dest="model", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--max-cached-tokens", type=int, default=1 << 20)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


# A trainer opens one connection per concurrent request (hundreds at a round's start);
# aiohttp's default listen backlog of 128 would drop the rest into TCP's 1 s SYN retry.
BACKLOG = 2048


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # From the environment, not flags: a command line is visible to every user (ps).
    api_key, admin_api_key = os.environ.get(API_KEY_ENV) or None, os.environ.get(ADMIN_API_KEY_ENV) or None
    warning = unprotected_warning(args.host, api_key, admin_api_key)
    if warning:
        print(warning, file=sys.stderr, flush=True)
    engine, tokenizer = load_engine(args)
    app = build_app(engine, tokenizer, api_key=api_key, admin_api_key=admin_api_key)
    keyed = " (bearer key required)" if api_key or admin_api_key else ""
    print(f"arbor serve: {args.model} on http://{args.host}:{args.port}{keyed}", flush=True)
    web.run_app(
        app, host=args.host, port=args.port, print=None, handle_signals=True,
        shutdown_timeout=2.0, backlog=BACKLOG,
    )
    engine.shutdown()
    return 0


class ServerThread:
    """Serve an engine on a free port from a background thread (tests, notebooks).

    with ServerThread(LocalEngine(path), tokenizer) as url:  # "http://127.0.0.1:PORT"
        ...
    """

    def __init__(
        self, engine: LocalEngine, tokenizer: Any = None, host: str = "127.0.0.1", *,
        api_key: str | None = None, admin_api_key: str | None = None,
    ) -> None:
        self.engine, self.tokenizer, self.host = engine, tokenizer, host
        self.keys = {"api_key": api_key, "admin_api_key": admin_api_key}
        self.port = free_port(host)
        self.url = f"http://{host}:{self.port}"
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        runner = web.AppRunner(build_app(self.engine, self.tokenizer, **self.keys))
        self._loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, self.host, self.port, backlog=BACKLOG)
        self._loop.run_until_complete(site.start())
        self._runner = runner
        self._ready.set()
        self._loop.run_forever()
        self._loop.run_until_complete(runner.cleanup())

    def __enter__(self) -> str:
        self._thread.start()
        if not self._ready.wait(30):
            raise RuntimeError("arbor server thread did not start within 30 s")
        return self.url

    def __exit__(self, *exc: object) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)


if __name__ == "__main__":
    raise SystemExit(main())
