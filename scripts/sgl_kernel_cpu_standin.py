"""Stand-in for `sgl_kernel` on a CPU without AMX (installed by scripts/sglang_cpu_env.sh).

No CPU build of sgl-kernel is on the package index. With `SGLANG_USE_CPU_ENGINE=1`, SGLang
0.5.23's CPU path runs every layer through its torch fallback on a CPU without AMX, yet five
of its modules import these eight names from `sgl_kernel` when they load. None is called
when serving without speculative decoding:

- `assign_req_to_token_pool_cpu`: sglang/srt/mem_cache/allocation.py; called only by
  `alloc_for_spec_decode` and the DFlash worker (speculative decoding).
- `copy_all_layer_kv_cache_cpu`: sglang/kernels/ops/kvcache/cache_move.py; KV slot moves,
  set up only when `speculative_algorithm` is set (kv_cache_configurator's
  `enable_kv_cache_copy`).
- `assign_draft_cache_locs_contiguous_cpu`, `assign_extend_cache_locs_cpu`:
  sglang/kernels/ops/speculative/cache_locs.py; EAGLE draft KV locations.
- `fill_accept_out_cache_loc_cpu`, `fill_bonus_tokens_cpu`:
  sglang/kernels/ops/speculative/eagle.py; EAGLE verification.
- `build_tree_kernel_efficient_cpu`, `verify_tree_greedy_cpu`:
  sglang/kernels/ops/speculative/spec_tree.py; speculative draft trees.

Each raises if called, so a path that does need the real kernel stops with its name.
"""

from __future__ import annotations

from typing import NoReturn

# name -> the SGLang module that imports it at load time
IMPORTED_BY = {
    "assign_req_to_token_pool_cpu": "sglang/srt/mem_cache/allocation.py",
    "copy_all_layer_kv_cache_cpu": "sglang/kernels/ops/kvcache/cache_move.py",
    "assign_draft_cache_locs_contiguous_cpu": "sglang/kernels/ops/speculative/cache_locs.py",
    "assign_extend_cache_locs_cpu": "sglang/kernels/ops/speculative/cache_locs.py",
    "fill_accept_out_cache_loc_cpu": "sglang/kernels/ops/speculative/eagle.py",
    "fill_bonus_tokens_cpu": "sglang/kernels/ops/speculative/eagle.py",
    "build_tree_kernel_efficient_cpu": "sglang/kernels/ops/speculative/spec_tree.py",
    "verify_tree_greedy_cpu": "sglang/kernels/ops/speculative/spec_tree.py",
}


def _missing(name: str):
    def kernel(*args: object, **kwargs: object) -> NoReturn:
        raise NotImplementedError(
            f"sgl_kernel.{name} (imported by {IMPORTED_BY[name]}) was called, but this "
            "environment has only arbor's CPU stand-in for sgl_kernel: the kernel serves "
            "speculative decoding / KV moves, which this CPU set-up does not support"
        )

    kernel.__name__ = name
    return kernel


assign_req_to_token_pool_cpu = _missing("assign_req_to_token_pool_cpu")
copy_all_layer_kv_cache_cpu = _missing("copy_all_layer_kv_cache_cpu")
assign_draft_cache_locs_contiguous_cpu = _missing("assign_draft_cache_locs_contiguous_cpu")
assign_extend_cache_locs_cpu = _missing("assign_extend_cache_locs_cpu")
fill_accept_out_cache_loc_cpu = _missing("fill_accept_out_cache_loc_cpu")
fill_bonus_tokens_cpu = _missing("fill_bonus_tokens_cpu")
build_tree_kernel_efficient_cpu = _missing("build_tree_kernel_efficient_cpu")
verify_tree_greedy_cpu = _missing("verify_tree_greedy_cpu")
