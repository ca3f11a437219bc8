"""LoRA weight sync: the embedded engine merges pushed adapters exactly; a LoRA run end to end."""

import asyncio
import json

import pytest
import torch
from safetensors.torch import save_file
from test_trainer import config, run_inputs  # noqa: F401  (run_inputs is a fixture)
from tiny_model import build_tiny_model_dir
from transformers import AutoModelForCausalLM

from arbor.config_load import load_config
from arbor.engines.client import SGLangClient
from arbor.engines.embedded.lora import MergedAdapters, delta, read_factors
from arbor.engines.errors import EngineError
from arbor.engines.launch import launch_engines
from arbor.run.trainer import train
from arbor.run.weight_sync import WeightSync, adapter_name, probe_logprob_gap
from arbor.train.lora import adapter_state, add_adapter, save_adapter


def write_adapter(directory, tensors, r=2, alpha=4.0, **extra):
    directory.mkdir(parents=True)
    (directory / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": r, "lora_alpha": alpha, **extra}))
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    return directory


def test_delta_by_hand_and_exact_restore(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(3, 2, bias=False))
    base = model[0].weight.detach().clone()
    a = torch.tensor([[1.0, 0.0, 2.0], [0.0, 1.0, 0.0]])  # [r=2, in=3]
    b = torch.tensor([[1.0, 1.0], [0.0, 3.0]])  # [out=2, r=2]
    path = write_adapter(tmp_path / "x", {"base_model.model.0.lora_A.weight": a, "base_model.model.0.lora_B.weight": b})
    # scale = alpha / r = 2; B A = [[1, 1, 2], [0, 3, 0]]
    change = delta(read_factors(path, model)["0"])
    assert change.tolist() == [[2.0, 2.0, 4.0], [0.0, 6.0, 0.0]]
    adapters = MergedAdapters(model)
    adapters.load("x", path)
    torch.testing.assert_close(model[0].weight, base + change, rtol=0, atol=0)
    adapters.load("y", write_adapter(tmp_path / "y", {"base_model.model.0.lora_A.weight": a,
                                                      "base_model.model.0.lora_B.weight": -b}))
    torch.testing.assert_close(model[0].weight, base - change, rtol=0, atol=0)  # from the base, not from x's merge
    adapters.check_requested(["x", "y"])  # x was superseded but stays loaded: served by y's weights
    # A full weight update gives a new base; y stays merged on top of it.
    with torch.no_grad():
        model[0].weight.copy_(base * 3)
    adapters.rebase(["0.weight"])
    torch.testing.assert_close(model[0].weight, base * 3 - change, rtol=0, atol=0)
    with torch.no_grad():
        model[0].weight.copy_(base)
    adapters.rebase(["0.weight"])
    adapters.unload("x")
    with pytest.raises(ValueError, match="'x' is not loaded"):
        adapters.check_requested(["x"])
    with pytest.raises(ValueError, match="requests must name it"):
        adapters.check_requested([None])
    adapters.unload("y")  # the served one: back to the base, exactly
    assert torch.equal(model[0].weight, base) and adapters.active is None
    adapters.check_requested([None])


@pytest.mark.parametrize("tensors, extra, message", [
    ({"base_model.model.1.lora_A.weight": torch.zeros(2, 3), "base_model.model.1.lora_B.weight": torch.zeros(2, 2)},
     {}, "adapter module '1' is not a linear layer"),
    ({"base_model.model.0.lora_A.weight": torch.zeros(2, 3)}, {}, "lacks lora_B"),
    ({"base_model.model.0.lora_A.weight": torch.zeros(2, 4), "base_model.model.0.lora_B.weight": torch.zeros(2, 2)},
     {}, r"has A \(2, 4\)"),
    ({"base_model.model.0.lora_A.weight": torch.zeros(2, 3), "base_model.model.0.lora_B.weight": torch.zeros(2, 2)},
     {"use_dora": True}, "only plain LoRA"),
])
def test_bad_adapters_are_refused_naming_the_problem(tmp_path, tensors, extra, message):
    model = torch.nn.Sequential(torch.nn.Linear(3, 2, bias=False))
    before = model[0].weight.detach().clone()
    adapters = MergedAdapters(model)
    with pytest.raises(ValueError, match=message):
        adapters.load("bad", write_adapter(tmp_path / "a", tensors, **extra))
    assert torch.equal(model[0].weight, before) and adapters.loaded == []


class MovingAdapter:
    """A peft LoRA model of ``path`` whose adapter moves at random, written as a push writes it."""

    def __init__(self, path, root, rank=4, alpha=8, scale=0.3):
        model_cfg = load_config(None, [f"model.path={path}", f"model.lora_rank={rank}", f"model.lora_alpha={alpha}"]).model
        torch.manual_seed(0)
        self.model = add_adapter(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), model_cfg).eval()
        self.root, self.scale = root, scale

    def move(self):
        with torch.no_grad():
            for p in self.model.parameters():
                if p.requires_grad:
                    p.add_(self.scale * torch.randn_like(p))

    def write(self, version):
        whole = {n: p.detach().clone() for n, p in self.model.named_parameters() if p.requires_grad}
        directory = self.root / adapter_name(version)
        save_adapter(self.model, directory, adapter_state(self.model, whole))
        return directory

    def nbytes(self):
        return 4 * sum(p.numel() for p in self.model.parameters() if p.requires_grad)  # float32


def test_lora_sync_to_arbor_serve(tmp_path):
    path = build_tiny_model_dir(tmp_path / "tiny")
    moving = MovingAdapter(path, tmp_path / "sync")
    learner, move_adapter, write = moving.model, moving.move, moving.write
    prompts = [[5, 6, 7], [9, 10, 11, 12]]

    async def main(url):
        async with SGLangClient([url]) as client:
            sync = WeightSync(client)
            move_adapter()
            before = await probe_logprob_gap(client, learner, prompts)
            gaps, sent = [], []
            for version in ("1", "2", "3"):
                sent.append(await sync.push_adapter(write(version), version))
                gaps.append(await probe_logprob_gap(client, learner, prompts, adapter=adapter_name(version)))
                move_adapter()
            with pytest.raises(EngineError, match="requests must name it"):
                await probe_logprob_gap(client, learner, prompts)
            with pytest.raises(EngineError, match="'arbor-lora-1' is not loaded"):  # unloaded by the third push
                await probe_logprob_gap(client, learner, prompts, adapter=adapter_name("1"))
            return before, gaps, sent, sync.adapters, await client.get_weight_version()

    with launch_engines("embedded", model_path=str(path), log_dir=tmp_path / "logs") as handle:
        before, gaps, sent, held, versions = asyncio.run(main(handle.urls[0]))
    assert before > 1e-2
    assert max(gaps) <= 1e-4, gaps
    assert sent == [moving.nbytes()] * 3
    assert held == ["arbor-lora-2", "arbor-lora-3"] and versions == ["3"]
    assert sorted(p.name for p in (tmp_path / "sync").iterdir()) == held  # unloaded adapters' files go


def test_a_lora_run_syncs_only_the_adapter(run_inputs, tmp_path):  # noqa: F811
    """Two ZeRO-3 learner ranks under Ray: the adapter is gathered, rank 0 pushes it."""
    root, model, data = run_inputs
    cfg = config(root, model, data, tmp_path / "out", "learner.backend=deepspeed", "learner.zero_stage=3",
                 "learner.num_ranks=2", "model.lora_rank=4", "model.lora_alpha=16", "loss.kl_coef=0.01")
    history = train(cfg)
    rank, hidden, layers = 4, 64, 2
    kv = 2 * hidden // 4  # 2 of 4 heads of 16
    # q, k, v, o, gate, up, down: A [r, in] + B [out, r] each, float32
    per_layer = sum(rank * (i + o) for i, o in [(hidden, hidden), (hidden, kv), (hidden, kv), (hidden, hidden),
                                                (hidden, 2 * hidden), (hidden, 2 * hidden), (2 * hidden, hidden)])
    assert [m["sync/bytes"] for m in history] == [4 * layers * per_layer] * 2
    assert all(m["sync/logprob_gap"] <= 1e-4 for m in history)
    assert history[-1]["train/kl"] > 0  # the reference (adapter off) differs from the trained policy
    assert (tmp_path / "out" / "hf" / "adapter_config.json").exists()
    assert (tmp_path / "out" / "checkpoints" / "step-000002" / "learner" / "adapter" / "adapter_model.safetensors").exists()


def test_a_restarted_engine_gets_the_adapters_back(run_inputs, tmp_path):  # noqa: F811
    from test_trainer import kill_engine_mid_rollout

    root, model, data = run_inputs
    # Two engines: the survivor keeps its adapters, the restarted one loads those still held.
    cfg = config(root, model, data, tmp_path / "r", "learner.backend=torch", "learner.zero_stage=0", "run.steps=3",
                 "engine.num_engines=2", "model.lora_rank=4")
    arm, kills = kill_engine_mid_rollout({3})
    history = train(cfg, after_step=arm)
    assert len(kills) == 1
    assert [m["engine/restarts"] for m in history] == [0, 0, 1]
    assert all(m["sync/logprob_gap"] <= 1e-4 for m in history)  # the push after the restart reached both
    assert sorted(p.name for p in (tmp_path / "r" / "weight-sync").iterdir()) == ["arbor-lora-2", "arbor-lora-3"]
