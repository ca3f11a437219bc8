"""SGLang's own weight-receiving code on CPU, behind the HTTP routes arbor's learner calls.

A real SGLang server needs a GPU; its weight-update group does not. Each tensor-parallel
rank is a worker process that joins the group with SGLang's ``init_custom_process_group``
(called with the arguments SGLang's model-runner ``WeightUpdater.init_weights_update_group``
gives it: ``rank = rank_offset + tp_rank``) and receives as its
``receive_weights_from_distributed`` does: one async broadcast per tensor, or SGLang's
``FlattenedTensorBucket.empty(...)`` + one broadcast + ``reconstruct_tensors()`` for
``load_format: "flattened_bucket"``. The front process answers with SGLang 0.5.23's
session rules (none, and no session routes, when ``--version`` is below 0.5.22) and reply shapes (scheduler ``SchedulerWeightUpdaterManager``,
``http_server.py``). Only the model load is left out: received tensors are kept and can
be dumped (``POST /dump {"path"}``, a test-only route) for a bit-exact comparison.

    $ARBOR_SGLANG_PYTHON tests/sglang_receiver.py --port P --tp-size 2 [--version 0.5.23]
    (SGLang's venv: scripts/sglang_cpu_env.sh DIR builds one)
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
from multiprocessing.connection import Connection
from typing import Any

import torch


def worker(tp_rank: int, conn: Connection) -> None:
    """One TP rank: runs SGLang's group code for each command the front sends."""
    from sglang.srt.utils.common import init_custom_process_group
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    groups: dict[str, Any] = {}
    weights: dict[str, torch.Tensor] = {}
    while True:
        command, body = conn.recv()
        try:
            if command == "init":
                groups[body["group_name"]] = init_custom_process_group(
                    backend=body.get("backend", "nccl"),
                    init_method=f"tcp://{body['master_address']}:{body['master_port']}",
                    world_size=body["world_size"],
                    rank=body["rank_offset"] + tp_rank,
                    group_name=body["group_name"],
                )
            elif command == "update":
                group = groups[body.get("group_name", "weight_update_group")]
                names, dtypes, shapes = body["names"], body["dtypes"], body["shapes"]
                if body.get("load_format") == "flattened_bucket":
                    bucket = FlattenedTensorBucket.empty(names, dtypes, shapes, "cpu")
                    torch.distributed.broadcast(bucket.get_flattened_tensor(), src=0, group=group)
                    received = bucket.reconstruct_tensors()
                else:
                    received, handles = [], []
                    for name, dtype, shape in zip(names, dtypes, shapes):
                        weight = torch.empty(shape, dtype=getattr(torch, dtype))
                        handles.append(torch.distributed.broadcast(weight, src=0, group=group, async_op=True))
                        received.append((name, weight))
                    for handle in handles:
                        handle.wait()
                weights.update((name, tensor.clone()) for name, tensor in received)
            elif command == "destroy":
                torch.distributed.destroy_process_group(groups.pop(body["group_name"]))
            elif command == "dump":
                torch.save(weights, f"{body['path']}/tp{tp_rank}.pt")
            conn.send((True, "ok"))
        except Exception as exc:  # noqa: BLE001 - reported to the front, which answers 400
            conn.send((False, f"{type(exc).__name__}: {exc}"))


def build_app(conns: list[Connection], tp_size: int, version: str) -> Any:
    import asyncio

    from aiohttp import web

    # Sessions came with SGLang 0.5.22: an older server has no such routes (404) and no rule.
    sessions = tuple(int(part) for part in version.split(".")[:3] if part.isdigit()) >= (0, 5, 22)
    state = {"session": False, "weight_version": "default"}
    routes = web.RouteTableDef()

    async def on_all_ranks(command: str, body: dict[str, Any]) -> tuple[bool, str]:
        def run() -> tuple[bool, str]:
            for conn in conns:
                conn.send((command, body))
            replies = [conn.recv() for conn in conns]
            failed = [message for ok, message in replies if not ok]
            return (not failed, failed[0] if failed else "ok")

        return await asyncio.to_thread(run)

    def reply(success: bool, message: str) -> web.Response:
        return web.json_response({"success": success, "message": message}, status=200 if success else 400)

    @routes.post("/init_weights_update_group")
    async def init_group(request: web.Request) -> web.Response:
        body = await request.json()
        body.setdefault("group_name", "weight_update_group")
        return reply(*await on_all_ranks("init", body))

    @routes.post("/destroy_weights_update_group")
    async def destroy_group(request: web.Request) -> web.Response:
        body = await request.json()
        body.setdefault("group_name", "weight_update_group")
        return reply(*await on_all_ranks("destroy", body))

    async def begin(request: web.Request) -> web.Response:
        if state["session"]:
            return reply(False, "a weight-update session is already open; call end_weight_update() first")
        state["session"] = True
        return reply(True, "Success")

    async def end(request: web.Request) -> web.Response:
        if not state["session"]:
            return reply(False, "no weight-update session is open; call begin_weight_update() first")
        state["session"] = False
        return reply(True, "Success")

    @routes.post("/update_weights_from_distributed")
    async def update(request: web.Request) -> web.Response:
        body = await request.json()
        if sessions and not state["session"]:
            return reply(False, "update_weights_from_distributed must run between "
                         "begin_weight_update() and end_weight_update()")
        success, message = await on_all_ranks("update", body)
        if success and body.get("weight_version") is not None:
            state["weight_version"] = body["weight_version"]
        return reply(success, message)

    @routes.post("/dump")
    async def dump(request: web.Request) -> web.Response:
        return reply(*await on_all_ranks("dump", await request.json()))

    @routes.get("/server_info")
    async def server_info(request: web.Request) -> web.Response:
        return web.json_response({"tp_size": tp_size, "dp_size": 1, "version": version})

    @routes.get("/get_weight_version")
    async def weight_version(request: web.Request) -> web.Response:
        return web.json_response({"weight_version": state["weight_version"]})

    @routes.get("/health")
    async def health(request: web.Request) -> web.Response:
        return web.Response(text="")

    if sessions:
        routes.post("/begin_weight_update")(begin)
        routes.post("/end_weight_update")(end)
    app = web.Application(client_max_size=1 << 30)
    app.add_routes(routes)
    return app


def main() -> None:
    from importlib.metadata import version

    # Imported once here, inherited by the forked TP ranks (an import costs seconds).
    import sglang.srt.utils.common  # noqa: F401
    import sglang.srt.weight_sync.tensor_bucket  # noqa: F401
    from aiohttp import web

    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--tp-size", type=int, default=1)
    parser.add_argument("--version", default=version("sglang"), help="what /server_info reports")
    args = parser.parse_args()
    context = mp.get_context("fork")  # before any group or thread exists in this process
    conns = []
    for tp_rank in range(args.tp_size):
        front, back = context.Pipe()
        context.Process(target=worker, args=(tp_rank, back), daemon=True).start()
        conns.append(front)
    web.run_app(build_app(conns, args.tp_size, args.version), host="127.0.0.1", port=args.port, print=None)


if __name__ == "__main__":
    main()
