"""Pieces every benchmark shares: the workload, the hardware floor, measurements, output.

- `make_workload` draws the offline workload of the book's benchmark chapter (256 requests,
  prompts of 100-1024 random token ids, 100-1024 output tokens each) exactly as the
  community's scripts draw it, so that its token counts (142,827 prompt / 133,966 output)
  prove it is the same workload.
- `ModelShape` and `throughput_floor` turn a model's shape and a workload into the bytes
  that must cross memory (KV reads, KV writes, weight reads) and, over a measured copy
  bandwidth, the shortest time any engine could take.
- `measure_copy_bandwidth` and `measure_matmul_flops` measure the machine in the same run.
- `prepare_model_dir`, `run_worker`, `environment`, `write_json` and `format_table` are the
  plumbing: a random-weight checkpoint directory, one backend per subprocess, and results
  as JSON plus a table.
"""

from __future__ import annotations

import functools
import heapq
import json
import math
import os
import platform
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
# Committed results, which the book's figures are generated from; a run writes there
# only when told to with `--output`.
RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"
# Where a run writes by default: a folder that git ignores.
RUNS_DIR = REPO_ROOT / "benchmarks" / "runs"

# The offline workload: (lo, hi) ranges of Python's random.randint, inclusive.
DEFAULT_NUM_REQUESTS = 256
DEFAULT_INPUT_LEN = (100, 1024)
DEFAULT_OUTPUT_LEN = (100, 1024)
DEFAULT_TOKEN_ID_MAX = 10000
DEFAULT_SEED = 0
# What the default draw gives; a benchmark that checks these runs the same requests as
# every other engine's published figure on this workload.
DEFAULT_PROMPT_TOKENS = 142_827
DEFAULT_OUTPUT_TOKENS = 133_966
TEMPERATURE = 0.6


# --8<-- [start:workload]
@dataclass(frozen=True)
class Workload:
    """A list of requests: prompt token ids and how many tokens each must generate.

    Attributes:
        prompts: one token-id list per request.
        max_tokens: output tokens per request (generated in full: EOS is ignored).
    """

    prompts: list[list[int]]
    max_tokens: list[int]

    @property
    def num_requests(self) -> int:
        return len(self.prompts)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def num_output_tokens(self) -> int:
        return sum(self.max_tokens)

    def summary(self) -> dict[str, int]:
        """Counts for a report."""
        return {"num_requests": self.num_requests, "prompt_tokens": self.num_prompt_tokens,
                "output_tokens": self.num_output_tokens,
                "max_prompt_len": max(len(p) for p in self.prompts),
                "max_output_len": max(self.max_tokens)}


def make_workload(num_requests: int = DEFAULT_NUM_REQUESTS,
                  input_len: tuple[int, int] = DEFAULT_INPUT_LEN,
                  output_len: tuple[int, int] = DEFAULT_OUTPUT_LEN,
                  seed: int = DEFAULT_SEED,
                  vocab_size: int | None = None) -> Workload:
    """Draw the offline workload.

    The order of the draws is part of the definition: with `random.seed(seed)`, first
    every prompt (its length `randint(*input_len)`, then its tokens, each
    `randint(0, 10000)`), then every request's `max_tokens = randint(*output_len)`.
    A private `random.Random` gives the same stream as the module-level functions after
    `random.seed`, without touching the global state.

    Args:
        num_requests: how many requests.
        input_len: inclusive range of prompt lengths.
        output_len: inclusive range of output lengths.
        seed: the seed of the draw.
        vocab_size: a model vocabulary smaller than 10001 (the tiny test model) folds
            each id into it (`id % vocab_size`) after the draw, so that lengths and
            output counts stay those of the standard draw.

    Raises:
        ValueError: for an empty workload or an empty / negative range.
    """
    if num_requests <= 0:
        raise ValueError(f"num_requests must be positive, got {num_requests}")
    for name, (lo, hi) in (("input_len", input_len), ("output_len", output_len)):
        if not 1 <= lo <= hi:
            raise ValueError(f"{name} must satisfy 1 <= lo <= hi, got ({lo}, {hi})")
    rng = random.Random(seed)
    prompts = [[rng.randint(0, DEFAULT_TOKEN_ID_MAX) for _ in range(rng.randint(*input_len))]
               for _ in range(num_requests)]
    max_tokens = [rng.randint(*output_len) for _ in range(num_requests)]
    if vocab_size is not None and vocab_size <= DEFAULT_TOKEN_ID_MAX:
        prompts = [[t % vocab_size for t in p] for p in prompts]
    return Workload(prompts=prompts, max_tokens=max_tokens)
# --8<-- [end:workload]


def is_default_workload(num_requests: int, input_len: Sequence[int],
                        output_len: Sequence[int], seed: int) -> bool:
    """Whether these arguments draw the standard workload (whose counts are known)."""
    return (num_requests == DEFAULT_NUM_REQUESTS and tuple(input_len) == DEFAULT_INPUT_LEN
            and tuple(output_len) == DEFAULT_OUTPUT_LEN and seed == DEFAULT_SEED)


def check_default_workload(workload: Workload) -> None:
    """Raise unless `workload` has the standard draw's token counts.

    Raises:
        ValueError: naming both counts, when either differs.
    """
    got = (workload.num_prompt_tokens, workload.num_output_tokens)
    want = (DEFAULT_PROMPT_TOKENS, DEFAULT_OUTPUT_TOKENS)
    if got != want:
        raise ValueError(f"the workload draw gave {got[0]:,} prompt / {got[1]:,} output "
                         f"tokens; the standard workload has {want[0]:,} / {want[1]:,}")


# --8<-- [start:model_shape]
@dataclass(frozen=True)
class ModelShape:
    """The sizes of a model that decide how many bytes and FLOPs it costs.

    Attributes:
        num_layers: decoder layers.
        hidden_size: width of the residual stream.
        intermediate_size: width of the dense MLP.
        num_heads: query heads.
        num_kv_heads: key/value heads (GQA: fewer than query heads).
        head_dim: width of one head.
        vocab_size: rows of the embedding and the output projection.
        tie_word_embeddings: the output projection is the embedding.
        mlp_matrices: matrices of the dense MLP: 3 for SwiGLU (gate, up, down),
            2 for GPT-2's (c_fc, c_proj).
        num_experts: experts of each MoE layer (0: a dense model).
        num_experts_per_tok: experts each token runs.
        moe_intermediate_size: width of one expert.
        num_moe_layers: layers whose MLP is the experts (the others are dense).
        position_embeddings: rows of a learned position table (GPT-2), else 0.
    """

    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool
    mlp_matrices: int = 3
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    num_moe_layers: int = 0
    position_embeddings: int = 0

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelShape:
        """From a Hugging Face `config.json` dict of any supported family (read by
        `mini_vllm.config.ModelConfig`, which knows each family's field names)."""
        from mini_vllm.model_config import ModelConfig

        c = ModelConfig.from_dict(config)
        gpt2 = c.architecture == "GPT2LMHeadModel"
        return cls(
            num_layers=c.num_hidden_layers,
            hidden_size=c.hidden_size,
            intermediate_size=c.intermediate_size,
            num_heads=c.num_attention_heads,
            num_kv_heads=c.num_key_value_heads,
            head_dim=c.head_dim,
            vocab_size=c.vocab_size,
            tie_word_embeddings=c.tie_word_embeddings,
            mlp_matrices=2 if gpt2 else 3,
            num_experts=c.num_experts,
            num_experts_per_tok=c.num_experts_per_tok,
            moe_intermediate_size=c.moe_intermediate_size,
            num_moe_layers=sum(c.is_moe_layer(i) for i in range(c.num_hidden_layers)),
            position_embeddings=c.max_position_embeddings if gpt2 else 0,
        )

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> ModelShape:
        """From a checkpoint directory's `config.json`."""
        return cls.from_config(json.loads((Path(model_dir) / "config.json").read_text()))

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """K and V of one token across all layers: layers x 2 x kv_heads x head_dim x bytes."""
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * dtype_bytes

    @property
    def attention_params(self) -> int:
        """Weights of one layer's attention products (q, k, v, o)."""
        h = self.hidden_size
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return h * q + 2 * h * kv + q * h

    @property
    def layer_matmul_params(self) -> int:
        """Weights of a dense layer's matmuls (attention and MLP); norms and biases are
        negligible."""
        return self.attention_params + self.mlp_matrices * self.hidden_size * self.intermediate_size

    @property
    def expert_params(self) -> int:
        """Weights of one expert (gate, up, down)."""
        return 3 * self.hidden_size * self.moe_intermediate_size

    def _layers_params(self, experts: float) -> float:
        """Matmul weights of every layer, with `experts` experts per MoE layer."""
        dense = self.num_layers - self.num_moe_layers
        moe = self.attention_params + self.num_experts * self.hidden_size + experts * self.expert_params
        return dense * self.layer_matmul_params + self.num_moe_layers * moe

    @property
    def active_params(self) -> float:
        """Matmul weights one token multiplies by (its own experts only), without the head."""
        return self._layers_params(self.num_experts_per_tok)

    @property
    def num_params(self) -> int:
        """Every stored parameter (a tied embedding counted once)."""
        norms = self.num_layers * (2 * self.hidden_size + 2 * self.head_dim) + self.hidden_size
        embeddings = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        positions = self.position_embeddings * self.hidden_size
        return int(self._layers_params(self.num_experts)) + norms + embeddings + positions

    def experts_read(self, num_tokens: int) -> float:
        """Experts of one MoE layer that `num_tokens` tokens touch, expected under
        uniform routing: each expert is missed by all of them with probability
        `(1 - k / E) ^ n`."""
        if not self.num_experts:
            return 0.0
        return self.num_experts * (1 - (1 - self.num_experts_per_tok / self.num_experts)
                                   ** num_tokens)

    def weight_bytes(self, dtype_bytes: int, num_tokens: int | None = None) -> float:
        """Bytes a step of `num_tokens` tokens reads from the weights (None: all of them).

        The embedding lookup touches only a few rows, but the output projection reads
        the whole `[vocab, hidden]` matrix; tied or not, that is one matrix of that size
        plus everything else, which is `num_params` for a tied model and
        `num_params - vocab x hidden` (the unread embedding) for an untied one. An MoE
        layer reads only the experts its tokens chose (`experts_read`).
        """
        unread = 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size
        total = self.num_params - unread
        if num_tokens is not None and self.num_experts:
            total -= self.num_moe_layers * (self.num_experts - self.experts_read(num_tokens)) \
                * self.expert_params
        return total * dtype_bytes

    def prefill_flops(self, prompt_len: int) -> float:
        """FLOPs of a prompt's prefill: matmuls for every token, causal attention, one
        row of logits (2 FLOPs per multiply-add)."""
        matmuls = 2.0 * self.active_params * prompt_len
        # QK^T and PV: token i attends to i + 1 positions, 2 x 2 x head_dim FLOPs each.
        pairs = prompt_len * (prompt_len + 1) / 2
        attention = 4.0 * self.num_layers * self.num_heads * self.head_dim * pairs
        logits = 2.0 * self.vocab_size * self.hidden_size
        return matmuls + attention + logits

    def decode_flops(self, num_seqs: int, context_tokens: int) -> float:
        """FLOPs of a decode step of `num_seqs` sequences attending to `context_tokens`
        cached tokens in all: matmuls and a row of logits per sequence, attention per
        context token."""
        per_token = 2.0 * self.active_params + 2.0 * self.vocab_size * self.hidden_size
        return (num_seqs * per_token
                + 4.0 * self.num_layers * self.num_heads * self.head_dim * context_tokens)
# --8<-- [end:model_shape]


# --8<-- [start:floor]
def decode_steps(max_tokens: Sequence[int], max_num_seqs: int) -> int:
    """Engine steps needed to generate every request's tokens, at most `max_num_seqs`
    at a time, one token per running request per step.

    With every request in one batch that is the longest request's length. Otherwise
    requests take the first free slot in order (a request that finishes frees its slot
    for the next step): the time the last slot frees.
    """
    return len(decode_schedule([1] * len(max_tokens), max_tokens, max_num_seqs))


def decode_schedule(prompt_lens: Sequence[int], max_tokens: Sequence[int],
                    max_num_seqs: int) -> list[tuple[int, int]]:
    """`(sequences, context tokens they attend to)` of every decode step, in order.

    Requests take the first free slot in order, as `decode_steps` describes; output
    token `i` of a request with a prompt of `p` tokens attends to `p + i + 1` tokens.
    """
    slots = [0] * min(max_num_seqs, len(max_tokens))  # the step each slot frees at
    heapq.heapify(slots)
    spans = []
    for p, m in zip(prompt_lens, max_tokens):
        start = heapq.heappop(slots)
        heapq.heappush(slots, start + m)
        spans.append((start, m, p))
    steps = max(start + m for start, m, _ in spans)
    # Difference arrays: running count, and the sum of (p + 1 - start) over running
    # requests, whose context at step s is (p + 1 - start) + s.
    count, base = [0] * (steps + 1), [0] * (steps + 1)
    for start, m, p in spans:
        count[start] += 1
        count[start + m] -= 1
        base[start] += p + 1 - start
        base[start + m] -= p + 1 - start
    schedule, n, b = [], 0, 0
    for s in range(steps):
        n, b = n + count[s], b + base[s]
        schedule.append((n, b + n * s))
    return schedule


def throughput_floor(workload: Workload, shape: ModelShape, dtype_bytes: int,
                     bandwidth: float, max_num_seqs: int = 256,
                     matmul_flops_per_s: float | None = None,
                     max_num_batched_tokens: int = 8192) -> dict[str, Any]:
    """The least time the workload can take: its bytes at `bandwidth`, and with a
    matmul rate, its FLOPs too, step by step (`step_floors`).

    Bytes that must cross memory, with the KV cache in the model's dtype:

    - KV reads: output token `i` of a request with prompt length `p` (i = 0..m-1)
      attends to `p + i + 1` tokens and reads each one's K and V once (once per KV
      head, shared by the query heads of its group);
    - KV writes: every prompt and output token's K and V, once;
    - weight reads: the weights once per decode step (`decode_steps`; an MoE layer
      only the experts the step's tokens chose).

    Args:
        workload: the requests.
        shape: the model.
        dtype_bytes: bytes per weight and per cached K/V value.
        bandwidth: measured copy bandwidth, bytes per second (bytes read + written).
        max_num_seqs: largest batch (decides the number of decode steps).
        matmul_flops_per_s: a measured matmul rate: the floor then counts FLOPs too.
        max_num_batched_tokens: the step budget, which decides how many steps the
            prompts take (each reads the weights once).

    Returns:
        The byte counts, `byte_floor_s` (bytes / bandwidth), `floor_s` (the byte floor,
        or with a matmul rate the sum of the step kinds' floors) and `floor_output_tok_s`.
    """
    kv_per_token = shape.kv_bytes_per_token(dtype_bytes)
    schedule = decode_schedule([len(p) for p in workload.prompts], workload.max_tokens,
                               max_num_seqs)
    kv_read_tokens = sum(ctx for _, ctx in schedule)
    kv_write_tokens = workload.num_prompt_tokens + workload.num_output_tokens
    weight_bytes = shape.weight_bytes(dtype_bytes)
    kv_read = kv_read_tokens * kv_per_token
    kv_write = kv_write_tokens * kv_per_token
    weight_read = sum(shape.weight_bytes(dtype_bytes, n) for n, _ in schedule)
    total = kv_read + kv_write + weight_read
    result: dict[str, Any] = {
        "kv_bytes_per_token": kv_per_token,
        "kv_read_bytes": kv_read,
        "kv_write_bytes": kv_write,
        "weight_bytes": weight_bytes,
        "decode_steps": len(schedule),
        "weight_read_bytes": weight_read,
        "total_bytes": total,
        "bandwidth_bytes_per_s": bandwidth,
        "byte_floor_s": total / bandwidth,
        "floor_s": total / bandwidth,
    }
    if matmul_flops_per_s:
        # Every prompt and output token goes through the matmuls once; attention FLOPs
        # follow the KV reads (2 x 2 x head_dim per query head per context token).
        flops = (2.0 * shape.active_params * kv_write_tokens
                 + 2.0 * shape.vocab_size * shape.hidden_size * workload.num_output_tokens
                 + 4.0 * shape.num_heads * shape.head_dim * shape.num_layers * kv_read_tokens)
        kinds = step_floors(workload, shape, schedule, dtype_bytes, bandwidth,
                            matmul_flops_per_s, max_num_batched_tokens)
        result.update(flops=flops, matmul_flops_per_s=matmul_flops_per_s,
                      compute_floor_s=flops / matmul_flops_per_s, step_kinds=kinds,
                      floor_s=sum(k["floor_s"] for k in kinds.values()))
    result["floor_output_tok_s"] = workload.num_output_tokens / result["floor_s"]
    return result
# --8<-- [end:floor]


# --8<-- [start:tp_floor]
def allreduce_bytes(shape: ModelShape, tokens: int, dtype_bytes: int) -> int:
    """Bytes a tensor-parallel forward all-reduces for `tokens` tokens: `[T, hidden]`
    after each attention's o_proj and each MLP's down_proj, and once after the
    vocabulary-parallel embedding."""
    return (2 * shape.num_layers + 1) * tokens * shape.hidden_size * dtype_bytes


def tensor_parallel_floor(floor: dict[str, Any], shape: ModelShape, tp: int, tokens: int,
                          sampled_rows: int, dtype_bytes: int,
                          busbw: float) -> dict[str, Any]:
    """A one-GPU floor (`throughput_floor` or a latency floor) spread over `tp` GPUs.

    Each GPU moves `1 / tp` of the bytes (its shard of the weights, its KV heads'
    cache) at the same bandwidth, and the ranks exchange the all-reduces' bytes and
    the logits' all-gather over NCCL. A ring all-reduce of `b` bytes carries
    `b * 2 (tp - 1) / tp` over each link, an all-gather `b * (tp - 1) / tp`;
    `busbw` (nccl-tests' bus bandwidth, measured in the same job) is the rate of
    a link. (With KV heads replicated, `tp` above the KV heads, the cache bytes
    divide by fewer: this floor is then optimistic.)

    Args:
        floor: the one-GPU floor (`total_bytes`, `bandwidth_bytes_per_s`, ...).
        shape: the model.
        tp: the tensor-parallel size.
        tokens: tokens that go through the forward (prompt + output).
        sampled_rows: rows of logits gathered (one per output token).
        dtype_bytes: bytes per activation value.
        busbw: measured NCCL bus bandwidth, bytes per second.

    Returns:
        `floor` with `floor_s` (and `floor_output_tok_s` when present) for `tp`
        GPUs, the one-GPU values kept as `*_one_gpu`, and the communication terms.
    """
    reduce = allreduce_bytes(shape, tokens, dtype_bytes)
    gather = sampled_rows * shape.vocab_size * dtype_bytes
    comm_s = (reduce * 2 * (tp - 1) / tp + gather * (tp - 1) / tp) / busbw
    memory_s = floor["total_bytes"] / tp / floor["bandwidth_bytes_per_s"]
    out = dict(floor, tensor_parallel_size=tp, allreduce_bytes=reduce, allgather_bytes=gather,
               nccl_busbw_bytes_per_s=busbw, per_gpu_bytes=floor["total_bytes"] / tp,
               memory_floor_s=memory_s, communication_floor_s=comm_s,
               floor_s_one_gpu=floor["floor_s"], floor_s=memory_s + comm_s)
    if "floor_output_tok_s" in floor:
        out["floor_output_tok_s_one_gpu"] = floor["floor_output_tok_s"]
        out["floor_output_tok_s"] = floor["floor_output_tok_s"] * floor["floor_s"] / out["floor_s"]
    return out
# --8<-- [end:tp_floor]


# --8<-- [start:step_floors]
def step_floors(workload: Workload, shape: ModelShape, schedule: Sequence[tuple[int, int]],
                dtype_bytes: int, bandwidth: float, flops_per_s: float,
                max_num_batched_tokens: int) -> dict[str, dict[str, float]]:
    """The floor of each kind of step: its bytes over the copy bandwidth or its FLOPs
    over the matmul rate, whichever is longer, step by step.

    - prompt steps: the prompts' tokens in steps of `max_num_batched_tokens`, each
      reading the weights once and writing its tokens' K/V; their FLOPs are every
      prompt's matmuls and causal attention (`prefill_flops`). Many tokens per weight:
      compute decides, on a large model.
    - decode steps (`decode_schedule`): step `s` reads the weights its sequences touch
      and the K/V of their contexts, writes one token's K/V each, and does each
      sequence's matmuls and its attention over its context. Few tokens per weight:
      bytes decide, but for the matmuls of a large batch.

    Each kind's floor sums the longer of the two over its steps.
    """
    kv_per_token = shape.kv_bytes_per_token(dtype_bytes)
    prompt_tokens = workload.num_prompt_tokens
    n_prompt_steps = -(-prompt_tokens // max_num_batched_tokens)
    per_step = min(prompt_tokens, max_num_batched_tokens)
    prompt_bytes = (n_prompt_steps * shape.weight_bytes(dtype_bytes, per_step)
                    + prompt_tokens * kv_per_token)
    prompt_flops = sum(shape.prefill_flops(len(p)) for p in workload.prompts)
    # The prompt steps are alike: the longer of the two sums is the sum of the longer.
    prompt = {"steps": n_prompt_steps, "bytes": prompt_bytes, "flops": prompt_flops,
              "bytes_s": prompt_bytes / bandwidth, "flops_s": prompt_flops / flops_per_s}
    prompt["floor_s"] = max(prompt["bytes_s"], prompt["flops_s"])
    decode = {"steps": len(schedule), "bytes": 0.0, "flops": 0.0, "bytes_s": 0.0,
              "flops_s": 0.0, "floor_s": 0.0, "compute_bound_steps": 0}
    for n, ctx in schedule:
        nbytes = shape.weight_bytes(dtype_bytes, n) + (ctx + n) * kv_per_token
        flops = shape.decode_flops(n, ctx)
        decode["bytes"] += nbytes
        decode["flops"] += flops
        decode["bytes_s"] += nbytes / bandwidth
        decode["flops_s"] += flops / flops_per_s
        decode["floor_s"] += max(nbytes / bandwidth, flops / flops_per_s)
        decode["compute_bound_steps"] += flops / flops_per_s > nbytes / bandwidth
    return {"prompt": prompt, "decode": decode}
# --8<-- [end:step_floors]


def time_calls(fn: Callable[[], None], device: Any, iters: int, warmup: int,
               queued: bool = False) -> list[float]:
    """Seconds per call of `fn`, each call timed on its own (CUDA events on a GPU).

    With `queued`, each call is enqueued behind a spin kernel of about 1 ms, so
    the host gets ahead and the events bracket only the GPU's work, not the
    Python that launches it (as when the engine launches it behind a step).
    """
    import torch

    for _ in range(warmup):
        fn()
    times = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        for _ in range(iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            if queued:
                torch.cuda._sleep(2_000_000)  # about 1 ms at an H200's clock
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
    else:
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return times


# --8<-- [start:copy_bandwidth]
def measure_copy_bandwidth(device: str = "cuda", nbytes: int | None = None,
                           iters: int = 10) -> dict[str, Any]:
    """Measure a large same-device copy: bytes read + written per second.

    A copy is the simplest kernel that streams memory at full speed; it reads `nbytes`
    and writes `nbytes`, and we count both, as the floor's byte counts do. Buffers are
    far larger than any cache (1 GiB on a GPU, 256 MiB on the CPU).

    Args:
        device: `cuda`, `cuda:N` or `cpu`.
        nbytes: size of the source buffer.
        iters: timed copies (after two untimed ones); the median is reported.

    Returns:
        `bandwidth_bytes_per_s` (2 x nbytes / median time) and the timings.
    """
    import torch

    dev = torch.device(device)
    if nbytes is None:
        nbytes = 2**30 if dev.type == "cuda" else 2**28
    src = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    src.fill_(1)
    dst = torch.empty_like(src)
    copy = functools.partial(dst.copy_, src)
    times = time_calls(copy, dev, iters, warmup=2)
    median = statistics.median(times)
    del src, dst, copy
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return {"device": str(dev), "bytes_copied": nbytes, "bytes_moved": 2 * nbytes,
            "median_s": median, "times_s": times, "bandwidth_bytes_per_s": 2 * nbytes / median}
# --8<-- [end:copy_bandwidth]


def measure_matmul_flops(device: str = "cuda", dtype: str = "bfloat16", n: int | None = None,
                         iters: int = 10) -> dict[str, Any]:
    """Measure a square matmul's rate: `2 n^3` FLOPs over its median time.

    Args:
        device: `cuda`, `cuda:N` or `cpu`.
        dtype: the operands' dtype name.
        n: the matrices' size (8192 on a GPU, 512 on the CPU).
        iters: timed matmuls after two untimed ones.
    """
    import torch

    from mini_vllm.model_config import resolve_dtype

    dev = torch.device(device)
    n = n or (8192 if dev.type == "cuda" else 512)
    gen = torch.Generator(device=dev).manual_seed(0)
    a = torch.randn(n, n, device=dev, generator=gen).to(resolve_dtype(dtype))
    b = torch.randn(n, n, device=dev, generator=gen).to(resolve_dtype(dtype))
    matmul = functools.partial(torch.mm, a, b)
    times = time_calls(matmul, dev, iters, warmup=2)
    median = statistics.median(times)
    del a, b, matmul
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return {"device": str(dev), "dtype": dtype, "n": n, "median_s": median,
            "flops_per_s": 2.0 * n**3 / median}


def resolve_device(device: str) -> str:
    """`auto` becomes `cuda` when a GPU is visible, else `cpu`."""
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_dtype_name(dtype: str, device: str) -> str:
    """`auto` is bfloat16 on a GPU and float32 on the CPU (the engine's rule)."""
    if dtype != "auto":
        return dtype
    return "bfloat16" if device.startswith("cuda") else "float32"


def dtype_bytes(dtype: str) -> int:
    """Bytes per value of a dtype name."""
    from mini_vllm.model_config import resolve_dtype

    return resolve_dtype(dtype).itemsize


def has_weights(model_dir: Path) -> bool:
    """Whether a checkpoint directory holds safetensors weights."""
    return any(Path(model_dir).glob("*.safetensors"))


def prepare_model_dir(model: str | None, preset: str, work_dir: Path,
                      write_weights: bool = False, seed: int = 0) -> tuple[Path, str]:
    """The checkpoint directory to benchmark and the load format it needs.

    A `model` directory is used as it is. Otherwise a random-weight `preset` is written
    into `work_dir`: only `config.json`, the generation config and the tokenizer for a
    large preset (the engine fills weights with random values, `load_format="dummy"`),
    real safetensors weights for the tiny presets or when `write_weights` is set.

    Returns:
        `(model_dir, load_format)` with `load_format` `"auto"` when the directory holds
        weights, `"dummy"` when it does not.
    """
    from mini_vllm.checkpoint import make_model

    if model is not None:
        model_dir = Path(model).expanduser().resolve()
        if not (model_dir / "config.json").is_file():
            raise FileNotFoundError(f"{model_dir}/config.json not found: --model must be a "
                                    "Hugging Face Qwen3 checkpoint directory")
    else:
        weights = write_weights or preset.startswith("tiny")
        model_dir = make_model(work_dir / preset, preset=preset, seed=seed, weights=weights)
        cover_vocabulary(model_dir)
    return model_dir, ("auto" if has_weights(model_dir) else "dummy")


# --8<-- [start:cover_vocabulary]
def cover_vocabulary(model_dir: Path) -> int:
    """Give every id of the model's vocabulary a text; return how many ids gained one.

    A random-weight model samples ids from its whole vocabulary (151,936 for the real
    Qwen3 shapes), but the shipped tokenizer has 2,331 tokens: without this, 98.5 % of
    the generated ids would decode to no text, a stream would carry a chunk every 60
    tokens or so, and time to first token and inter-token latency would measure the
    wait for an id with text, not the engine. A real Qwen3 tokenizer covers nearly its
    whole vocabulary. So each id past the shipped ones becomes an added (not special)
    token `" w<id>"`: every sampled id then has text, as with a real model, and a
    stream carries a chunk per token. Prompts are token ids, so nothing is encoded
    differently.
    """
    path = model_dir / "tokenizer.json"
    tokenizer = json.loads(path.read_text(encoding="utf-8"))
    vocab_size = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    ids = set(tokenizer["model"]["vocab"].values()) | {t["id"] for t in tokenizer["added_tokens"]}
    missing = [i for i in range(vocab_size) if i not in ids]
    tokenizer["added_tokens"].extend(
        {"id": i, "content": f" w{i}", "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": False} for i in missing)
    path.write_text(json.dumps(tokenizer), encoding="utf-8")
    return len(missing)
# --8<-- [end:cover_vocabulary]


def load_hf_model(model_dir: str | Path, dtype: str, device: str, attn_implementation: str,
                  load_format: str = "auto") -> Any:
    """A transformers `AutoModelForCausalLM` of the checkpoint, on `device`, in eval mode.

    A directory with weights (and `load_format` not `dummy`) is loaded; otherwise the
    model is built from `config.json` with transformers' own random init, directly on
    the device (the same shapes; values do not change speed). An attention
    implementation with the `paged|` prefix that this transformers version no longer
    knows is retried without it.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from mini_vllm.model_config import resolve_dtype

    torch_dtype = resolve_dtype(dtype)

    def load(attn: str) -> Any:
        if has_weights(Path(model_dir)) and load_format != "dummy":
            return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch_dtype,
                                                        attn_implementation=attn)
        with torch.device(device):
            return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(model_dir)),
                                                    dtype=torch_dtype, attn_implementation=attn)

    try:
        model = load(attn_implementation)
    except (ValueError, ImportError):
        if not attn_implementation.startswith("paged|"):
            raise
        model = load(attn_implementation.removeprefix("paged|"))
    return model.to(device).eval()


def subprocess_env() -> dict[str, str]:
    """The environment for child processes: the repository importable even when the
    package is not installed."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH"))
                                        if p)
    return env


def kill_process_group(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """Stop a child started with `start_new_session=True` and everything it spawned:
    SIGTERM, then SIGKILL after `grace_s`."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        pass


def run_worker(script: Path, argv: Sequence[str], timeout_s: float) -> dict[str, Any]:
    """Run `python script *argv --worker-output FILE` in a fresh process; return FILE's JSON.

    One backend per process: each starts with an empty GPU, and a crash, an
    out-of-memory kill or a hang costs that backend's result, not the run. The worker's
    output goes to this process's stdout/stderr as it comes.
    """
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = [sys.executable, str(script), *argv, "--worker-output", str(out)]
        proc = subprocess.Popen(cmd, env=subprocess_env(), start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            kill_process_group(proc)
            return {"status": "error", "error": f"timed out after {timeout_s:.0f} s"}
        finally:
            kill_process_group(proc)  # its own children (vLLM's engine processes ...)
        if out.is_file():
            return json.loads(out.read_text())
        return {"status": "error", "error": f"worker exited with status {rc} and no result "
                                            "(see its output above)"}


def module_version(name: str) -> str | None:
    """An installed distribution's version, or None."""
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def environment(device: str) -> dict[str, Any]:
    """What a result depends on: software versions, the device, the commit, the time."""
    import torch

    env: dict[str, Any] = {
        "time_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": module_version("transformers"),
        "vllm": module_version("vllm"),
        "nano-vllm": module_version("nano-vllm") or module_version("nanovllm"),
        "device": device,
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
    }
    if device.startswith("cuda") and torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(torch.device(device))
    try:
        env["git_commit"] = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True,
            timeout=10, check=True).stdout.strip()
        # Tracked files that differ from that commit: the code that ran is not it.
        env["git_modified"] = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO_ROOT,
            capture_output=True, text=True, timeout=10, check=True).stdout.split("\n")[:-1]
    except (OSError, subprocess.SubprocessError):
        env["git_commit"] = env["git_modified"] = None
    return env


def write_json(path: str | Path, obj: dict[str, Any]) -> Path:
    """Write `obj` as indented JSON, creating the parent directory."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=2, default=_jsonable) + "\n")
    return path


def _jsonable(obj: Any) -> Any:
    if hasattr(obj, "__dataclass_fields__"):
        return asdict(obj)
    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    return repr(obj)


def format_table(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> str:
    """A Markdown table of `rows` (dicts) with the given columns; floats get 4
    significant digits (more before the point), None becomes `-`."""
    def cell(v: Any) -> str:
        if v is None:
            return "-"
        if isinstance(v, float):
            if not math.isfinite(v):
                return str(v)
            return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.4g}"
        if isinstance(v, int) and not isinstance(v, bool):
            return f"{v:,}"
        return str(v)

    body = [[cell(r.get(c)) for c in columns] for r in rows]
    widths = [max(len(c), *(len(b[i]) for b in body)) if body else len(c)
              for i, c in enumerate(columns)]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(columns, widths)) + " |",
             "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    lines += ["| " + " | ".join(v.ljust(w) for v, w in zip(b, widths)) + " |" for b in body]
    return "\n".join(lines)


def error_text(exc: BaseException) -> str:
    """One line for a JSON report: the exception's type and message."""
    msg = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {msg[0] if msg else ''}"[:2000]


__all__ = [
    "DEFAULT_OUTPUT_TOKENS",
    "DEFAULT_PROMPT_TOKENS",
    "ModelShape",
    "Workload",
    "check_default_workload",
    "decode_steps",
    "dtype_bytes",
    "environment",
    "error_text",
    "format_table",
    "has_weights",
    "is_default_workload",
    "kill_process_group",
    "load_hf_model",
    "make_workload",
    "measure_copy_bandwidth",
    "measure_matmul_flops",
    "prepare_model_dir",
    "resolve_device",
    "resolve_dtype_name",
    "run_worker",
    "step_floors",
    "subprocess_env",
    "throughput_floor",
    "write_json",
]
