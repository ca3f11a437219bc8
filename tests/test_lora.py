"""LoRA: only the adapter trains (plain torch and 2 ZeRO-3 ranks), the KL reference is the
model with its adapter off, exports and checkpoints hold peft's format, ``arbor export --merge``."""

import json
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from test_learner import batch, config, run_two_ranks, tiny_model_dir
from transformers import AutoModelForCausalLM

from arbor.cli import main as cli_main
from arbor.config_load import load_config
from arbor.errors import ConfigError
from arbor.train.learner import Learner
from arbor.train.lora import lora_targets
from arbor.train.packing import assign_to_ranks, loss_denominator, pack_trees


@pytest.mark.parametrize("override, key", [
    ("model.lora_rank=-1", "model.lora_rank"),
    ("model.lora_alpha=0", "model.lora_alpha"),
    ("model.lora_dropout=1", "model.lora_dropout"),
    ("model.lora_targets=[q_proj]", "model.lora_targets"),  # without a rank
])
def test_bad_lora_keys_are_named(override, key):
    with pytest.raises(ConfigError, match=key):
        load_config(None, [override])


def test_lora_needs_no_second_reference_path():
    with pytest.raises(ConfigError, match="model.ref_path"):
        load_config(None, ["model.lora_rank=8", "model.ref_path=/elsewhere"])


def test_targets_default_per_architecture_or_named():
    cfg = load_config(None, ["model.lora_rank=8"]).model
    assert lora_targets(cfg, "qwen2") == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    assert lora_targets(load_config(None, ["model.lora_rank=8", "model.lora_targets=[q_proj]"]).model, "gpt2") == ["q_proj"]
    with pytest.raises(ConfigError, match="model.lora_targets: no default for model type 'gpt2'"):
        lora_targets(cfg, "gpt2")


def logits(model, ids=((1, 5, 7, 2, 9, 3),)):
    with torch.no_grad():
        return model(input_ids=torch.tensor(ids)).logits


def test_torch_learner_trains_the_adapter_only(tmp_path):
    path = tiny_model_dir(tmp_path / "m")
    cfg = config(path, "learner.backend=torch", "learner.zero_stage=0", "optim.lr=1e-2", "model.lora_rank=4",
                 "model.lora_alpha=8", "loss.kl_coef=0.1")
    learner = Learner(cfg.model, cfg.learner, cfg.optim, cfg.loss, total_steps=10)
    base = AutoModelForCausalLM.from_pretrained(path)
    trees, advantages = batch()
    packs = pack_trees(trees, advantages, pack_tokens=20)
    denominator = loss_denominator(trees, "token")
    first = learner.step(packs, denominator)
    assert first.stats.metrics()["kl"] == 0.0  # B starts at zero: the policy is the base model
    second = learner.step(packs, denominator)
    assert second.stats.metrics()["kl"] > 0

    trained = {n for n, p in learner.model.named_parameters() if p.requires_grad}
    assert trained and all(".lora_A." in n or ".lora_B." in n for n in trained)
    # The frozen base is untouched; the reference (adapter off) is exactly the base model,
    # while the policy has moved away from it.
    frozen = {n.removeprefix("base_model.model.").replace(".base_layer", ""): p
              for n, p in learner.model.named_parameters() if not p.requires_grad}
    assert frozen.keys() == dict(base.named_parameters()).keys()
    for name, p in base.named_parameters():
        torch.testing.assert_close(frozen[name], p, rtol=0, atol=0)
    torch.testing.assert_close(logits(learner.ref_model), logits(base), rtol=0, atol=0)
    assert not torch.allclose(logits(learner.model), logits(base))
    assert len(learner.optimizer.param_groups[0]["params"]) == len(trained)

    # hf/ export: peft's adapter format, loadable by peft onto the base.
    learner.export_hf(tmp_path / "hf")
    adapter_config = json.loads((tmp_path / "hf" / "adapter_config.json").read_text())
    assert adapter_config["r"] == 4 and adapter_config["lora_alpha"] == 8
    assert adapter_config["base_model_name_or_path"] == str(path)
    learner.model.eval()
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(path), tmp_path / "hf")
    torch.testing.assert_close(logits(loaded), logits(learner.model), rtol=1e-5, atol=1e-5)
    # arbor export --merge: plain weights with the adapter folded in.
    assert cli_main(["export", str(tmp_path / "hf"), "--merge", str(tmp_path / "merged")]) == 0
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    torch.testing.assert_close(logits(merged), logits(learner.model), rtol=1e-4, atol=1e-4)

    # Checkpoint: the adapter (and optimizer) only, resumed exactly by a fresh learner.
    learner.save(tmp_path / "ckpt")
    assert (tmp_path / "ckpt" / "adapter" / "adapter_model.safetensors").exists()
    saved = torch.load(tmp_path / "ckpt" / "learner.pt", weights_only=True)["model"]
    assert set(saved) == trained
    resumed = Learner(cfg.model, cfg.learner, cfg.optim, cfg.loss, total_steps=10)
    resumed.load(tmp_path / "ckpt")
    assert resumed.steps == 2
    resumed.model.eval()
    torch.testing.assert_close(logits(resumed.model), logits(learner.model), rtol=0, atol=0)


def test_export_names_a_directory_without_an_adapter(tmp_path, capsys):
    assert cli_main(["export", str(tmp_path), "--merge", str(tmp_path / "out")]) == 1
    assert "no adapter_config.json" in capsys.readouterr().err


class PlainSGD(torch.optim.SGD):
    """SGD at lr 1 in AdamW's signature: the update is exactly minus the gradient."""

    def __init__(self, params, lr=1.0, betas=None, eps=None, weight_decay=None):
        super().__init__(params, lr=1.0)


# Two ZeRO-3 ranks, different seeds (the adapter's random A must still agree: DeepSpeed
# broadcasts rank 0's when it partitions parameters built outside zero.Init), two SGD
# steps at lr 1 without clipping: the adapter must equal the single process's.
RANK_SCRIPT = """
import os, sys, torch
sys.path.insert(0, {tests!r})
from test_learner import batch, config
from test_lora import PlainSGD

torch.optim.AdamW = PlainSGD
from arbor.train.learner import Learner
from arbor.train.packing import assign_to_ranks, loss_denominator, pack_trees

rank = int(os.environ["RANK"])
torch.manual_seed(rank)
cfg = config({path!r}, "learner.backend=deepspeed", "learner.zero_stage=3", "learner.num_ranks=2",
             "optim.max_grad_norm=0", "model.lora_rank=4", "loss.kl_coef=0.1", "learner.sync_bucket_mb=0.004")
trees, advantages = batch()
packs = pack_trees(trees, advantages, pack_tokens=20)
mine = [packs[i] for i in assign_to_ranks(packs, 2)[rank]]
learner = Learner(cfg.model, cfg.learner, cfg.optim, cfg.loss, total_steps=10)
denominator = loss_denominator(trees, "token")
kl = [learner.step(mine, denominator, filler=packs[0]).stats.kl_lin for _ in range(2)]
learner.export_hf({out!r} + "hf")
learner.save({out!r} + "ckpt")
adapter = learner.adapter_weights()
learner.step(mine, denominator, filler=packs[0])  # moves away from the checkpoint...
learner.load({out!r} + "ckpt")  # ...and back
torch.save({{"kl": kl, "adapter": adapter, "reloaded": learner.adapter_weights(), "steps": learner.steps,
             "base_shard": sum(p.ds_tensor.numel() for n, p in learner.model.named_parameters() if not p.requires_grad)}},
           {out!r} + str(rank))
learner.close()
"""


def test_zero3_two_ranks_train_the_adapter_as_one_process(tmp_path, monkeypatch):
    path = tiny_model_dir(tmp_path / "m")
    script = tmp_path / "rank.py"
    out = str(tmp_path / "result")
    script.write_text(RANK_SCRIPT.format(tests=str(Path(__file__).parent), path=str(path), out=out))
    run_two_ranks(script, timeout_s=400)
    ranks = [torch.load(out + str(rank)) for rank in range(2)]
    monkeypatch.setattr(torch.optim, "AdamW", PlainSGD)
    torch.manual_seed(0)
    cfg = config(path, "learner.backend=torch", "learner.zero_stage=0", "optim.max_grad_norm=0",
                 "model.lora_rank=4", "loss.kl_coef=0.1")
    single = Learner(cfg.model, cfg.learner, cfg.optim, cfg.loss, total_steps=10)
    trees, advantages = batch()
    packs = pack_trees(trees, advantages, pack_tokens=20)
    assert min(len(r) for r in assign_to_ranks(packs, 2)) >= 2
    denominator = loss_denominator(trees, "token")
    kl = [single.step(packs, denominator).stats.kl_lin for _ in range(2)]
    expected = single.adapter_weights()

    assert kl[0] == 0 and kl[1] > 0
    assert ranks[0]["kl"][1] + ranks[1]["kl"][1] == pytest.approx(kl[1], rel=1e-4)
    got = ranks[0]["adapter"]
    assert set(got) == set(expected) and ranks[1]["adapter"] == {}
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(ranks[0]["reloaded"][name], got[name], rtol=0, atol=0)
    assert ranks[0]["steps"] == 2
    # Each rank holds half of the frozen base (no whole copy, no reference copy).
    base_numel = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(path).parameters())
    assert ranks[0]["base_shard"] <= base_numel // 2 + 1000
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(path), Path(out + "hf"))
    single.model.eval()
    torch.testing.assert_close(logits(loaded), logits(single.model), rtol=1e-4, atol=1e-4)


def test_sft_trains_an_adapter_and_resumes(tmp_path):
    from test_sft import write_config
    from tiny_model import build_tiny_model_dir

    from arbor.run.metrics import read_metrics
    from arbor.run.sft import main as sft_main

    tiny = build_tiny_model_dir(tmp_path / "tiny")
    config = write_config(tmp_path, tiny, "")
    overrides = ["learner.backend=torch", "learner.zero_stage=0", "run.save_every=2", "run.loggers=[]",
                 "model.lora_rank=8", "optim.lr=0.01"]
    assert sft_main(load_config(config, overrides + ["sft.max_steps=2"])) == 0
    assert sft_main(load_config(config, overrides + ["sft.max_steps=4", "run.resume=true"])) == 0
    losses = [m["sft/loss"] for m in read_metrics(tmp_path / "run")]
    assert len(losses) == 4 and losses[-1] < losses[0], losses
    hf = tmp_path / "run" / "hf"
    assert (hf / "adapter_model.safetensors").exists() and not (hf / "model.safetensors").exists()
    base = AutoModelForCausalLM.from_pretrained(tiny)
    assert not torch.allclose(logits(PeftModel.from_pretrained(base, hf)), logits(AutoModelForCausalLM.from_pretrained(tiny)))


def test_sglang_is_started_with_lora_flags(tmp_path):
    from arbor.run.engine_group import engine_args

    path = tiny_model_dir(tmp_path / "m")
    flags = engine_args(load_config(None, ["engine.kind=sglang", f"model.path={path}", "model.lora_rank=8",
                                           "model.lora_targets=[q_proj, v_proj]"]))
    start = flags.index("--enable-lora")
    assert flags[start:start + 6] == ["--enable-lora", "--max-lora-rank", "8", "--lora-target-modules", "q_proj", "v_proj"]
    assert "--enable-lora" not in engine_args(load_config(None, ["engine.kind=sglang", f"model.path={path}"]))
