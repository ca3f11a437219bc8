"""A tiny random Qwen2 model + offline tokenizer on disk, for engine and sampler tests.

    path = build_tiny_model_dir(tmp_path / "tiny")   # config.json, *.safetensors, tokenizer
    AutoModelForCausalLM.from_pretrained(path); AutoTokenizer.from_pretrained(path)
    model = uniform_qwen2(vocab_size=32)             # in memory: every weight 0, π = 1/32 everywhere

The tokenizer is a byte-level BPE (256 bytes, ``<|endoftext|>``/``<|im_start|>``/
``<|im_end|>``, letter-pair merges up to ``vocab_size``) built in place, so it needs no
download; every id below ``vocab_size`` is a valid model input and any text encodes.
``<|endoftext|>`` (id 0) is the EOS token.
"""

from __future__ import annotations

from pathlib import Path

EOS_TOKEN = "<|endoftext|>"
SPECIAL_TOKENS = [EOS_TOKEN, "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tiny_model_dir(
    path: str | Path,
    *,
    vocab_size: int = 320,
    seed: int = 0,
    hidden_size: int = 64,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    intermediate_size: int | None = None,
) -> Path:
    """Save a random ``Qwen2ForCausalLM`` (float32) and a matching tokenizer in ``path``
    (MLP width ``intermediate_size``, default ``2 * hidden_size``)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = _byte_level_tokenizer(vocab_size)
    tokenizer.save_pretrained(path)

    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 2 * hidden_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        max_position_embeddings=2048,
        eos_token_id=0,
        bos_token_id=0,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    model = Qwen2ForCausalLM(config).to(torch.float32)
    # Random init gives near-uniform logits; scale the head so sampling has structure
    # (distinct greedy paths, EOS sometimes likely) like a real model.
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    model.save_pretrained(path)
    return path


def _byte_level_tokenizer(vocab_size: int):
    """Byte-level BPE: 256 byte tokens, the special tokens, then letter-pair merges.

    Qwen2's own tokenizer class (which transformers 5 picks from a Qwen2 config) rebuilds
    a byte-level BPE from ``vocab``/``merges``, so the tokenizer must be one.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()  # the 256 printable stand-ins for bytes
    alphabet.sort()
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for tok in alphabet:
        vocab[tok] = len(vocab)
    merges: list[tuple[str, str]] = []
    letters = "etaoinsrhdlucmfywgpb"
    pairs = ((a, b) for a in letters for b in letters)
    while len(vocab) < vocab_size:
        a, b = next(pairs)
        merges.append((a, b))
        vocab[a + b] = len(vocab)
    if len(vocab) != vocab_size:
        raise ValueError(f"vocab_size={vocab_size} < {len(vocab)} (bytes + special tokens)")
    core = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        unk_token=None,
        additional_special_tokens=SPECIAL_TOKENS[1:3],
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def uniform_qwen2(vocab_size: int):
    """A float64 one-layer Qwen2 whose weights are all 0: it predicts the uniform distribution,
    log p = −log ``vocab_size`` for every token (loss tests choose behaviour log-probs around it)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                         intermediate_size=32, vocab_size=vocab_size, attn_implementation="sdpa")
    model = Qwen2ForCausalLM(config).double()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    return model
