"""Decode batch: in-place KV buffers, the lean Llama-family step vs the model's forward."""

from __future__ import annotations

import pytest
import torch

from arbor.engines.embedded.decode_batch import DecodeBatch, HFDecoder, LlamaDecoder, make_decoder
from arbor.engines.embedded.radix_cache import stack_kv

CPU = torch.device("cpu")


def tiny_model(model_type: str) -> torch.nn.Module:
    """A random 2-layer model of ``model_type`` with GQA (4 query heads, 2 KV heads)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        model_type,
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


@pytest.fixture(scope="module", params=["qwen2", "llama", "qwen3"])
def model(request) -> torch.nn.Module:
    return tiny_model(request.param)


def prefill(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """KV of ``ids`` from the model's own forward, ``[2, L, H_kv, T, D]``."""
    with torch.no_grad():
        out = model(torch.tensor([ids]), use_cache=True)
    cache = out.past_key_values
    return stack_kv([layer.keys[0] for layer in cache.layers], [layer.values[0] for layer in cache.layers])


def full_logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


def test_llama_family_uses_the_lean_step(model):
    assert isinstance(make_decoder(model), LlamaDecoder)


@pytest.mark.parametrize("decoder_class", [LlamaDecoder, HFDecoder])
def test_batched_decode_of_ragged_rows_equals_the_full_forward(model, decoder_class):
    """Rows of lengths 3, 9 and 5 decode 6 tokens together (one joins late, one leaves
    early): every row's logits equal the model's forward over its whole sequence."""
    decoder = decoder_class(model)
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(1, 97, (n + 6,), generator=g).tolist() for n in (3, 9, 5)]
    prompts = [3, 9, 5]
    batch = DecodeBatch(CPU)
    batch.add([prefill(model, seqs[0][: prompts[0]]), prefill(model, seqs[1][: prompts[1]])])
    active = [0, 1]
    for step in range(6):
        if step == 2:  # continuous batching: row 2 joins mid-flight
            batch.add([prefill(model, seqs[2][: prompts[2] + 2])])
            active.append(2)
        fed = [seqs[r][prompts[r] + step] for r in active]
        logits = decoder(batch, torch.tensor(fed))
        for b, r in enumerate(active):
            position = batch.lengths[b] - 1
            expected = full_logits(model, seqs[r][: position + 1])[-1]
            torch.testing.assert_close(logits[b], expected, atol=1e-5, rtol=1e-5)
        if step == 3:  # row 1 leaves; the last row moves into its slot
            order = batch.remove([active.index(1)])
            active = [active[b] for b in order]


def test_batched_equals_one_row_at_a_time(model):
    """The same row decoded alone and beside others gives the same logits (≤1e-5)."""
    decoder = LlamaDecoder(model)
    g = torch.Generator().manual_seed(2)
    seqs = [torch.randint(1, 97, (n,), generator=g).tolist() for n in (4, 11, 7, 2)]
    together = DecodeBatch(CPU)
    together.add([prefill(model, s[:-1]) for s in seqs])
    batched = decoder(together, torch.tensor([s[-1] for s in seqs]))
    for b, s in enumerate(seqs):
        alone = DecodeBatch(CPU)
        alone.add([prefill(model, s[:-1])])
        torch.testing.assert_close(
            batched[b], decoder(alone, torch.tensor([s[-1]]))[0], atol=1e-5, rtol=1e-5
        )


def test_remove_moves_last_rows_into_holes_and_keeps_their_kv():
    batch = DecodeBatch(CPU)
    rows = []
    for b, length in enumerate([2, 5, 3, 4, 1]):
        k = torch.full((1, length, 2), float(b))
        rows.append(stack_kv([k], [-k]))
    batch.add(rows)
    order = batch.remove([0, 2])
    assert order == [3, 1, 4]  # slot 0 <- row 3, slot 2 <- row 4
    assert batch.lengths == [4, 5, 1]
    assert batch.length_tensor().tolist() == [4, 5, 1]
    for slot, old in enumerate(order):
        keys, values = batch.row_kv(slot)  # [L, H, T, D] each
        assert keys[0].shape == (1, batch.lengths[slot], 2)
        assert (keys[0] == old).all() and (values[0] == -old).all()
    batch.remove([0, 1, 2])
    assert batch.size == 0


def test_buffers_grow_without_losing_rows():
    batch = DecodeBatch(CPU)
    k = torch.arange(6.0).view(1, 3, 2)
    batch.add([stack_kv([k], [k + 1])])
    capacity = batch.keys[0].shape
    wide = torch.zeros(1, capacity[2] + 10, 2)
    batch.add([stack_kv([wide], [wide])])
    batch.add([stack_kv([k], [k])] * capacity[0])  # more rows than the first allocation held
    assert batch.keys[0].shape[0] > capacity[0] and batch.keys[0].shape[2] > capacity[2]
    keys, values = batch.row_kv(0)
    assert torch.equal(keys[0], k) and torch.equal(values[0], k + 1)
    assert batch.lengths[:2] == [3, capacity[2] + 10]


def test_other_architectures_fall_back_to_the_models_forward():
    """GPT-2 is no Llama-family model: its steps run through its own forward, and still
    equal the full forward row by row."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "gpt2", vocab_size=97, n_embd=64, n_layer=2, n_head=4, n_positions=256
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    decoder = make_decoder(model)
    assert isinstance(decoder, HFDecoder)
    seqs = [[5, 6, 7, 8, 9], [10, 11, 12]]
    batch = DecodeBatch(CPU)
    batch.add([prefill(model, s[:-1]) for s in seqs])
    logits = decoder(batch, torch.tensor([s[-1] for s in seqs]))
    for b, s in enumerate(seqs):
        torch.testing.assert_close(logits[b], full_logits(model, s)[-1], atol=1e-5, rtol=1e-5)
