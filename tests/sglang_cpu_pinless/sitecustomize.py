"""Pinned host memory as a no-op, for SGLang 0.5.23's LoRA path on a machine without CUDA.

On ``PYTHONPATH`` of a CPU SGLang server started with ``--enable-lora --lora-backend
torch_native`` (tests/test_sglang_lora.py). SGLang's LoRA code asks for pinned host
buffers, which need the CUDA driver ("Found no NVIDIA driver on your system"):

- ``sglang/srt/lora/layers.py`` lines 139-145, 318-324, 475-480, 594, 717-723, 808-814: each
  LoRA layer's ``output_offset_cpu = torch.tensor(..., device="cpu", pin_memory=True)``
  (at start-up, as the server wraps the target modules);
- ``sglang/srt/lora/backend/torch_backend.py`` lines 225-244 (``prepare_lora_batch``):
  ``.pin_memory()`` and ``pin_memory=True`` on the batch's segment tensors (every batch).

Pinning only speeds up host-to-GPU copies; on a CPU the same tensors unpinned are the
same values, so nothing else changes. Python imports this module at start-up in every
process that has it on its path (the server spawns its scheduler with the same environment).
"""

import functools

import torch

if not torch.cuda.is_available():

    def _unpinned(factory):
        @functools.wraps(factory)
        def make(*args, pin_memory=False, **kwargs):
            return factory(*args, **kwargs)

        return make

    for _name in ("tensor", "zeros", "empty", "ones", "full", "arange", "as_tensor"):
        setattr(torch, _name, _unpinned(getattr(torch, _name)))
    torch.Tensor.pin_memory = lambda self, *args, **kwargs: self
