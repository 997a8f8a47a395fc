"""Fused Gumbel-max sampling on the GPU (`csrc/sampling_kernels.cu`), and its reference.

`sample_tokens` draws one token per row of `softmax(logits * inv_temperature)`,
reading the logits once, in their own dtype. Over a whole row the Gumbel-max
race

    argmax_i (s_i + G_i),   s_i = logit_i / T,   G_i = -log(-log(1 - w_i)) ~ Gumbel(0, 1)

picks token i with probability exactly `softmax(s)_i`, the same distribution
as the torch sampler's `argmax(probs / Exponential(1))`; the kernel runs it in
two levels, which draw the same distribution with noise for one chunk of
`SAMPLE_CHUNK` tokens per row instead of one per token:

1. each chunk c of the row gets its log-sum-exp `L_c = log sum_{i in c} exp(s_i)`;
2. a race `argmax_c (L_c + G'_c)` picks a chunk, with probability
   `exp(L_c) / sum_c exp(L_c)`;
3. a race `argmax_{i in c} (s_i + G_i)` with noise of its own (keyed by the
   token's place in the chunk: only one chunk races) picks the token within it,
   with probability `exp(s_i) / exp(L_c)`.

A greedy row (`inv_temperature` 0) runs the same two races without noise: the
first chunk that holds the row's maximum, then the first maximum in it. The
uniforms `w` come from Philox4x32-10 keyed by the row's `(key, counter)` pair
(`seeds[r]`), so a row's draw depends on nothing else in the batch.

`sample_ref` runs both races in float64 with numpy, from the same Philox words:
the tests compare the kernel's choice with it.
"""

from __future__ import annotations

import numpy as np
import torch

from mini_vllm.ops._checks import check_same_device, check_tensor
from mini_vllm.ops._extension import dtype_code, extension

SAMPLE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
SAMPLE_CHUNK = 4096  # tokens per chunk of the first level, as kSampleChunk in the kernel
SAMPLE_MAX_CHUNKS = 1024  # chunks a row may have: 4 per thread of the kernel's 256
_CHUNK_TAG = 0x63686E6B  # the Philox counter's last word in the race among chunks ("chnk")
_TOKEN_TAG = 0x6D696E69  # ... and in the race among a chunk's tokens ("mini")


def splitmix64(x: int) -> int:
    """A 64-bit mixer (Steele et al.): turns a user's seed into a well-spread Philox key.

    Returns the result as a signed int64, ready for an int64 tensor.
    """
    x = (x + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    x ^= x >> 31
    return x - (1 << 64) if x >= 1 << 63 else x


def num_chunks(vocab: int) -> int:
    """Chunks of the first level: fixed by the vocabulary, never by the batch."""
    return -(-vocab // SAMPLE_CHUNK)


def kernel_fits(vocab: int) -> bool:
    """Whether `sample_tokens` takes a vocabulary of this size (at most `SAMPLE_MAX_CHUNKS`
    chunks); the sampler draws larger ones with the torch pipeline."""
    return num_chunks(vocab) <= SAMPLE_MAX_CHUNKS


# --8<-- [start:sample_tokens]
def sample_tokens(logits: torch.Tensor, inv_temperature: torch.Tensor,
                  seeds: torch.Tensor) -> torch.Tensor:
    """One token per row: Gumbel-max over `logits * inv_temperature`, in two levels.

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
        ValueError: on a wrong dtype, shape, layout or device, or a vocabulary
            above `SAMPLE_MAX_CHUNKS * SAMPLE_CHUNK` tokens.
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
    if not kernel_fits(vocab):
        raise ValueError(f"logits: a vocabulary of {vocab} tokens is more than the kernel's "
                         f"{SAMPLE_MAX_CHUNKS * SAMPLE_CHUNK}")
    device = check_same_device(logits=logits, inv_temperature=inv_temperature, seeds=seeds)
    out = torch.empty(n, dtype=torch.int64, device=device)
    if n == 0:
        return out
    chunks = num_chunks(vocab)
    partials = torch.empty(n * chunks, dtype=torch.float32, device=device)
    extension().sample_tokens(
        out.data_ptr(), partials.data_ptr(), logits.data_ptr(), inv_temperature.data_ptr(),
        seeds.data_ptr(), n, vocab, chunks, logits.stride(0), dtype_code(logits.dtype),
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


def gumbel_noise_ref(count: int, key: int, counter: int, tag: int) -> np.ndarray:
    """The kernel's Gumbel noise for candidates `0 .. count - 1` of one race.

    Candidate c's noise is word `c % 4` of the Philox call for counter
    `(c // 4, counter low, counter high, tag)`. Returns `[count]` float64.
    """
    groups = -(-count // 4)
    ctr = np.zeros((groups, 4), dtype=np.uint64)
    ctr[:, 0] = np.arange(groups)
    ctr[:, 1] = counter & 0xFFFFFFFF
    ctr[:, 2] = (counter >> 32) & 0xFFFFFFFF
    ctr[:, 3] = tag
    r = philox4x32_ref(ctr, key & 0xFFFFFFFFFFFFFFFF).reshape(-1)[:count].astype(np.float64)
    w = np.minimum(r * 2.0**-32 + 2.0**-33, 1 - 2.0**-24)
    return -np.log(-np.log1p(-w))


def _race(values: np.ndarray) -> tuple[int, float]:
    """First argmax (-1 when every value is -inf), and its lead over the runner-up."""
    values = np.where(values > -np.inf, values, -np.inf)  # NaN never wins
    best = int(np.argmax(values))
    if values[best] == -np.inf:
        return -1, np.inf
    rest = np.delete(values, best)
    return best, float(values[best] - rest.max()) if rest.size else np.inf


def sample_ref(logits: torch.Tensor, inv_temperature: torch.Tensor,
               seeds: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's two races in float64: `[N]` tokens and `[N]` margins.

    A row's margin is the smaller of the two winners' leads over their
    runners-up: where it is within float32 rounding, the kernel may pick
    the other candidate.
    """
    x = logits.detach().double().cpu().numpy()
    x = np.where(x > -np.inf, x, -np.inf)  # NaN: never drawn, as in the kernel
    inv_t = inv_temperature.cpu().numpy().astype(np.float64)
    keys, counters = seeds.cpu().numpy().T
    tokens = np.zeros(x.shape[0], dtype=np.int64)
    margins = np.full(x.shape[0], np.inf)
    for r in range(x.shape[0]):
        key, ctr = int(keys[r]) & 0xFFFFFFFFFFFFFFFF, int(counters[r]) & 0xFFFFFFFFFFFFFFFF
        greedy = inv_t[r] == 0
        s = x[r] if greedy else x[r] * inv_t[r]
        chunks = [s[c:c + SAMPLE_CHUNK] for c in range(0, len(s), SAMPLE_CHUNK)]
        values = np.array([c.max() if greedy or c.max() in (-np.inf, np.inf)
                           else c.max() + np.log(np.exp(c - c.max()).sum()) for c in chunks])
        if not greedy:
            values = values + gumbel_noise_ref(len(values), key, ctr, _CHUNK_TAG)
        chunk, lead1 = _race(values)
        if chunk < 0:
            continue  # every logit -inf: token 0
        first = chunk * SAMPLE_CHUNK
        scores = chunks[chunk]
        if not greedy:
            scores = scores + gumbel_noise_ref(len(scores), key, ctr, _TOKEN_TAG)
        token, lead2 = _race(scores)
        tokens[r], margins[r] = first + token, min(lead1, lead2)
    return torch.from_numpy(tokens), torch.from_numpy(margins)


__all__ = ["SAMPLE_CHUNK", "SAMPLE_DTYPES", "SAMPLE_MAX_CHUNKS", "kernel_fits", "num_chunks",
           "philox4x32_ref", "sample_ref", "sample_tokens", "splitmix64"]
