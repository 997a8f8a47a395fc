"""Fused Gumbel-max sampling on the GPU (`csrc/sampling_kernels.cu`), and its reference.

`sample_tokens` draws one token per row of `softmax(logits * inv_temperature)`
in one pass over the logits, in their own dtype:

    argmax_i (logit_i / T + G_i),   G_i = -log(-log(1 - w_i)) ~ Gumbel(0, 1)

which picks token i with probability exactly `softmax(logits / T)_i`, the
same distribution as the torch sampler's `argmax(probs / Exponential(1))`.
The uniform `w_i` comes from Philox4x32-10 keyed by the row's `(key, counter)`
pair (`seeds[r]`), so a row's draw depends on nothing else in the batch.

`sample_scores_ref` computes the same scores in float64 with numpy, from the
same Philox words: the tests compare the kernel's choice with it.
"""

from __future__ import annotations

import numpy as np
import torch

from mini_vllm.ops._checks import check_same_device, check_tensor
from mini_vllm.ops._extension import dtype_code, extension, num_sms

SAMPLE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_COUNTER_TAG = 0x6D696E69  # the Philox counter's last word ("mini"), as in the kernel
_THREADS = 256  # per block of the partial kernel
_BLOCKS_PER_SM = 8  # resident blocks of 256 threads on an SM; two waves are the target


def splitmix64(x: int) -> int:
    """A 64-bit mixer (Steele et al.): turns a user's seed into a well-spread Philox key.

    Returns the result as a signed int64, ready for an int64 tensor.
    """
    x = (x + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    x ^= x >> 31
    return x - (1 << 64) if x >= 1 << 63 else x


def num_splits(num_rows: int, vocab: int, sm_count: int) -> int:
    """Blocks per row: about two full waves over the GPU, at least one group of 4 per thread."""
    target = 2 * _BLOCKS_PER_SM * sm_count
    max_splits = min(1024, max(1, -(-vocab // (4 * _THREADS))))
    return max(1, min(-(-target // num_rows), max_splits))


# --8<-- [start:sample_tokens]
def sample_tokens(logits: torch.Tensor, inv_temperature: torch.Tensor,
                  seeds: torch.Tensor) -> torch.Tensor:
    """One token per row: Gumbel-max over `logits * inv_temperature`, in one pass.

    Args:
        logits: `[N, V]` float16, bfloat16 or float32, the vocabulary dense
            (rows may be strided); `-inf` marks tokens that may not be drawn.
        inv_temperature: `[N]` float32, `1 / T` per row; `0` makes the row greedy
            (its argmax, no noise).
        seeds: `[N, 2]` int64, each row's Philox key and counter. A row with
            the same key, counter and logits always draws the same token.

    Returns:
        `[N]` int64 token ids.

    Raises:
        ValueError: on a wrong dtype, shape, layout or device.
    """
    check_tensor("logits", logits, ndim=2, dtypes=SAMPLE_DTYPES, contiguous=False)
    check_tensor("inv_temperature", inv_temperature, ndim=1, dtypes=(torch.float32,))
    check_tensor("seeds", seeds, ndim=2, dtypes=(torch.int64,))
    if logits.stride(1) != 1:
        raise ValueError("logits: the vocabulary dimension must be dense (stride 1)")
    n, vocab = logits.shape
    if inv_temperature.shape[0] != n or tuple(seeds.shape) != (n, 2):
        raise ValueError(f"inv_temperature {tuple(inv_temperature.shape)} and seeds "
                         f"{tuple(seeds.shape)} must be [{n}] and [{n}, 2] for {n} rows")
    if vocab == 0:
        raise ValueError("logits: the vocabulary is empty")
    device = check_same_device(logits=logits, inv_temperature=inv_temperature, seeds=seeds)
    out = torch.empty(n, dtype=torch.int64, device=device)
    if n == 0:
        return out
    splits = num_splits(n, vocab, num_sms(device))
    partials = torch.empty(n * splits, dtype=torch.int64, device=device)  # uint64 in the kernel
    extension().sample_tokens(
        out.data_ptr(), partials.data_ptr(), logits.data_ptr(), inv_temperature.data_ptr(),
        seeds.data_ptr(), n, vocab, splits, logits.stride(0), dtype_code(logits.dtype),
        torch.cuda.current_stream(device).cuda_stream,
    )
    return out
# --8<-- [end:sample_tokens]


# ------------------------------------------------------------------ the reference

_M0, _M1, _W0, _W1 = 0xD2511F53, 0xCD9E8D57, 0x9E3779B9, 0xBB67AE85
_U32 = np.uint64(0xFFFFFFFF)


def philox4x32_ref(counters: np.ndarray, key: int) -> np.ndarray:
    """Philox4x32-10 of `[G, 4]` uint32 counters under a 64-bit key: `[G, 4]` uint32 words."""
    c = counters.astype(np.uint64)
    k0, k1 = np.uint64(key & 0xFFFFFFFF), np.uint64((key >> 32) & 0xFFFFFFFF)
    for _ in range(10):
        p0 = np.uint64(_M0) * c[:, 0]  # < 2^64: exact in uint64
        p1 = np.uint64(_M1) * c[:, 2]
        c = np.stack([(p1 >> np.uint64(32)) ^ c[:, 1] ^ k0, p1 & _U32,
                      (p0 >> np.uint64(32)) ^ c[:, 3] ^ k1, p0 & _U32], axis=1)
        k0, k1 = (k0 + np.uint64(_W0)) & _U32, (k1 + np.uint64(_W1)) & _U32
    return c.astype(np.uint32)


def gumbel_noise_ref(vocab: int, key: int, counter: int) -> np.ndarray:
    """The kernel's Gumbel noise of one row, `[vocab]` float64."""
    groups = -(-vocab // 4)
    ctr = np.zeros((groups, 4), dtype=np.uint64)
    ctr[:, 0] = np.arange(groups)
    ctr[:, 1] = counter & 0xFFFFFFFF
    ctr[:, 2] = (counter >> 32) & 0xFFFFFFFF
    ctr[:, 3] = _COUNTER_TAG
    r = philox4x32_ref(ctr, key & 0xFFFFFFFFFFFFFFFF).reshape(-1)[:vocab].astype(np.float64)
    w = np.minimum(r * 2.0**-32 + 2.0**-33, 1 - 2.0**-24)
    return -np.log(-np.log1p(-w))


def sample_scores_ref(logits: torch.Tensor, inv_temperature: torch.Tensor,
                      seeds: torch.Tensor) -> torch.Tensor:
    """`[N, V]` float64 scores whose row argmax `sample_tokens` returns (up to rounding)."""
    x = logits.detach().double().cpu().numpy()
    inv_t = inv_temperature.cpu().numpy()
    keys, counters = seeds.cpu().numpy().T
    scores = np.empty_like(x)
    for r in range(x.shape[0]):
        if inv_t[r] == 0:
            scores[r] = x[r]
        else:
            scores[r] = x[r] * inv_t[r] + gumbel_noise_ref(
                x.shape[1], int(keys[r]), int(counters[r]) & 0xFFFFFFFFFFFFFFFF)
    return torch.from_numpy(scores)


__all__ = ["SAMPLE_DTYPES", "num_splits", "philox4x32_ref", "sample_scores_ref",
           "sample_tokens", "splitmix64"]
