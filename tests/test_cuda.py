"""The CUDA paths: bf16 FlexAttention tree training, its compilation, and a ZeRO-3 step over NCCL.

Every test here needs a CUDA device and skips without one (CI has none). On a GPU
machine, ``pytest -s tests/test_cuda.py`` also prints the measured figures as
``CUDA_FIGURE name=value ...`` lines (tolerances, compile times, the log-prob gaps).
"""

import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from test_tree_vs_linear import assert_close, budget, random_advantages, random_tree
from test_tree_vs_linear import loss_and_grads as tree_vs_linear_loss_and_grads
from transformers import Qwen2Config, Qwen2ForCausalLM

from arbor.train.packing import pack_trees
from arbor.train.tree_attention import packed_logits
from arbor.tree import RolloutTree

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

VOCAB = 48


def figure(name: str, **values: float) -> None:
    print(f"CUDA_FIGURE {name} " + " ".join(f"{k}={v:.4g}" for k, v in values.items()), flush=True)


def cuda_model(dtype: torch.dtype, seed: int) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    cfg = Qwen2Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=128, vocab_size=VOCAB, attn_implementation="sdpa")
    return Qwen2ForCausalLM(cfg).to(dtype).cuda()


def loss_and_grads(model, trees, advantages, **kw):
    """test_tree_vs_linear's loss_and_grads, brought to float32 on the CPU for comparison."""
    loss, grads, metrics = tree_vs_linear_loss_and_grads(model, trees, advantages, **kw)
    return loss.float().cpu(), [g.float().cpu() for g in grads], metrics


def max_relative(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    """The largest |a − b| of any parameter's gradient, relative to that gradient's largest entry."""
    return max(((x - y).abs().max() / x.abs().max().clamp(min=1e-12)).item() for x, y in zip(a, b))


# The bf16 tolerance of the CPU test (test_tree_vs_linear): the two modes run different
# kernels, so bf16 rounding differs per op; probabilities are float32 in both.
@pytest.mark.parametrize("normalize", ["token", "sequence"])
@pytest.mark.parametrize("seed", [21, 22, 23])
def test_flex_tree_training_equals_linear_in_bf16(seed, normalize):
    """Random trees (masked segments, branch points inside segments, several trees per
    pack, partitioned trees): FlexAttention tree packing vs padded per-leaf sequences in
    bf16 on CUDA — and both against the float64 CPU reference, so the bf16 error of each
    mode is known, not only their difference."""
    rng = random.Random(seed)
    trees = [random_tree(rng, i) for i in range(4)]
    advantages = random_advantages(rng, trees, per_token=False)
    kw = dict(normalize=normalize)
    model = cuda_model(torch.bfloat16, seed)
    lin = loss_and_grads(model, trees, advantages, mode="padded", **kw)
    tree = loss_and_grads(model, trees, advantages, mode="tree", attention="flex",
                          pack_tokens=budget(trees, 3), **kw)
    exact = Qwen2ForCausalLM(model.config).double()
    exact.load_state_dict({k: v.double().cpu() for k, v in model.state_dict().items()})
    ref = loss_and_grads(exact, trees, advantages, mode="padded", **kw)
    figure(f"bf16_tree_vs_linear[{seed},{normalize}]",
           loss_rel=abs(tree[0].item() - lin[0].item()) / abs(lin[0].item()),
           grad_rel=max_relative(lin[1], tree[1]),
           tree_vs_f64_grad_rel=max_relative(ref[1], tree[1]), linear_vs_f64_grad_rel=max_relative(ref[1], lin[1]))
    assert tree[0].item() == pytest.approx(lin[0].item(), rel=1e-2, abs=1e-7)
    for a, b in zip(lin[1], tree[1]):
        assert_close(a, b, 5e-2)
    assert tree[2]["logprob_gap"] == pytest.approx(lin[2]["logprob_gap"], rel=1e-2, abs=1e-7)


def test_flex_tree_training_equals_dense_in_float32():
    """The same trees through FlexAttention and through the dense-mask SDPA path, float32 on
    CUDA: one attention rule, two kernels."""
    rng = random.Random(5)
    trees = [random_tree(rng, i) for i in range(4)]
    advantages = random_advantages(rng, trees, per_token=True)
    model = cuda_model(torch.float32, 5)
    dense = loss_and_grads(model, trees, advantages, mode="tree", attention="dense", pack_tokens=budget(trees, 2))
    flex = loss_and_grads(model, trees, advantages, mode="tree", attention="flex", pack_tokens=budget(trees, 2))
    figure("f32_flex_vs_dense", loss_rel=abs(flex[0].item() - dense[0].item()) / abs(dense[0].item()),
           grad_rel=max_relative(dense[1], flex[1]))
    assert flex[0].item() == pytest.approx(dense[0].item(), rel=1e-4)
    for a, b in zip(dense[1], flex[1]):
        assert_close(a, b, 1e-3)


def test_auto_attention_trains_a_model_with_heads_flex_cannot_compile():
    """Heads of 8 dimensions (a toy model on a GPU machine): auto falls back to block
    attention instead of failing in FlexAttention's compiler."""
    torch.manual_seed(0)
    cfg = Qwen2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=64, vocab_size=VOCAB, attn_implementation="sdpa")
    model = Qwen2ForCausalLM(cfg).cuda()
    rng = random.Random(3)
    trees = [random_tree(rng, i) for i in range(3)]
    advantages = random_advantages(rng, trees, per_token=False)
    auto = loss_and_grads(model, trees, advantages, mode="tree", attention="auto")
    lin = loss_and_grads(model, trees, advantages, mode="padded")
    assert auto[0].item() == pytest.approx(lin[0].item(), rel=1e-4, abs=1e-7)


def test_flex_does_not_recompile_for_every_pack_length():
    """Packs come in every length: after the first few, a new length must not cost a
    compilation (seconds each). Forward + backward at eight lengths; the later ones must
    run at the speed of a repeat, not of a compile."""
    model = cuda_model(torch.bfloat16, 0).train()
    rng = random.Random(0)
    times = []
    for n in (40, 300, 170, 520, 260, 610, 90, 450):
        tree = RolloutTree([1, 2, 3], problem={"id": n})
        stem = tree.add_segment(tree.root, [rng.randrange(VOCAB) for _ in range(n // 2)])
        for _ in range(2):
            tree.add_segment(stem, [rng.randrange(VOCAB) for _ in range(n - n // 2)])
        (pack,) = pack_trees([tree], require_logprobs=False)
        torch.cuda.synchronize()
        start = time.perf_counter()
        model.zero_grad()
        packed_logits(model, pack, torch.arange(pack.num_tokens), attention="flex").float().logsumexp(-1).sum().backward()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    figure("flex_first_call_s", **{f"len{i}": t for i, t in enumerate(times)})
    # A compile costs seconds; a warm forward + backward of this model milliseconds.
    assert max(times[3:]) < 1.0, times


ZERO3_SCRIPT = """
import asyncio, json, sys, torch
sys.path[:0] = [{tests!r}, {root!r}]
from tiny_model import build_tiny_model_dir
from arbor.train.advantage import compute_advantages
from arbor.config import RolloutConfig
from arbor.config_load import load_config
from arbor.engines.embedded.engine import LocalEngine
from arbor.train.learner import Learner
from arbor.train.packing import loss_denominator, pack_trees
from arbor.rollout.sampler import sample_trees
from arbor.run.weight_sync import probe_samples
from arbor.train.weight_sync import logprob_gap

path = build_tiny_model_dir({path!r}, seed=3, hidden_size=128, num_hidden_layers=4)
cfg = load_config(None, ["model.path=" + str(path), "learner.backend=deepspeed", "learner.zero_stage=3",
                         "learner.device=cuda", "learner.dtype=bfloat16", "learner.attention=auto",
                         "data.max_prompt_tokens=8", "rollout.segment_tokens=8", "optim.lr=1e-2"])
engine = LocalEngine(str(path), device="cuda", dtype="bfloat16")
rollout = RolloutConfig(width=8, branch=2, segment_tokens=8, max_depth=4, temperature=1.0)
prompts = [[17, 42, 99, 5, 63], [31, 200, 11, 54, 76, 150], [7, 8, 9]]
problems = [{{"id": i}} for i in range(len(prompts))]
trees, _ = asyncio.run(sample_trees(engine, problems, prompts, rollout, eos_token_ids=[0], seed=1))
for tree in trees:
    for i, leaf in enumerate(tree.leaves()):
        leaf.reward = float(i % 2)
advantages = compute_advantages(trees, "treepo")
learner = Learner(cfg.model, cfg.learner, cfg.optim, cfg.loss, total_steps=10)
# The probe (weight_sync's check after every push): engine samples at the same weights, learner scores.
probes = asyncio.run(probe_samples(engine, prompts, max_new_tokens=16))
learner.model.eval()
probe_gap = logprob_gap(learner.model, probes)
learner.model.train()
packs = pack_trees(trees, advantages, pack_tokens=cfg.learner.pack_tokens)
denominator = loss_denominator(trees, "token")
before = learner.full_state_dict()
stats = learner.backward(packs, lambda model, pack: learner.policy_pack_loss(model, pack, denominator))
grad_norm = learner.optimizer_step()
after = learner.full_state_dict()
changed = sum(not torch.equal(before[k], after[k]) for k in before)
metrics = sum(stats[1:], stats[0]).metrics()
engine.shutdown()
print("ZERO3_RESULT " + json.dumps(dict(
    train_logprob_gap=metrics["logprob_gap"], clip_fraction=metrics["clip_fraction"], grad_norm=grad_norm,
    changed=changed, parameters=len(before), tokens=metrics["tokens"], leaves=sum(len(t.leaves()) for t in trees),
    probe_gap=probe_gap, attention=learner.attention,
    backend=str(torch.distributed.get_backend()))))
"""


def test_zero3_learner_step_on_one_gpu_over_nccl_in_bf16(tmp_path):
    """One DeepSpeed ZeRO-3 rank (NCCL, bf16, tree packing with FlexAttention) trains on
    trees the embedded engine sampled on the same GPU in bf16: the update changes every
    parameter, and the engine's log-probs agree with the learner's (train/logprob_gap)."""
    import json

    from arbor.engines.ports import free_port

    script = tmp_path / "rank.py"
    tests = Path(__file__).parent
    script.write_text(ZERO3_SCRIPT.format(tests=str(tests), root=str(tests.parent), path=str(tmp_path / "model")))
    # DS_ACCELERATOR: conftest sets cpu for the CPU suite; this rank is DeepSpeed's CUDA path.
    env = dict(os.environ, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()), DS_ACCELERATOR="cuda")
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    line = next(x for x in out.stdout.splitlines() if x.startswith("ZERO3_RESULT "))
    result = json.loads(line.split(" ", 1)[1])
    figure("zero3_nccl_bf16", **{k: float(v) for k, v in result.items() if isinstance(v, (int, float))})
    assert result["backend"] == "nccl" and result["attention"] in ("auto", "flex")
    # lr 1e-2: AdamW's first step moves each weight by ~lr, which bf16 can show (its spacing
    # at 1.0 is 2^-7); at 1e-4 the norm weights (all 1.0) round back to 1.0 in the bf16
    # model, although DeepSpeed's float32 master weights moved (seen on an H100: 42 of 51).
    assert result["changed"] == result["parameters"] and result["grad_norm"] > 0
    # bf16 engine (KV-cache decoding) vs bf16 learner (packed FlexAttention): different
    # kernels, the same weights — a gap of bf16 rounding, far below a weight mismatch's.
    assert result["train_logprob_gap"] < 0.05 and result["probe_gap"] < 0.05
