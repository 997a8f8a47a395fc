"""CUDA kernels of mini-vllm and their checked Python wrappers.

The kernels live in `csrc/` and build into the module `mini_vllm._C` with
`bash scripts/build_kernels.sh`. Without it (or without a GPU) `is_available()`
is False, `unavailable_reason()` says why, and callers use the torch
references in `mini_vllm.ops.reference` (the engine does this by itself).

Public API:
    paged_decode_attention   one new token per sequence over its paged context
    reshape_and_cache        write new tokens' K/V into their cache slots
    prefill_attention        prompts (and prompt chunks after a cached prefix)
    flash_prefill            the same over packed K/V by our Hopper kernel (sm_90a)
    gather_kv_cache          paged K/V -> contiguous rows
    gemv                     y = x @ W.T for 1 to 16 rows of x (decode's linear layers)
    sample_tokens            one token per row of softmax(logits / T), in one pass

On sm_90+ the kernels of a decode step are launched with programmatic
dependent launch (csrc/pdl.cuh);
`set_programmatic_launch(False)` turns it off.
"""

from mini_vllm.ops._extension import (
    BUILD_COMMAND,
    is_available,
    programmatic_launch,
    set_programmatic_launch,
    unavailable_reason,
)
from mini_vllm.ops.cache_ops import gather_kv_cache, reshape_and_cache
from mini_vllm.ops.gemv import gemv
from mini_vllm.ops.paged_attention import (
    DECODE_VERSIONS,
    DEFAULT_DECODE_VERSION,
    decode_partition_size,
    longest_first,
    paged_decode_attention,
)
from mini_vllm.ops.prefill import (
    PREFILL_BACKENDS,
    flash_prefill,
    prefill_attention,
    prefill_backend,
)
from mini_vllm.ops.sampling import sample_tokens

__all__ = [
    "BUILD_COMMAND",
    "DECODE_VERSIONS",
    "DEFAULT_DECODE_VERSION",
    "PREFILL_BACKENDS",
    "decode_partition_size",
    "flash_prefill",
    "gather_kv_cache",
    "gemv",
    "is_available",
    "longest_first",
    "paged_decode_attention",
    "prefill_attention",
    "prefill_backend",
    "programmatic_launch",
    "reshape_and_cache",
    "sample_tokens",
    "set_programmatic_launch",
    "unavailable_reason",
]
