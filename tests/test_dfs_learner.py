"""The learner with learner.tree_execution: dfs — one process, DeepSpeed's micro-steps, and two
ZeRO-3 ranks whose walks differ in shape (lockstep), with the KL reference and with LoRA."""

import os
import random
import subprocess
import sys
from pathlib import Path

import torch
from test_learner import config, run_two_ranks, tiny_model_dir
from test_tree_vs_linear import random_advantages, random_tree
from transformers import Qwen2ForCausalLM

from arbor.engines.ports import free_port
from arbor.train.learner import Learner
from arbor.train.packed_loss import policy_loss
from arbor.train.packing import loss_denominator, pack_trees
from arbor.train.rollout_correction import attach_learner_logprobs

VOCAB = 40  # test_learner's tiny model


def trees_and_advantages(seed: int = 0, count: int = 5):
    """test_tree_vs_linear's random trees, token ids within the tiny model's vocabulary."""
    rng = random.Random(seed)
    trees = [random_tree(rng, i) for i in range(count)]
    for tree in trees:
        tree.prompt_ids[:] = [t % VOCAB for t in tree.prompt_ids]
        for node in tree.nodes():
            node.token_ids = [t % VOCAB for t in node.token_ids]
    return trees, random_advantages(rng, trees, per_token=False)


class PlainSGD(torch.optim.SGD):
    """SGD at lr 1: an update is minus the accumulated gradient (AdamW's first step hides scale)."""

    def __init__(self, params, lr=1.0, betas=None, eps=None, weight_decay=None):
        super().__init__(params, lr=1.0)


def update(learner: Learner, packs, denominator) -> dict[str, torch.Tensor]:
    before = learner.full_state_dict()
    learner.step(packs, denominator, filler=packs[0])
    after = learner.full_state_dict()
    return {k: before[k] - after[k] for k in before}


def test_one_process_dfs_step_equals_the_packed_step_with_kl_and_rollout_correction(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.optim, "AdamW", PlainSGD)
    path = tiny_model_dir(tmp_path / "m")
    trees, advantages = trees_and_advantages()
    packs = pack_trees(trees, advantages, pack_tokens=16)
    settings = ["learner.backend=torch", "optim.max_grad_norm=0", "loss.kl_coef=0.1", "loss.rollout_correction=tis",
                "learner.dfs_group_tokens=5", "learner.logit_chunk_tokens=3"]
    updates, old = {}, {}
    for execution in ("packed", "dfs"):
        cfg = config(path, *settings, f"learner.tree_execution={execution}")
        learner = Learner(cfg.model, cfg.learner, cfg.optim, cfg.loss, total_steps=10)
        old[execution] = learner.old_logprobs(packs)  # π_old from the walk's own forwards
        attach_learner_logprobs(trees, packs, old[execution])
        packs = pack_trees(trees, advantages, pack_tokens=16)  # now with prox_logprobs
        updates[execution] = update(learner, packs, loss_denominator(trees, "token"))
    for a, b in zip(old["packed"], old["dfs"]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for name, change in updates["packed"].items():
        torch.testing.assert_close(updates["dfs"][name], change, rtol=1e-4, atol=1e-7)
    assert any(change.abs().max() > 0 for change in updates["dfs"].values())


# One DeepSpeed rank, a tree whose walk runs two backwards back to back ("FFBB": the leaves,
# then the prompt). ZeRO-3 copies rather than adds a backward's gradients until a forward
# follows a backward; without the walk's warm-up the prompt's gradients replace the leaves'.
ONE_RANK_SCRIPT = """
import sys, torch
sys.path.insert(0, {tests!r})
from test_dfs_learner import PlainSGD, update
from test_learner import config
torch.optim.AdamW = PlainSGD
from arbor.train.learner import Learner
from arbor.train.packing import loss_denominator, pack_trees
from arbor.tree import RolloutTree

tree = RolloutTree.from_sequences([1, 2, 3], [[4, 5, 6], [4, 7, 8]], logprobs=[[-1.0] * 3] * 2)
cfg = config({path!r}, "learner.backend=deepspeed", "learner.zero_stage=3", "optim.max_grad_norm=0",
             "learner.tree_execution=dfs")
learner = Learner(cfg.model, cfg.learner, cfg.optim, cfg.loss, total_steps=10)
torch.save(update(learner, pack_trees([tree], [[1.0, -0.5]]), loss_denominator([tree], "token")), {out!r})
learner.close()
"""


def test_a_deepspeed_rank_adds_back_to_back_backwards(tmp_path):
    from arbor.tree import RolloutTree

    path = tiny_model_dir(tmp_path / "m")
    script, out = tmp_path / "rank.py", tmp_path / "update.pt"
    script.write_text(ONE_RANK_SCRIPT.format(tests=str(Path(__file__).parent), path=str(path), out=str(out)))
    env = dict(os.environ, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu",
               PYTHONWARNINGS="ignore::FutureWarning")
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    tree = RolloutTree.from_sequences([1, 2, 3], [[4, 5, 6], [4, 7, 8]], logprobs=[[-1.0] * 3] * 2)
    reference = Qwen2ForCausalLM.from_pretrained(path)
    policy_loss(reference, [tree], [[1.0, -0.5]], mode="padded")[0].backward()
    changes = torch.load(out)
    for name, p in reference.named_parameters():
        torch.testing.assert_close(changes[name], p.grad, rtol=1e-4, atol=1e-7)


# Two ZeRO-3 ranks with different trees (rank 0: three trees in small packs, rank 1: two in
# one), so their walks differ in shape and count. Every parameter is gathered in every call
# (persistence threshold 0) and gradients are reduced in small buckets: a rank out of step
# would mismatch collectives. The KL reference is a second ZeRO-3 engine (or, with LoRA, the
# policy with its adapter off), walked without a graph in lockstep too.
TWO_RANK_SCRIPT = """
import os, sys, torch
sys.path.insert(0, {tests!r})
from test_dfs_learner import PlainSGD, trees_and_advantages, update
from test_learner import config
torch.optim.AdamW = PlainSGD
import arbor.train.learner as learner_module
from arbor.train.deepspeed_setup import deepspeed_config


def gather_everything(*args, **kwargs):
    ds = deepspeed_config(*args, **kwargs)
    ds["zero_optimization"] |= {{"stage3_param_persistence_threshold": 0, "reduce_bucket_size": 500}}
    return ds


learner_module.deepspeed_config = gather_everything
from arbor.train.packing import loss_denominator, pack_trees

rank = int(os.environ["RANK"])
torch.manual_seed(0)  # the same LoRA initialisation in every run
cfg = config({path!r}, "learner.backend=deepspeed", "learner.zero_stage=3", "learner.num_ranks=2",
             "optim.max_grad_norm=0", "learner.logit_chunk_tokens=3", "learner.dfs_group_tokens=6",
             "loss.kl_coef=0.1", {extra})
trees, advantages = trees_and_advantages()
mine = [0, 1, 2] if rank == 0 else [3, 4]
packs = pack_trees([trees[i] for i in mine], [advantages[i] for i in mine], pack_tokens=14 if rank == 0 else 4096)
learner = learner_module.Learner(cfg.model, cfg.learner, cfg.optim, cfg.loss, total_steps=10)
changes = update(learner, packs, loss_denominator(trees, "token"))
torch.save({{k: v for k, v in changes.items() if "lora" in k or not cfg.model.lora_rank}}, {out!r} + str(rank))
learner.close()
"""


def two_ranks(tmp_path: Path, path: Path, name: str, *extra: str) -> list[dict[str, torch.Tensor]]:
    script, out = tmp_path / f"{name}.py", str(tmp_path / name)
    script.write_text(TWO_RANK_SCRIPT.format(tests=str(Path(__file__).parent), path=str(path), out=out,
                                             extra=", ".join(repr(e) for e in extra)))
    run_two_ranks(script, timeout_s=600)
    return [torch.load(out + str(rank)) for rank in range(2)]


def test_two_zero3_ranks_walk_different_trees_in_lockstep(tmp_path):
    path = tiny_model_dir(tmp_path / "m")
    trees, advantages = trees_and_advantages()
    assert len(pack_trees(trees[:3], advantages[:3], pack_tokens=14)) > 2  # rank 0 walks several packs
    reference = Qwen2ForCausalLM.from_pretrained(path)
    policy_loss(reference, trees, advantages, mode="padded", kl_coef=0.1,
                ref_model=Qwen2ForCausalLM.from_pretrained(path))[0].backward()
    for changes in two_ranks(tmp_path, path, "full", "learner.tree_execution=dfs"):
        for name, p in reference.named_parameters():
            torch.testing.assert_close(changes[name], p.grad, rtol=1e-4, atol=1e-7)


def test_two_zero3_ranks_train_a_lora_adapter_depth_first_as_one_packed_process(tmp_path, monkeypatch):
    path = tiny_model_dir(tmp_path / "m")
    walked = two_ranks(tmp_path, path, "lora", "model.lora_rank=4", "learner.tree_execution=dfs")
    monkeypatch.setattr(torch.optim, "AdamW", PlainSGD)
    torch.manual_seed(0)  # the adapter's initialisation, as in the ranks
    cfg = config(path, "learner.backend=torch", "optim.max_grad_norm=0", "learner.logit_chunk_tokens=3",
                 "loss.kl_coef=0.1", "model.lora_rank=4")
    trees, advantages = trees_and_advantages()
    packed = update(Learner(cfg.model, cfg.learner, cfg.optim, cfg.loss, total_steps=10),
                    pack_trees(trees, advantages), loss_denominator(trees, "token"))
    assert walked[0] and all(set(w) == {k for k in packed if "lora" in k} for w in walked)
    for changes in walked:
        for name, change in changes.items():
            torch.testing.assert_close(change, packed[name], rtol=1e-4, atol=1e-7)
