"""Tied input/output embeddings and a padded vocabulary through training, checkpoints, HF
export and weight sync (SmolLM2 and Qwen2.5's small models tie them; many checkpoints pad
``config.vocab_size`` past ``len(tokenizer)``).

Tiny random Llama and Qwen2 models, tied, with ``vocab_size`` = 48 while the data only
uses ids below 40 (``test_learner.batch``), as padded real embeddings are.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_learner import batch, config
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from arbor.engines.embedded.engine import LocalEngine
from arbor.engines.ports import free_port
from arbor.train.learner import Learner
from arbor.train.packing import loss_denominator, pack_trees
from arbor.train.weight_sync import gathered_parameters

PADDED_VOCAB = 48  # ids 40..47 never occur: the padded rows of a real embedding


def tied_model_dir(path: Path, family: str) -> Path:
    """A random tied ``family`` ("llama" or "qwen2") model saved in ``path``."""
    torch.manual_seed(0)
    shape = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=64, vocab_size=PADDED_VOCAB, tie_word_embeddings=True)
    model = LlamaForCausalLM(LlamaConfig(**shape)) if family == "llama" else Qwen2ForCausalLM(Qwen2Config(**shape))
    model.save_pretrained(path)
    return path


def assert_tied(model: torch.nn.Module) -> None:
    """One tensor serves both ends: changing the input embedding changes the head."""
    head, embed = model.get_output_embeddings().weight, model.get_input_embeddings().weight
    assert head.data_ptr() == embed.data_ptr(), "lm_head and embed_tokens are separate tensors"


def train_one_step(learner: Learner) -> None:
    trees, advantages = batch()
    learner.step(pack_trees(trees, advantages, pack_tokens=20), loss_denominator(trees, "token"))


@torch.no_grad()
def logits(model: torch.nn.Module) -> torch.Tensor:
    return model(input_ids=torch.tensor([[1, 2, 3, 39]])).logits  # [1, 4, vocab]


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_torch_learner_keeps_the_tie_through_training_checkpoint_export_and_sync(tmp_path, family):
    path = tied_model_dir(tmp_path / "m", family)
    cfg = config(path, "learner.backend=torch", "optim.lr=1e-2")
    learner = Learner(cfg.model, cfg.learner, cfg.optim, cfg.loss, total_steps=10)
    embed_before = learner.model.get_input_embeddings().weight.detach().clone()
    train_one_step(learner)
    assert_tied(learner.model)
    embed = learner.model.get_input_embeddings().weight.detach()
    assert not torch.equal(embed, embed_before)  # the step moved the shared weight

    # HF export: loads back tied, with the trained weights, giving the learner's logits.
    learner.export_hf(tmp_path / "export")
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "export")
    assert exported.config.tie_word_embeddings and exported.config.vocab_size == PADDED_VOCAB
    assert_tied(exported)
    assert torch.equal(exported.get_input_embeddings().weight, embed)
    torch.testing.assert_close(logits(exported), logits(learner.model), rtol=0, atol=0)

    # Checkpoint: a fresh learner resumes tied, with the same weights and optimizer state.
    learner.save(tmp_path / "ckpt")
    resumed = Learner(cfg.model, cfg.learner, cfg.optim, cfg.loss, total_steps=10)
    resumed.load(tmp_path / "ckpt")
    assert_tied(resumed.model)
    assert torch.equal(resumed.model.get_output_embeddings().weight, embed)
    train_one_step(resumed)
    train_one_step(learner)
    assert torch.equal(resumed.model.get_input_embeddings().weight, learner.model.get_input_embeddings().weight)

    # Weight sync sends the shared weight once (named_parameters); the engine's head follows.
    engine = LocalEngine(path)
    try:
        names = [name for name, _ in gathered_parameters(learner.model, 0)]
        assert sum("embed_tokens" in n or "lm_head" in n for n in names) == 1
        engine.load_weights(dict(gathered_parameters(learner.model, 0)), "1")
        assert_tied(engine.model)
        torch.testing.assert_close(logits(engine.model), logits(learner.model), rtol=0, atol=0)
    finally:
        engine.shutdown()


ZERO3_SCRIPT = """
import sys, torch
sys.path.insert(0, {tests!r})
from test_learner import config
from test_tied_embeddings import train_one_step
from arbor.train.learner import Learner

cfg = config({path!r}, "learner.backend=deepspeed", "learner.zero_stage=3", "learner.num_ranks=1", "optim.lr=1e-2")
learner = Learner(cfg.model, cfg.learner, cfg.optim, cfg.loss, total_steps=10)
train_one_step(learner)
learner.export_hf({out!r} + "/export")
learner.save({out!r} + "/ckpt")
trained = learner.full_state_dict()
resumed = Learner(cfg.model, cfg.learner, cfg.optim, cfg.loss, total_steps=10)
resumed.load({out!r} + "/ckpt")
torch.save({{"trained": trained, "resumed": resumed.full_state_dict()}}, {out!r} + "/state.pt")
"""


def test_zero3_export_and_checkpoint_of_a_tied_model(tmp_path):
    """ZeRO-3 partitions the shared weight once; the export and the resumed checkpoint hold
    it once, tied, equal to the trained weight (one rank: the 2-rank gradients of tied
    models are test_learner's)."""
    path = tied_model_dir(tmp_path / "m", "llama")
    script = tmp_path / "rank.py"
    script.write_text(ZERO3_SCRIPT.format(tests=str(Path(__file__).parent), path=str(path), out=str(tmp_path)))
    env = dict(os.environ, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    state = torch.load(tmp_path / "state.pt")
    trained, resumed = state["trained"], state["resumed"]
    assert "lm_head.weight" not in trained  # named_parameters lists a shared weight once
    original = LlamaForCausalLM.from_pretrained(path).model.embed_tokens.weight
    assert not torch.equal(trained["model.embed_tokens.weight"], original)
    for name, tensor in trained.items():
        assert torch.equal(resumed[name], tensor), name
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "export", dtype=torch.float32)
    assert_tied(exported)
    assert torch.equal(exported.model.embed_tokens.weight, trained["model.embed_tokens.weight"])
