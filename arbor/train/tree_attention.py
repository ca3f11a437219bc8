"""Tree attention for Hugging Face causal LMs (Qwen2, Llama, ...), three implementations.

Token q may attend to token k iff ``k <= q < subtree_end[k]`` (k is an ancestor of q or
q itself). The model code is untouched: the packed structure reaches attention through
``attention_mask`` / ``position_ids`` or an attention function registered with
transformers' ``AttentionInterface``.

- ``dense``: a [1, 1, N, N] boolean mask with SDPA. O(N²) memory and work; the reference.
- ``blocks`` (CPU default): each attention block (a chain of nodes contiguous in packed
  order) attends to its ancestors' keys plus itself causally; blocks of one shape run as
  one batched SDPA call (:class:`BlockPlan`, worked out once per forward: one gather of
  queries, keys and values per layer, whatever the number of shapes). Non-ancestor pairs
  are never computed, so the cost approaches the ideal. Exact gradients: autograd sums the
  suffixes' key/value gradients into the shared prefix through the gather. GQA goes to
  SDPA as ``enable_gqa``; dropout must be 0.
- ``flex`` (CUDA): FlexAttention with a BlockMask built from the subtree-end intervals
  (block-sparse, no N² tensor at any point). FlexAttention has no backward on CPU, so it
  is for CUDA training; on CPU it runs forward only (tests check the mask with it).

    logits = packed_logits(model, pack, rows, attention="auto")   # [len(rows), V]
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, PreTrainedModel

from arbor.train.packing import AttentionBlock, PackedBatch

Attention = Literal["auto", "dense", "blocks", "flex"]
BLOCKS_IMPL = "arbor_tree_blocks"


def dense_tree_mask(pack: PackedBatch) -> torch.Tensor:
    """[1, 1, N, N] bool, True where query (row) may attend key (column)."""
    idx = torch.arange(pack.num_tokens)
    q, k = idx[:, None], idx[None, :]
    return ((k <= q) & (q < pack.subtree_end[None, :]))[None, None]


def flex_block_mask(pack: PackedBatch, device: torch.device | str, block_size: int = 128) -> Any:
    """FlexAttention BlockMask of the tree rule, built from ``subtree_end`` without an N² tensor.

    Key k is visible to the query interval [k, subtree_end[k]). A (query block, key block)
    tile is *full* when every key's interval covers the whole query block, *partial* when
    some key's interval meets it (mask_mod decides per pair), else skipped. Work and memory
    are O(N²/block_size) booleans, unlike ``create_block_mask`` (eager), which evaluates
    mask_mod on all N² pairs.
    """
    from torch.nn.attention.flex_attention import BlockMask

    n = pack.num_tokens
    blocks = -(-n // block_size)
    padded = blocks * block_size
    # Padded keys get an empty interval (end 0): never visible, and mask_mod may read them.
    end = torch.zeros(padded, dtype=torch.long)
    end[:n] = pack.subtree_end
    key = torch.arange(padded)
    q_first = torch.arange(blocks) * block_size  # [Qb]
    q_stop = (q_first + block_size).clamp(max=n)  # [Qb] exclusive, real queries only
    # [Qb, padded]: does key k's visibility interval meet / cover the query block?
    meets = (torch.maximum(key[None], q_first[:, None]) < torch.minimum(end[None], q_stop[:, None]))
    covers = (key[None] <= q_first[:, None]) & (end[None] >= q_stop[:, None])
    meets = meets.view(blocks, blocks, block_size).any(-1)  # [Qb, Kb]
    full = covers.view(blocks, blocks, block_size).all(-1)
    partial = meets & ~full

    def as_kv_blocks(tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # Count per query block, and the key-block indices of the selected tiles first.
        order = torch.argsort((~tiles).to(torch.int8), dim=-1, stable=True)
        return (tiles.sum(-1).to(torch.int32)[None, None].to(device),
                order.to(torch.int32)[None, None].to(device))

    end_dev = end.to(device)

    def tree_rule(b: Any, h: Any, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return (k <= q) & (q < end_dev[k])

    kv_num, kv_idx = as_kv_blocks(partial)
    full_num, full_idx = as_kv_blocks(full)
    return BlockMask.from_kv_blocks(
        kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=block_size, mask_mod=tree_rule,
        seq_lengths=(n, n),
    )


def _bottom_right_causal(n: int, n_kv: int, device: torch.device) -> torch.Tensor:
    """[n, n_kv] bool: query j sees keys 0 .. n_kv − n + j (its context, then itself causally)."""
    if n * n_kv <= 1 << 22:  # every layer reuses the mask: keep small ones, not huge ones
        return _cached_bottom_right_causal(n, n_kv, device)
    return torch.ones(n, n_kv, dtype=torch.bool, device=device).tril(n_kv - n)


@functools.lru_cache(maxsize=128)
def _cached_bottom_right_causal(n: int, n_kv: int, device: torch.device) -> torch.Tensor:
    return torch.ones(n, n_kv, dtype=torch.bool, device=device).tril(n_kv - n)


@dataclass
class BlockPlan:
    """How one pack's attention blocks run, worked out once per forward (not once per layer).

    Blocks of one shape (queries, context + own keys) form a group that runs as one batched
    SDPA call. All queries are gathered in group order with one ``index_select``, all keys
    and values likewise, then split per group: the backward is one ``index_add`` per tensor
    (``split``'s backward is a concatenation). A gather per group made every group's
    backward allocate, fill and add an N-long gradient: O(groups × N) traffic, and with
    uneven segment lengths nearly every block is its own group.
    """

    groups: list[tuple[int, int, int]]  # (blocks g, queries n, keys n_kv) per group, in gather order
    query_index: torch.Tensor | None  # [N] packed index of each query in group order; None: packed order
    key_index: torch.Tensor | None  # [Σ g·n_kv] packed index of each key in group order; None: packed order
    restore: torch.Tensor | None  # [N] group order -> packed order; None when query_index is None
    num_tokens: int


def plan_blocks(blocks: Sequence[AttentionBlock], device: torch.device | str) -> BlockPlan:
    """Group ``blocks`` by shape and build the gather indices (on ``device``)."""
    groups: dict[tuple[int, int], list[AttentionBlock]] = {}
    for block in blocks:
        n = block.end - block.start
        groups.setdefault((n, n + len(block.context)), []).append(block)
    queries, keys = [], []
    for members in groups.values():
        for block in members:
            own = torch.arange(block.start, block.end)
            queries.append(own)
            keys += [block.context, own]
    num_tokens = sum(b.end - b.start for b in blocks)
    query_index = torch.cat(queries) if queries else torch.zeros(0, dtype=torch.long)
    in_order = bool((query_index == torch.arange(num_tokens)).all())
    key_index = torch.cat(keys) if keys else torch.zeros(0, dtype=torch.long)
    context_free = all(n_kv == n for n, n_kv in groups)
    return BlockPlan(
        groups=[(len(members), n, n_kv) for (n, n_kv), members in groups.items()],
        query_index=None if in_order else query_index.to(device),
        # Without context the keys are the queries: same order, same gather.
        key_index=None if in_order and context_free else key_index.to(device),
        restore=None if in_order else torch.argsort(query_index).to(device),
        num_tokens=num_tokens,
    )


def block_tree_attention(
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, H, N, D]
    key: torch.Tensor,  # [1, H_kv, N, D]
    value: torch.Tensor,  # [1, H_kv, N, D]
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    arbor_blocks: BlockPlan | Sequence[AttentionBlock] | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention over ancestor blocks only. Returns ([1, N, H, D], None) like HF's SDPA path.

    ``arbor_blocks``: the pack's blocks, or their :class:`BlockPlan` (``packed_forward``
    plans once per forward; a list is planned here, once per layer).
    """
    if arbor_blocks is None:
        raise ValueError(f"{BLOCKS_IMPL} attention needs the pack's blocks (arbor_blocks=...)")
    if dropout:
        raise ValueError("tree attention is for training RL policies: attention dropout must be 0")
    if query.shape[0] != 1:
        raise ValueError(f"packed tree attention takes one packed row, got batch {query.shape[0]}")
    plan = arbor_blocks if isinstance(arbor_blocks, BlockPlan) else plan_blocks(arbor_blocks, key.device)
    if plan.num_tokens != query.shape[2]:
        raise ValueError(f"arbor_blocks cover another length than the sequence ({query.shape[2]} tokens)")
    gqa = query.shape[1] != key.shape[1]
    # Token-major [N, H, D]: HF's projections are laid out so, which makes a gather of
    # tokens a copy of whole rows.
    q_all, k_all, v_all = (x[0].transpose(0, 1) for x in (query, key, value))
    if plan.query_index is not None:
        q_all = q_all.index_select(0, plan.query_index)
    if plan.key_index is not None:
        k_all, v_all = k_all.index_select(0, plan.key_index), v_all.index_select(0, plan.key_index)
    q_parts = q_all.split([g * n for g, n, _ in plan.groups])
    k_parts = k_all.split([g * n_kv for g, _, n_kv in plan.groups])
    v_parts = v_all.split([g * n_kv for g, _, n_kv in plan.groups])
    outputs = []
    for (g, n, n_kv), q, k, v in zip(plan.groups, q_parts, k_parts, v_parts):
        # [g·len, H, D] -> [g, H, len, D]: views, no copy.
        q, k, v = (x.view(g, -1, *x.shape[1:]).transpose(1, 2) for x in (q, k, v))
        if n_kv == n:  # no context: plain causal attention
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling, enable_gqa=gqa)
        else:
            # Context keys all visible, the block's own keys causally: a causal mask aligned
            # to the bottom-right corner of the [n, n_kv] score matrix.
            mask = _bottom_right_causal(n, n_kv, key.device)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling, enable_gqa=gqa)
        outputs.append(out.transpose(1, 2).reshape(g * n, out.shape[1], out.shape[3]))  # [g·n, H, D]
    out = torch.cat(outputs) if len(outputs) > 1 else outputs[0]  # [N, H, D] in group order
    if plan.restore is not None:
        out = out.index_select(0, plan.restore)  # back to packed order
    return out[None], None


AttentionInterface.register(BLOCKS_IMPL, block_tree_attention)


@contextmanager
def attention_implementation(model: PreTrainedModel, name: str) -> Iterator[None]:
    """Temporarily switch the model's attention implementation."""
    previous = model.config._attn_implementation
    model.config._attn_implementation = name
    try:
        yield
    finally:
        model.config._attn_implementation = previous


# FlexAttention's compiled kernel needs queries, keys and values of at least 16 dimensions
# (torch 2.11 inductor: "NYI: embedding dimension ... must be at least 16", seen on an H100).
FLEX_MIN_HEAD_DIM = 16


def head_dim(model: PreTrainedModel) -> int:
    """The model's attention head dimension (config.head_dim, else hidden / heads)."""
    cfg = model.config
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def resolve_attention(attention: Attention, device: torch.device, head_dim: int | None = None) -> Attention:
    """The kernel ``attention`` means on ``device``: ``auto`` is FlexAttention on CUDA (block
    attention for heads under 16 dimensions, which Flex cannot compile) and block attention
    on the CPU."""
    small = head_dim is not None and head_dim < FLEX_MIN_HEAD_DIM
    if attention == "auto":
        return "flex" if device.type == "cuda" and not small else "blocks"
    if attention == "flex" and device.type != "cuda" and torch.is_grad_enabled():
        raise ValueError("attention='flex' trains on CUDA only (FlexAttention has no CPU backward)")
    if attention == "flex" and small and device.type == "cuda":
        raise ValueError(f"attention='flex' needs attention heads of at least {FLEX_MIN_HEAD_DIM} dimensions "
                         f"(FlexAttention's compiled kernel); this model's have {head_dim}: set "
                         "learner.attention to blocks or dense")
    return attention


def packed_logits(
    model: PreTrainedModel,
    pack: PackedBatch,
    rows: torch.Tensor,  # [M] int64 packed positions whose next-token logits are needed
    attention: Attention = "auto",
) -> torch.Tensor:
    """Logits [M, V] at ``rows`` of one forward pass over the packed trees.

    ``model`` may be a DeepSpeed engine wrapping the HF model (its forward must run
    through the engine for ZeRO-3's gradient accumulation).
    """
    device = next(model.parameters()).device
    return packed_forward(model, pack, attention, rows.to(device)).logits[0]


def packed_forward(
    model: PreTrainedModel, pack: PackedBatch, attention: Attention, logits_to_keep: int | torch.Tensor
) -> Any:
    """The model's forward over one pack with the chosen tree attention (HF CausalLM output)."""
    hf_model: PreTrainedModel = getattr(model, "module", model)
    device = next(model.parameters()).device
    attention = resolve_attention(attention, device, head_dim(hf_model))
    input_ids = pack.input_ids.to(device)[None]
    position_ids = pack.position_ids.to(device)[None]
    common = dict(input_ids=input_ids, position_ids=position_ids, logits_to_keep=logits_to_keep, use_cache=False)
    if attention == "dense":
        implementation = hf_model.config._attn_implementation
        if implementation not in ("sdpa", "eager"):
            raise ValueError(f"dense tree masks need sdpa or eager attention, not {implementation}")
        mask = dense_tree_mask(pack).to(device)
        if implementation == "eager":  # eager wants an additive float mask
            dtype = next(model.parameters()).dtype
            mask = torch.zeros(mask.shape, dtype=dtype, device=device).masked_fill(~mask, torch.finfo(dtype).min)
        return model(attention_mask=mask, **common)
    if attention == "blocks":
        with attention_implementation(hf_model, BLOCKS_IMPL):
            return model(arbor_blocks=plan_blocks(pack.blocks, device), **common)
    if attention == "flex":
        with attention_implementation(hf_model, "flex_attention"):
            return model(attention_mask=flex_block_mask(pack, device), **common)
    raise ValueError(f"attention must be auto, dense, blocks or flex, got {attention!r}")
