"""LoRA sync against a real SGLang 0.5.23 server on the CPU (skipped without one, failed under
CI: tests/sglang_env.py).

Set ``ARBOR_SGLANG_PYTHON`` to the python of an environment that serves SGLang on a CPU
(e.g. one built by ``scripts/sglang_cpu_env.sh``); the test starts its server with LoRA on
(``--enable-lora --max-lora-rank --lora-target-modules --lora-backend torch_native``) and
``tests/sglang_cpu_pinless`` on its path (SGLang's LoRA code pins host memory, which needs
CUDA: that module's docstring names the lines). Then arbor's own calls push adapters:
``/load_lora_adapter`` under a new name per version, ``/flush_cache``,
``/update_weight_version``, ``/unload_lora_adapter`` of the oldest, requests naming the
adapter (``GenerateRequest.adapter``, sent as ``lora_path``, single and batched), and the logprob
gap to the peft model.
"""

import asyncio
import os
import subprocess
import time
from pathlib import Path

import pytest
import torch
from sglang_env import sglang_python
from test_lora_sync import MovingAdapter
from transformers import AutoModelForCausalLM

from arbor.config_load import load_config
from arbor.engines.client import SGLangClient
from arbor.engines.embedded.server import free_port
from arbor.engines.errors import EngineError
from arbor.engines.types import GenerateRequest, SamplingParams
from arbor.run.weight_sync import WeightSync, adapter_name, lora_engine_flags, probe_logprob_gap

REPO = Path(__file__).resolve().parents[1]
MODEL = REPO / "models" / "tiny-arith"
RANK = 8
MODEL_CFG = load_config(None, [f"model.path={MODEL}", f"model.lora_rank={RANK}"]).model


@pytest.fixture(scope="module")
def sglang_url(tmp_path_factory):
    python = sglang_python()
    port = free_port()
    log = tmp_path_factory.mktemp("sglang") / "server.log"
    env = dict(os.environ, SGLANG_USE_CPU_ENGINE="1", OMP_NUM_THREADS="1",
               PYTHONPATH=str(Path(__file__).parent / "sglang_cpu_pinless"))
    command = [python, "-m", "sglang.launch_server", "--model-path", str(MODEL), "--device", "cpu",
               "--attention-backend", "torch_native", "--dtype", "float32", "--disable-overlap-schedule",
               "--max-total-tokens", "2048", "--host", "127.0.0.1", "--port", str(port),
               "--lora-backend", "torch_native", *lora_engine_flags(MODEL_CFG)]  # the flags arbor starts SGLang with
    with open(log, "w") as out:
        server = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while "The server is fired up" not in log.read_text():
            if server.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"SGLang did not start:\n{log.read_text()[-3000:]}")
            time.sleep(2)
        yield url
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()


def test_adapters_load_serve_and_unload_on_sglang(sglang_url, tmp_path):
    moving = MovingAdapter(MODEL, tmp_path, rank=RANK, alpha=16, scale=0.05)
    learner, move_adapter, write = moving.model, moving.move, moving.write
    base = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()
    prompts = [[5, 6, 7, 8], [9, 10, 11, 12, 13]]

    async def main():
        async with SGLangClient([sglang_url], timeout_s=300) as client:
            sync = WeightSync(client)
            move_adapter()
            out = {"base": await probe_logprob_gap(client, base, prompts),
                   "before": await probe_logprob_gap(client, learner, prompts), "gaps": [], "sent": []}
            for version in ("1", "2", "3"):
                out["sent"].append(await sync.push_adapter(write(version), version))
                out["gaps"].append(await probe_logprob_gap(client, learner, prompts, adapter=adapter_name(version)))
                move_adapter()
            # The batched form arbor's rollouts use: one lora_path for every prompt of the batch.
            forks = await client.generate_many([GenerateRequest(p, SamplingParams(4, n=2, seed=i), adapter=adapter_name("3"))
                                                for i, p in enumerate(prompts)])
            out["forks"] = [len(outs) for outs in forks]
            out["versions"], out["held"] = await client.get_weight_version(), list(sync.adapters)
            with pytest.raises(EngineError, match="arbor-lora-1"):  # unloaded by the third push
                await client.generate(GenerateRequest(prompts[0], SamplingParams(2), adapter=adapter_name("1")))
            # The base model is still served to requests naming no adapter.
            out["base_after"] = await probe_logprob_gap(client, base, prompts)
            return out

    out = asyncio.run(main())
    assert out["base"] <= 1e-4 and out["base_after"] <= 1e-4
    assert out["before"] > 1e-2  # the adapter moved the policy away from the base
    assert max(out["gaps"]) <= 1e-4, out["gaps"]
    assert out["sent"] == [moving.nbytes()] * 3
    assert out["forks"] == [2, 2]
    assert out["versions"] == ["3"] and out["held"] == ["arbor-lora-2", "arbor-lora-3"]
