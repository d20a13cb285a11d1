"""Arrays as torch tensors; torch is imported only here, and only when asked for.

This module knows arrays, not batches: TokenizedBatch and PackedBatch (tokenizer_client.batches) convert
themselves with :func:`tensors`.

Pinned (page-locked) memory needs an accelerator: on a CPU-only torch build (e.g. 2.13.0+cpu)
``Tensor.pin_memory()`` raises RuntimeError. ``pin_memory=True`` therefore pins when torch reports
an accelerator (CUDA or another backend), and otherwise warns once per process and hands out
ordinary tensors, so the same training script runs on a laptop and on a GPU node.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np

_warned = False
_warn_lock = threading.Lock()


def import_torch() -> Any:
    try:
        import torch
    except ImportError as exc:
        raise ImportError("as_torch=True needs torch: pip install 'tokenizer-service[torch]'") from exc
    return torch


def can_pin(torch: Any) -> bool:
    """Whether this torch build can allocate pinned memory (it needs CUDA or another accelerator)."""
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None and hasattr(accelerator, "is_available"):
        return bool(accelerator.is_available())
    return bool(torch.cuda.is_available())


def check_torch(pin_memory: bool) -> bool:
    """Import torch now (a missing torch fails at prefetch(), not in the background); the pinning to use."""
    global _warned
    torch = import_torch()
    if not pin_memory or can_pin(torch):
        return pin_memory
    with _warn_lock:
        if not _warned:
            _warned = True
            warnings.warn(
                f"pin_memory=True ignored: torch {torch.__version__} has no CUDA or other accelerator, "
                "so tensors stay in pageable memory",
                RuntimeWarning,
                stacklevel=4,
            )
    return False


def tensor(array: Any, torch: Any, pin_memory: bool) -> Any:
    """A CPU tensor with the array's dtype and shape; one copy (into pinned memory when asked)."""
    if isinstance(array, torch.Tensor):
        return array.pin_memory() if pin_memory and not array.is_pinned() else array
    array = np.asarray(array)
    if pin_memory:
        out = torch.empty(array.shape, dtype=torch.from_numpy(np.empty(0, array.dtype)).dtype, pin_memory=True)
        out.numpy()[...] = array
        return out
    if not array.flags.writeable:  # answers are views of the response body; torch wants writable memory
        array = array.copy()
    return torch.from_numpy(array)


def tensors(arrays: Sequence[Any], pin_memory: bool) -> list[Any]:
    """Each array as a CPU tensor of its dtype and shape (in pinned memory when asked); imports torch."""
    torch = import_torch()
    return [tensor(array, torch, pin_memory) for array in arrays]
