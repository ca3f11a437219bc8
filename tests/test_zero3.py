"""ZeRO-3 at scale on 2 CPU ranks (gloo): sharded loading, the sharded reference model, bucketed gathers.

Each check compares the sharded path with the path it replaces, on the same tiny models
and packs: the whole model loaded on every rank, then partitioned (``Learner(model=...)``,
unsharded loading), an unsharded reference copy, one gather per parameter.
"""

import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_learner import run_two_ranks, tiny_model_dir
from transformers import Qwen2Config, Qwen2ForCausalLM

from arbor.config_load import load_config
from arbor.train.zero3 import (
    TESTED_DEEPSPEED,
    SafetensorsReader,
    check_deepspeed_version,
    checkpoint_files,
    copy_flat_range,
    partition_without_broadcast,
)

RANK_SCRIPT = """
import dataclasses, functools, os, sys, torch
sys.path.insert(0, {tests!r})
from test_learner import batch, config
from arbor.train.learner import Learner, load_policy
from arbor.train.loss import LossStats
from arbor.train.packed_loss import pack_loss
from arbor.train.packing import assign_to_ranks, loss_denominator, pack_trees
from arbor.train.weight_sync import gathered_buckets, gathered_parameters

rank = int(os.environ["RANK"])
trees, advantages = batch()
packs = pack_trees(trees, advantages, pack_tokens=20)
mine = [packs[i] for i in assign_to_ranks(packs, 2)[rank]]
denominator = loss_denominator(trees, "token")
out = {{}}

def first_step(dtype, ref=None):
    over = ["learner.backend=deepspeed", "learner.zero_stage=3", "learner.num_ranks=2",
            f"learner.dtype={{dtype}}", "learner.sync_bucket_mb=0.004"]  # ~4 KB: many buckets
    if ref:
        over += ["loss.kl_coef=0.5", f"model.ref_path={{ref}}"]
    cfg = config({path!r}, *over)
    sharded = Learner(cfg.model, cfg.learner, cfg.optim, cfg.loss, total_steps=10)
    whole = load_policy(cfg.model, getattr(torch, dtype))  # the whole model on this rank, as before
    today = Learner(cfg.model, cfg.learner, cfg.optim, cfg.loss, total_steps=10, model=whole)
    weights = [sharded.full_state_dict(), today.full_state_dict()]
    losses = [dataclasses.asdict(sum(learner.backward(mine, functools.partial(learner.policy_pack_loss,
                                                                              denominator=denominator)), LossStats()))
              for learner in (sharded, today)]
    return sharded, cfg, weights, losses

for dtype in ("float32", "bfloat16"):
    _, _, out[dtype + "_weights"], out[dtype + "_loss"] = first_step(dtype)

# KL to a different reference: sharded (a ZeRO-3 inference engine) vs a whole copy.
sharded, cfg, _, _ = first_step("float32", ref={ref!r})
whole_ref = load_policy(cfg.model, torch.float32, cfg.model.ref_path).eval()
kl = []
for ref_model in (sharded.ref_model, whole_ref):
    with torch.no_grad():
        kl.append([float(pack_loss(sharded.engine, pack, denominator, kl_coef=0.5, ref_model=ref_model)[1].stats.kl_lin)
                   for pack in mine])
out["kl"] = kl
out["ref_numel"] = sum(p.ds_tensor.numel() for p in sharded.ref_model.parameters())

# Bucketed gather vs one gather per parameter.
model = sharded.model
out["buckets"] = [[(name, t.clone()) for name, t in b] for b in gathered_buckets(model, 3, bucket_mb=0.004)]
out["per_param"] = list(gathered_parameters(model, 3))
torch.save(out, {out!r} + str(rank))
del model
sharded.close()
"""


def reference_dir(path: Path) -> Path:
    """A tiny model of test_learner's shape with other random weights (seed 1)."""
    torch.manual_seed(1)
    cfg = Qwen2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=64, vocab_size=40)
    Qwen2ForCausalLM(cfg).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """Both ranks' results of RANK_SCRIPT (one 2-process run for every check)."""
    tmp = tmp_path_factory.mktemp("zero3")
    path, ref = tiny_model_dir(tmp / "m"), reference_dir(tmp / "ref")
    script = tmp / "rank.py"
    out = str(tmp / "result")
    script.write_text(RANK_SCRIPT.format(tests=str(Path(__file__).parent), path=str(path), ref=str(ref), out=out))
    run_two_ranks(script, timeout_s=400)
    return path, [torch.load(out + str(rank)) for rank in range(2)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_sharded_loading_gives_todays_weights_and_first_loss(two_ranks, dtype):
    path, results = two_ranks
    on_disk = load_file(str(path / "model.safetensors"))
    for result in results:
        sharded, today = result[dtype + "_weights"]
        assert sharded.keys() == today.keys()
        for name in today:
            assert torch.equal(sharded[name], today[name]), name
            assert sharded[name].dtype == getattr(torch, dtype)
            assert torch.equal(sharded[name], on_disk[name].to(sharded[name].dtype)), name
        loss_sharded, loss_today = result[dtype + "_loss"]
        assert loss_sharded == loss_today and loss_today["tokens"] > 0


def test_sharded_reference_kl_equals_a_whole_copy(two_ranks):
    _, results = two_ranks
    for result in results:
        sharded, whole = result["kl"]
        assert sharded == whole and min(whole) > 0  # a different reference: KL is not 0
    # Each rank holds half of the reference (ZeRO-3 pads each tensor to a multiple of 2).
    total = sum(p.numel() for p in Qwen2ForCausalLM(Qwen2Config(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=64, vocab_size=40)).parameters())
    assert all(total / 2 <= r["ref_numel"] <= total / 2 + 64 for r in results)


def test_bucketed_gather_is_bit_exact(two_ranks):
    _, results = two_ranks
    for result in results:
        buckets, per_param = result["buckets"], result["per_param"]
        flat = [item for bucket in buckets for item in bucket]
        assert [name for name, _ in flat] == [name for name, _ in per_param]
        assert all(torch.equal(a, b) for (_, a), (_, b) in zip(flat, per_param))
        # Several buckets, each within ~4 KB unless a single tensor is bigger.
        assert len(buckets) > 3
        assert all(len(b) == 1 or sum(t.nbytes for _, t in b) <= 0.004 * 2**20 for b in buckets)


def test_checkpoint_files_names_what_is_missing(tmp_path):
    with pytest.raises(FileNotFoundError, match="model.path .*no model.safetensors"):
        checkpoint_files(tmp_path)
    path = tiny_model_dir(tmp_path / "m")
    assert "lm_head.weight" in checkpoint_files(path)
    cfg = load_config(None, [f"model.path={path}"])
    assert cfg.learner.sync_bucket_mb == 512


@pytest.mark.parametrize("first, last, limit", [(0, 15, 1000), (4, 11, 1), (7, 15, 13), (14, 15, 4)])
def test_copy_flat_range_reads_a_shard_across_partial_rows(tmp_path, first, last, limit):
    """A 5 x 3 tensor written by safetensors itself: shards that start and end inside rows,
    read one row (or more) at a time, cast to the shard's dtype."""
    from safetensors.torch import save_file

    tensor = torch.arange(15, dtype=torch.float32).reshape(5, 3)
    save_file({"b": torch.ones(7, dtype=torch.bfloat16), "w": tensor}, str(tmp_path / "w.safetensors"))
    reader = SafetensorsReader(tmp_path / "w.safetensors")
    assert reader.shape("w") == [5, 3] and reader.dtype("b") == torch.bfloat16
    out = torch.full((last - first + 2,), -1.0, dtype=torch.bfloat16)  # 2 padding elements, untouched
    copy_flat_range(reader, "w", first, last, out, limit)
    assert out[: last - first].tolist() == list(range(first, last))
    assert out[last - first :].tolist() == [-1.0, -1.0]
    assert torch.equal(reader.read_rows("b", 0, 7), torch.ones(7, dtype=torch.bfloat16))


@pytest.mark.parametrize("version", ["0.19.8", "0.19.9", "0.19.12"])
def test_tested_deepspeed_versions_pass(version):
    check_deepspeed_version(version, "ZeRO-3 construction")


@pytest.mark.parametrize("version", ["0.19.7", "0.20.0", "0.18.9", "1.0.0"])
def test_an_untested_deepspeed_is_an_error_naming_it(version):
    with pytest.raises(RuntimeError, match=rf"deepspeed {re.escape(version)} is untested with arbor's ZeRO-3 "
                                           r"construction.*deepspeed<0.20,>=0.19.8"):
        check_deepspeed_version(version, "ZeRO-3 construction")


def test_the_installed_deepspeed_is_tested_and_its_patch_is_undone():
    """The installed release passes the check inside the real patch, which is put back after."""
    from deepspeed.runtime.zero.partition_parameters import Init

    original = Init._zero_init_param
    with partition_without_broadcast():
        assert Init._zero_init_param is not original
    assert Init._zero_init_param is original
    pins = re.search(r'"deepspeed([^"]*)"', (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
    assert pins is not None and pins.group(1) == ",".join(TESTED_DEEPSPEED)  # one range, two places
