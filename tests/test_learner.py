"""The learner: exact accumulated gradients over packs, single process and 2 ZeRO-3 ranks (CPU, gloo)."""

import functools
import math
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from arbor.config_load import load_config
from arbor.engines.ports import free_port
from arbor.train.learner import Learner, lr_lambda
from arbor.train.loss import LossStats
from arbor.train.packed_loss import pack_loss, policy_loss
from arbor.train.packing import assign_to_ranks, loss_denominator, pack_trees
from arbor.tree import RolloutTree

VOCAB = 40


def tiny_model_dir(path: Path, tied: bool = False) -> Path:
    torch.manual_seed(0)
    cfg = Qwen2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=64, vocab_size=VOCAB, tie_word_embeddings=tied)
    Qwen2ForCausalLM(cfg).save_pretrained(path)
    return path


def batch(seed: int = 0):
    rng = random.Random(seed)
    trees, advantages = [], []
    for i in range(4):
        stem = [rng.randrange(VOCAB) for _ in range(5)]
        responses = [stem[: rng.randint(1, 5)] + [rng.randrange(VOCAB) for _ in range(4)] for _ in range(3)]
        logprobs = [[-2 * rng.random() for _ in r] for r in responses]
        trees.append(RolloutTree.from_sequences([1, 2, i], responses, logprobs=logprobs, segment_tokens=3,
                                                problem={"id": i}))
        advantages.append([rng.gauss(0, 1) for _ in range(3)])
    return trees, advantages


def config(path, *overrides):
    return load_config(None, [f"model.path={path}", "learner.device=cpu", "learner.dtype=float32",
                              "learner.pack_tokens=2048", "data.max_prompt_tokens=8",
                              "rollout.segment_tokens=8", *overrides])


def test_lr_schedule_by_hand():
    cfg = load_config(None, ["optim.warmup_steps=2", "optim.schedule=cosine", "optim.min_lr_ratio=0.1"])
    f = lr_lambda(cfg.optim, total_steps=12)
    # warmup: 1/2, 2/2; then cosine from 1 to 0.1 over 10 steps: halfway (step 7) = 0.55
    assert [f(0), f(1), f(2)] == [0.5, 1.0, 1.0]
    assert f(7) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert f(12) == pytest.approx(0.1)


def test_torch_learner_accumulates_exact_gradients(tmp_path):
    path = tiny_model_dir(tmp_path / "m")
    cfg = config(path, "learner.backend=torch", "learner.zero_stage=0", "optim.lr=1e-3")
    trees, advantages = batch()
    learner = Learner(cfg.model, cfg.learner, cfg.optim, cfg.loss, total_steps=10)
    packs = pack_trees(trees, advantages, pack_tokens=20)  # several packs: accumulation
    assert len(packs) > 1
    denominator = loss_denominator(trees, "token")
    stats = learner.backward(packs, functools.partial(learner.policy_pack_loss, denominator=denominator))
    got = [p.grad for p in learner.model.parameters()]

    reference = Qwen2ForCausalLM.from_pretrained(path)
    loss, metrics = policy_loss(reference, trees, advantages, mode="padded")
    loss.backward()
    for a, p in zip(got, reference.parameters()):
        torch.testing.assert_close(a, p.grad, rtol=1e-4, atol=1e-6)
    assert sum(stats, LossStats()).metrics()["linearised_tokens"] == metrics["linearised_tokens"]

    before = [p.detach().clone() for p in learner.model.parameters()]
    grad_norm = learner.optimizer_step()
    assert grad_norm > 0 and learner.steps == 1
    assert any(not torch.equal(a, b) for a, b in zip(before, learner.model.parameters()))



def test_a_nonfinite_gradient_norm_names_the_update_and_parameters_and_skips_it(tmp_path, caplog):
    """A NaN in one parameter's gradient: the warning names the update and that parameter,
    the weights are left as they were (applying it would make them all NaN), and the next
    finite update steps as usual."""
    path = tiny_model_dir(tmp_path / "m")
    cfg = config(path, "learner.backend=torch", "learner.zero_stage=0", "optim.lr=1e-3", "optim.max_grad_norm=1.0")
    learner = Learner(cfg.model, cfg.learner, cfg.optim, cfg.loss, total_steps=10)
    trees, advantages = batch()
    packs = pack_trees(trees, advantages, pack_tokens=2048)
    loss_of = functools.partial(learner.policy_pack_loss, denominator=loss_denominator(trees, "token"))
    learner.backward(packs, loss_of)
    poisoned = "model.layers.1.mlp.down_proj.weight"
    dict(learner.model.named_parameters())[poisoned].grad[0, 0] = float("nan")
    before = [p.detach().clone() for p in learner.model.parameters()]
    with caplog.at_level("WARNING", logger="arbor.train.learner"):
        assert math.isnan(learner.optimizer_step())
    assert f"learner update 0: gradient norm is nan; non-finite gradients in 1 parameter(s): {poisoned}" in caplog.text
    assert all(torch.equal(a, b) for a, b in zip(before, learner.model.parameters()))
    learner.backward(packs, loss_of)
    assert math.isfinite(learner.optimizer_step()) and learner.steps == 2
    assert any(not torch.equal(a, b) for a, b in zip(before, learner.model.parameters()))

# Each rank trains on its share of the packs. With plain SGD at lr 1 and no clipping the
# update is exactly minus the accumulated, all-reduced gradient, which must equal the
# single-process gradient of the whole batch. (AdamW's first step is ~sign(grad) and
# would hide a wrong scale.)
RANK_SCRIPT = """
import os, sys, torch
sys.path.insert(0, {tests!r})
from test_learner import batch, config


class PlainSGD(torch.optim.SGD):
    def __init__(self, params, lr=1.0, betas=None, eps=None, weight_decay=None):
        super().__init__(params, lr=1.0)


torch.optim.AdamW = PlainSGD
from arbor.train.learner import Learner
from arbor.train.packing import assign_to_ranks, loss_denominator, pack_trees

cfg = config({path!r}, "learner.backend=deepspeed", "learner.zero_stage=3", "learner.num_ranks=2",
             "optim.max_grad_norm=0", "learner.logit_chunk_tokens={chunk}")
trees, advantages = batch()
packs = pack_trees(trees, advantages, pack_tokens=20)
rank = int(os.environ["RANK"])
mine = [packs[i] for i in assign_to_ranks(packs, 2)[rank][: {limit} if rank == 1 else None]]
learner = Learner(cfg.model, cfg.learner, cfg.optim, cfg.loss, total_steps=10)
before = learner.full_state_dict()
denominator = loss_denominator(trees, "token")
learner.backward(mine, lambda model, pack: learner.policy_pack_loss(model, pack, denominator))
learner.optimizer_step()
after = learner.full_state_dict()
torch.save({{k: before[k] - after[k] for k in before}}, {out!r} + os.environ["RANK"])
learner.close()  # a rank that exits with ZeRO-3's gloo work alive can abort
from deepspeed.utils import groups
print("after close: initialized", torch.distributed.is_initialized(), "deepspeed group", groups._WORLD_GROUP)
"""


def run_two_ranks(*args: str | Path, timeout_s: float = 300) -> list[str]:
    """Run ``python *args`` (a script, or ``-m arbor ...``) as ranks 0 and 1 of a gloo group (CPU
    DeepSpeed, one thread each); both must succeed. Returns each rank's output."""
    port = str(free_port())
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=port, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu",
                   PYTHONWARNINGS="ignore::FutureWarning",  # torch's deprecation notes would hide a failure
                   PYTHONFAULTHANDLER="1")  # a rank that aborts shows where each thread was
        procs.append(subprocess.Popen([sys.executable, *map(str, args)], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    logs = [p.communicate(timeout=timeout_s)[0] for p in procs]
    codes = [p.returncode for p in procs]
    assert codes == [0, 0], f"exit codes {codes}\n" + "\n".join(log[-3000:] for log in logs)
    return logs


@pytest.mark.parametrize("limit, chunk, tied", [(None, 0, False), (None, 3, False), (1, 3, True)])
def test_zero3_two_ranks_match_single_process(tmp_path, limit, chunk, tied):
    """limit=1: rank 1 trains one pack, rank 0 three, so rank 1 runs idle passes.

    chunk: ``learner.logit_chunk_tokens`` — 3 runs the LM head (ZeRO-3 partitioned, tied
    to the embeddings or not) outside the model's forward, three tokens at a time,
    recomputed in the backward; 0 takes whole logits from the forward."""
    path = tiny_model_dir(tmp_path / "m", tied)
    script = tmp_path / "rank.py"
    out = str(tmp_path / "result")
    script.write_text(RANK_SCRIPT.format(tests=str(Path(__file__).parent), path=str(path), out=out, limit=limit,
                                         chunk=chunk))
    logs = run_two_ranks(script)
    # close() destroyed the groups and left DeepSpeed holding none (torch's destroy_process_group
    # alone leaves it its clone of the world group, the one ZeRO-3 gathers on).
    assert all("after close: initialized False deepspeed group None" in log for log in logs), logs[1][-2000:]

    trees, advantages = batch()
    packs = pack_trees(trees, advantages, pack_tokens=20)
    # Several packs per rank (accumulation) and unequal counts (idle passes keep ZeRO-3 in step).
    counts = sorted(len(r) for r in assign_to_ranks(packs, 2))
    assert counts[0] >= 2
    reference = Qwen2ForCausalLM.from_pretrained(path)
    if limit is None:
        loss, _ = policy_loss(reference, trees, advantages, mode="padded")
        loss.backward()
    else:  # the packs actually trained, each over the batch's global denominator
        ranks = assign_to_ranks(packs, 2)
        for i in ranks[0] + ranks[1][:limit]:
            pack_loss(reference, packs[i], loss_denominator(trees, "token"))[0].backward()
    for rank in range(2):
        update = torch.load(out + str(rank))
        for name, p in reference.named_parameters():
            torch.testing.assert_close(update[name], p.grad, rtol=1e-4, atol=1e-7)


UNCOMPILED_SCRIPT = """
import os, sys
sys.path.insert(0, {tests!r})
from test_learner import config
from arbor.train.learner import Learner

cfg = config({path!r}, "learner.backend=deepspeed", "learner.zero_stage=3")
Learner(cfg.model, cfg.learner, cfg.optim, cfg.loss, total_steps=10)
print("muon", "deepspeed.runtime.zero.muon.original_muon" in sys.modules)
print("inductor", "torch._inductor.compile_fx" in sys.modules)
print("env", os.environ.get("TORCHDYNAMO_DISABLE"))
"""


def test_a_deepspeed_rank_starts_without_compiling_deepspeeds_muon_kernels(tmp_path):
    """DeepSpeed's ZeRO optimizers import its Muon kernels, which torch.compile themselves at
    import (loading TorchInductor: seconds of a rank's start-up); the learner imports them with
    TorchDynamo off, and leaves TorchDynamo as it found it."""
    script = tmp_path / "rank.py"
    script.write_text(UNCOMPILED_SCRIPT.format(tests=str(Path(__file__).parent),
                                               path=str(tiny_model_dir(tmp_path / "m"))))
    env = dict(os.environ, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    env.pop("TORCHDYNAMO_DISABLE", None)
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert "muon True" in lines and "inductor False" in lines and "env None" in lines, done.stdout[-2000:]
