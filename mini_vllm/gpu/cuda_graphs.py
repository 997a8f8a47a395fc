"""CUDA graphs for decode steps: capture once per batch size, replay every step.

A decode step of a 0.6B model is a few hundred small kernels; launched one
by one from Python, the launches take longer than the GPU work. A CUDA graph
records the launches of the whole forward (and the logits) once, for a fixed
batch size reading fixed input buffers, and replays them with one call.

    capture sizes   1  2  4  8  16  24  32  ...  max            (a graph each; small
                                                                  sizes one per context
                                                                  bound, see below)
    static inputs   input_ids, positions, slot_mapping   [3, bs]   int64   (one flat
                    context_lens, decode order           [2, bs]   int32    buffer, laid
                                                                            out per size)
                    block_tables                         [max, W]  int32
    a step of n sequences runs the graph of the smallest size bs >= n:

        row        0 .. n-1          n .. bs-1 (padding)
        token      the real tokens   0
        position   the real ones     0
        slot       the real ones     -1        (the KV write skips it)
        context    the real ones     1         (reads block 0, reserved)
        blocks     the real tables   [0, ...]

    and the decode order, a permutation of all bs rows (longest context first).

Padded rows compute garbage that nothing reads: their K/V are not written
and their logits are sliced off. The graphs share one memory pool, captured
largest first so that the smaller ones reuse its blocks; their outputs alias,
so a replay's logits are valid until the next replay. A step's inputs reach
the static buffers from a pinned host mirror in one call (`DecodeInputs`).
"""

from __future__ import annotations

import bisect
import contextlib
import gc
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from mini_vllm.attention import KVCache
from mini_vllm.gpu.attention import AttentionSplit, CudaAttentionBackend, CudaAttentionMetadata
from mini_vllm.ops._extension import extension, is_available

logger = logging.getLogger(__name__)

MAX_CAPTURE_SIZE = 512
# A graph fixes the decode kernel's split-K grid, sized for a bound of the
# contexts. A batch too small to fill the GPU without splits is captured once
# per bound of this ladder (and max_model_len), and a step replays the graph
# of the smallest bound that holds its longest context: a step at a 150-token
# context does not launch the hundreds of idle CTAs an 8k-token grid has, and
# one at 8k does not walk 64-token partitions (chapter 9).
CONTEXT_BOUNDS = (256, 1024, 4096)
# A step that is one new prompt and nothing else (a lone request's first step)
# of up to this many tokens replays one graph of the whole forward, attention
# included, instead of the pieces (`PiecewiseGraphRunner.run_prompt`).
MAX_PROMPT_GRAPH_TOKENS = 1024

# (input_ids, positions, kv_caches, metadata) -> logits [bs, vocab]
ForwardFn = Callable[[torch.Tensor, torch.Tensor, list[KVCache], CudaAttentionMetadata],
                     torch.Tensor]


@contextlib.contextmanager
def capture_stream(device: torch.device) -> Iterator[None]:
    """Warm up and capture on a side stream, the device synchronised before and after.

    Warming up on the same stream makes per-stream library workspaces exist
    before capture. Python's cyclic garbage collector is held off throughout:
    it runs at whatever allocation crosses its threshold, and if it then frees
    an object in a reference cycle that owns a CUDA graph or CUDA memory (an
    earlier runner's, say), that free happens inside the capture, which CUDA
    forbids: the capture breaks. (`torch.cuda.graph()` used to collect before
    each capture; since PyTorch 2.9 it does so only when asked
    (`TORCH_CUDAGRAPH_GC=1`). One collection before these captures made the
    standard throughput workload measurably slower here, so there is none.)
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        stream = torch.cuda.Stream(device)
        torch.cuda.synchronize(device)
        with torch.cuda.stream(stream):
            yield
        torch.cuda.synchronize(device)
    finally:
        if was_enabled:
            gc.enable()


# --8<-- [start:token_inputs]
class TokenInputs:
    """A piecewise graph's static `[3, n]` int64 input rows: ids, positions, slots.

    Rows past a step's tokens keep id 0, position 0 and slot -1 (the KV write
    skips them). One copy fills all three rows; the ids of tokens sampled by
    the previous step (never on the host) are then written in place.
    """

    def __init__(self, n: int, device: torch.device) -> None:
        self.rows = torch.zeros(3, n, dtype=torch.int64, device=device)
        self.rows[2].fill_(-1)

    def fill(self, token_inputs: torch.Tensor,
             token_fixes: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """Copy `[3, k]` rows into the first `k` columns, then apply `(rows, ids)` fixes."""
        self.rows[:, :token_inputs.shape[1]].copy_(token_inputs)
        if token_fixes is not None:
            rows, ids = token_fixes
            self.rows[0].index_copy_(0, rows, ids.to(torch.int64))
# --8<-- [end:token_inputs]


# --8<-- [start:decode_inputs]
class HostInputs(NamedTuple):
    """Numpy views of `DecodeInputs`' pinned mirror for one step, to fill in place."""

    rows: np.ndarray  # [3, bs] int64: ids, positions, slots
    seq: np.ndarray  # [2, bs] int32: context lengths, decode order
    fixes: np.ndarray  # [bs, 2] int64: (row of ids, row of the previous sample), first k
    tables: np.ndarray  # [bs, w] int32: block tables, w <= W

    def pad(self, n: int) -> None:
        """Padding in rows `n..bs-1`: id 0, position 0, no slot (the KV write skips
        it), one junk token of context in block 0 (reserved for this)."""
        self.rows[:, n:] = ((0,), (0,), (-1,))
        self.seq[0, n:] = 1
        self.tables[n:] = 0


class DecodeInputs:
    """The decode graphs' static inputs, and the pinned host mirror a step fills.

    The graph of batch size `bs` reads one flat device buffer, laid out for
    its size (the graphs take turns, so they share it), and the first `bs`
    rows of one block table:

        flat   byte 0        [3, bs] int64    ids, positions, slots
               byte 24 bs    [2, bs] int32    context lengths, decode order
               byte 32 bs    [k, 2]  int64    token fixes: (row of ids, row of prev)
        tables               [max, W] int32   block ids, W = max_model_len / block_size

    A step writes its inputs into the host mirror (`host`: the same flat
    layout, and a compact `[bs, w]` table for the `w` blocks its longest
    context needs), then `stage` moves them in one call of the extension: a
    copy of the flat bytes, a 2-D copy of the table into the first `w`
    columns of its rows (columns past `w` keep stale ids that no context
    reaches), and a kernel that writes into the ids the tokens the previous
    step sampled (`prev`, which never visits the host). Without the extension
    (the CPU, or no build) the same moves are torch operations.

    The mirror is rewritten only after the last `stage`'s copies have left it
    (an event, normally long done).
    """

    def __init__(self, max_size: int, max_blocks_per_seq: int, device: torch.device) -> None:
        self.device = device
        self.max_size, self.width = max_size, max_blocks_per_seq
        cuda = device.type == "cuda"
        self.flat = torch.zeros(48 * max_size, dtype=torch.uint8, device=device)
        self.tables = torch.zeros(max_size, max_blocks_per_seq, dtype=torch.int32, device=device)
        self._host_flat = torch.zeros(48 * max_size, dtype=torch.uint8, pin_memory=cuda)
        self._host_tables = torch.zeros(max_size * max_blocks_per_seq, dtype=torch.int32,
                                        pin_memory=cuda)
        self._flat_np, self._tables_np = self._host_flat.numpy(), self._host_tables.numpy()
        self._copied = torch.cuda.Event() if cuda else None
        self._ext = extension() if cuda and is_available() else None
        self._views: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}

    def rows(self, bs: int) -> torch.Tensor:
        """The graph of size `bs`'s `[3, bs]` int64 ids / positions / slots."""
        return self.flat[: 24 * bs].view(torch.int64).view(3, bs)

    def seq(self, bs: int) -> torch.Tensor:
        """The graph of size `bs`'s `[2, bs]` int32 context lengths / decode order."""
        return self.flat[24 * bs : 32 * bs].view(torch.int32).view(2, bs)

    def _check_size(self, bs: int, width: int) -> None:
        if not 0 < width <= self.width or not 0 < bs <= self.max_size:
            raise ValueError(f"DecodeInputs: bs {bs} / width {width} outside 1..{self.max_size} "
                             f"/ 1..{self.width}")

    def host(self, bs: int, width: int) -> HostInputs:
        """The mirror's views for a step of size `bs` whose tables are `width` wide."""
        self._check_size(bs, width)
        if self._copied is not None and not self._copied.query():
            self._copied.synchronize()  # the last stage's copies still read the mirror
        views = self._views.get(bs)
        if views is None:
            f = self._flat_np
            views = self._views[bs] = (f[: 24 * bs].view(np.int64).reshape(3, bs),
                                       f[24 * bs : 32 * bs].view(np.int32).reshape(2, bs),
                                       f[32 * bs : 48 * bs].view(np.int64).reshape(bs, 2))
        return HostInputs(*views, self._tables_np[: bs * width].reshape(bs, width))

    def stage(self, bs: int, width: int, num_fixes: int, prev: torch.Tensor | None,
              stream: torch.cuda.Stream | None = None) -> None:
        """Move what `host(bs, width)` holds into the graph's buffers; apply the fixes.

        Args:
            bs: the graph's batch size.
            width: the tables' width, as given to `host`.
            num_fixes: the first `num_fixes` rows of `host(...).fixes` to apply.
            prev: `[M]` int64, the previous step's sampled ids (on the device),
                which the fixes index; unused when `num_fixes` is 0.
            stream: the current CUDA stream, if the caller has it at hand.
        """
        self._check_size(bs, width)
        if not 0 <= num_fixes <= bs:
            raise ValueError(f"stage: num_fixes {num_fixes} outside 0..{bs}")
        if num_fixes:
            if prev is None or prev.device != self.flat.device:
                raise ValueError(f"stage: the fixes need prev, the previous step's sampled "
                                 f"ids on {self.flat.device}")
            # The kernel writes where the fixes say: check them here, not on the device.
            if bs not in self._views:
                raise ValueError(f"stage: fill host({bs}, ...) first")
            fixes = self._views[bs][2][:num_fixes]
            if (fixes.min() < 0 or fixes[:, 0].max() >= bs
                    or fixes[:, 1].max() >= prev.shape[0]):
                raise ValueError(f"stage: a fix is outside the {bs} rows or the "
                                 f"{prev.shape[0]} previous samples")
            if prev.dtype != torch.int64 or not prev.is_contiguous():
                prev = prev.to(torch.int64).contiguous()
        nbytes = 32 * bs + 16 * num_fixes
        if self._ext is not None:
            stream = stream or torch.cuda.current_stream(self.device)
            flat = self.flat.data_ptr()
            self._ext.stage_step_inputs(
                flat, self._host_flat.data_ptr(), nbytes, self.tables.data_ptr(),
                self._host_tables.data_ptr(), bs, width, self.width, flat, flat + 32 * bs,
                prev.data_ptr() if num_fixes else 0, num_fixes, stream.cuda_stream)
        else:
            self.flat[:nbytes].copy_(self._host_flat[:nbytes], non_blocking=True)
            self.tables[:bs, :width].copy_(self._host_tables[: bs * width].view(bs, width),
                                           non_blocking=True)
            if num_fixes:
                fixes = self.flat[32 * bs : nbytes].view(torch.int64).view(num_fixes, 2)
                self.rows(bs)[0].index_copy_(0, fixes[:, 0], prev.index_select(0, fixes[:, 1]))
        if self._copied is not None:
            self._copied.record(stream)

    def reset(self, bs: int) -> None:
        """Padding in every row of size `bs`'s inputs (before its capture)."""
        view = self.host(bs, 1)
        view.pad(0)
        view.seq[1] = np.arange(bs)
        self.stage(bs, 1, 0, None)
# --8<-- [end:decode_inputs]


# --8<-- [start:capture_sizes]
def capture_sizes(max_num_seqs: int, max_size: int = MAX_CAPTURE_SIZE) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, 8, then every multiple of 8, up to the limit.

    The limit is `min(max_num_seqs, max_size)` and is itself always captured.
    """
    limit = min(max_num_seqs, max_size)
    sizes = [s for s in (1, 2, 4) if s < limit]
    sizes += list(range(8, limit, 8))
    return sorted(set(sizes) | {limit})


def context_bounds(max_context_len: int, grid: Callable[[int], object]) -> list[int]:
    """The context bounds to capture a batch size for, ascending, max_context_len last.

    Args:
        max_context_len: the engine's bound (`max_model_len`).
        grid: the decode kernel's grid for a bound (anything comparable):
            a bound whose grid equals that of the next larger one is dropped,
            so a batch that needs no splits gets one graph.
    """
    bounds = [max_context_len]
    for b in sorted((b for b in CONTEXT_BOUNDS if b < max_context_len), reverse=True):
        if grid(b) != grid(bounds[0]):
            bounds.insert(0, b)
    return bounds
# --8<-- [end:capture_sizes]


# --8<-- [start:graph_runner]
class CudaGraphRunner:
    """Static decode buffers, one captured graph per batch size, and replay.

    Args:
        forward: runs the model and its LM head over the static buffers.
        kv_caches: the per-layer caches the forward reads and writes.
        sizes: the batch sizes to capture (see `capture_sizes`).
        max_blocks_per_seq: width `W` of the static block table (the blocks
            of a `max_model_len`-token sequence).
        max_context_len: the engine's context-length bound (`max_model_len`).
        device: the GPU.
        bounds: a batch size's context bounds to capture (see
            `context_bounds`); None: `[max_context_len]` for every size.
    """

    def __init__(
        self,
        forward: ForwardFn,
        kv_caches: list[KVCache],
        sizes: list[int],
        max_blocks_per_seq: int,
        max_context_len: int,
        device: torch.device,
        bounds: Callable[[int], list[int]] | None = None,
    ) -> None:
        if not sizes or min(sizes) < 1:
            raise ValueError(f"capture sizes must be positive, got {sizes}")
        self.forward = forward
        self.kv_caches = kv_caches
        self.sizes = sorted(sizes)
        self.max_size = self.sizes[-1]
        self.device = device
        n = self.max_size
        self.inputs = DecodeInputs(n, max_blocks_per_seq, device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        # Per batch size, the context bounds it has a graph for, ascending.
        self.bounds = {bs: bounds(bs) if bounds else [max_context_len] for bs in self.sizes}
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}  # (size, bound)
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}

    def padded_size(self, num_seqs: int) -> int | None:
        """The captured size a batch of `num_seqs` runs at, or None if it is too big."""
        i = bisect.bisect_left(self.sizes, num_seqs)
        return self.sizes[i] if i < len(self.sizes) else None

    def _metadata(self, bs: int, bound: int) -> CudaAttentionMetadata:
        # The host lists describe the padded capture-time batch; the decode
        # path reads only the device tensors and the bound.
        return CudaAttentionMetadata(
            slot_mapping=self.inputs.rows(bs)[2],
            query_start_loc=self.query_start_loc[: bs + 1],
            context_lens=self.inputs.seq(bs)[0],
            block_tables=self.inputs.tables[:bs],
            max_query_len=1,
            max_context_len=bound,
            query_start_loc_cpu=list(range(bs + 1)),
            context_lens_cpu=[1] * bs,
            num_decodes=bs,
            decode_max_context_len=bound,  # sizes the decode kernel's grid
            decode_order=self.inputs.seq(bs)[1],
        )

    def _run_eager(self, bs: int, bound: int) -> torch.Tensor:
        rows = self.inputs.rows(bs)
        return self.forward(rows[0], rows[1], self.kv_caches, self._metadata(bs, bound))

    # --8<-- [start:capture]
    @torch.inference_mode()
    def capture(self, pool: tuple[int, int] | None = None) -> None:
        """Warm up and capture every size and bound, largest first, into one memory pool.

        Args:
            pool: a pool to share (`torch.cuda.graph_pool_handle()`); None: a new one.
        """
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle() if pool is None else pool
        # Each size's capture writes its padding over the shared buffer: what a
        # step staged before a (re)capture is put back after it, so that a graph
        # replayed without a new stage (a benchmark's) reads a step, not padding.
        saved = self.inputs.flat.clone(), self.inputs.tables.clone()
        with capture_stream(self.device):
            for bs in reversed(self.sizes):
                self.inputs.reset(bs)  # the sizes share the buffer: padding in this one's layout
                for bound in reversed(self.bounds[bs]):
                    self._run_eager(bs, bound)  # warm-up: handles, workspaces, lazy init
                    torch.cuda.synchronize(self.device)
                    graph = torch.cuda.CUDAGraph()
                    graph.capture_begin(pool=pool)
                    try:
                        out = self._run_eager(bs, bound)
                    finally:
                        graph.capture_end()
                    self.graphs[bs, bound], self.outputs[bs, bound] = graph, out
        self.inputs.flat.copy_(saved[0])
        self.inputs.tables.copy_(saved[1])
        logger.info("captured %d CUDA graphs (batch sizes %d..%d) in %.1f s",
                    len(self.graphs), self.sizes[0], self.max_size, time.perf_counter() - start)
    # --8<-- [end:capture]

    # --8<-- [start:replay]
    def replay(self, bs: int, max_context_len: int | None = None) -> torch.Tensor:
        """Replay the graph of size `bs` over what `inputs.stage` last moved in.

        Args:
            bs: a captured batch size (`padded_size`).
            max_context_len: the longest context of the step (a host int):
                picks the graph of the smallest bound that holds it; None:
                the largest.

        Returns:
            `[bs, vocab]` logits (a graph output: valid until the next replay).
        """
        bounds = self.bounds[bs]
        bound = bounds[-1]
        if max_context_len is not None:
            bound = bounds[bisect.bisect_left(bounds, max_context_len)]
        graph = self.graphs.get((bs, bound))
        if graph is None:  # not captured (CPU checks of the padding): same buffers, eagerly
            return self._run_eager(bs, bound)
        graph.replay()
        return self.outputs[bs, bound]
    # --8<-- [end:replay]
# --8<-- [end:graph_runner]


def piecewise_sizes(max_tokens: int, smallest: int = 16) -> list[int]:
    """Token counts to capture piecewise: 16, 32, 64, ... while below `max_tokens`,
    then `max_tokens` itself; none for 0. A step pads its tokens to the next one."""
    sizes, size = [], smallest
    while size < max_tokens:
        sizes.append(size)
        size *= 2
    return sizes + [max_tokens] if max_tokens > 0 else []


# (input_ids, positions, kv_caches, metadata) -> the last hidden states [T, hidden]
HiddenFn = Callable[[torch.Tensor, torch.Tensor, list[KVCache], CudaAttentionMetadata],
                    torch.Tensor]


@dataclass
class _AttentionCall:
    """An attention between two pieces, as the forward made it at capture.

    `q`, `key` and `value` are views of the QKV projection the piece before
    wrote (the runner's `qkv_out`), `size` rows each.
    """

    backend: CudaAttentionBackend
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    scale: float
    key: torch.Tensor | None
    value: torch.Tensor | None


class PiecewiseGraphRunner:
    """Steps with prompt tokens: CUDA graphs between the attentions, attention eagerly.

    A decode graph can hold the whole forward because the decode kernel reads
    only device tensors. Prefill attention cannot be captured: how it splits
    the batch into sequences is host data, different every step. Everything
    else in a layer works row by row (matrix products, norms, RoPE, the KV
    write), so it depends on the number of tokens alone. So the forward is
    captured in pieces, one graph from each attention to the next, for a
    ladder of token counts, and a step runs:

        piece 0        embedding, layer 0 up to its attention    (graph)
        attention 0    over the step's real metadata              (eager)
        piece 1        layer 0 after attention, layer 1 up to it  (graph)
        ...
        piece L        layer L-1 after attention, the last norm   (graph)

    The forward is split where `CudaAttentionBackend.paged_attention` is
    called: the metadata of a captured forward carries a `split`, which
    ends the current capture, records the call, begins the next capture and
    returns the static `attn_out` buffer that the next piece reads. A step
    of `T` tokens pads them to the captured size `S >= T` (ids 0, positions
    0, slots -1: the KV write skips them), and its attention reads and
    writes the first `T` rows only.

    Attention reads the QKV projection's output between two pieces, so that
    output must outlive the piece that wrote it. Every layer's projection
    writes it into one buffer, `qkv_out` (handed to the model in the
    metadata): each layer's attention has read it before the next layer's
    projection writes it again, and one buffer of the largest size serves the
    graphs of every size.

    One kind of step needs no host data inside the forward at all: a single
    prompt with no cached prefix and no decodes beside it, as a lone request's
    first step is. Its attention is FlashAttention over the step's own K/V,
    whose one sequence is described by `[0, T]` in device memory. Captured
    for `S` tokens (the host's bounds `S`, the buffer `[0, S]`), the same
    launches run any `T <= S` once the buffer says `[0, T]`: rows past `T`
    belong to no sequence, and row-wise everywhere else, they reach nothing
    real. So up to `max_prompt_tokens` each size also gets a graph of the
    whole forward (`run_prompt`).

    Args:
        forward: the model's forward (no LM head).
        kv_caches: the per-layer caches.
        sizes: the token counts to capture (see `piecewise_sizes`).
        num_heads: query heads; `attn_out` is `[max(sizes), num_heads, head_dim]`.
        num_kv_heads: KV heads; `qkv_out` is `[max(sizes), (num_heads + 2 *
            num_kv_heads) * head_dim]`.
        head_dim: size of one head.
        dtype: the activations' dtype.
        device: the GPU.
        max_prompt_tokens: the largest size that also gets a whole-forward graph
            of a lone prompt; 0 for none (prefill attention that is not
            FlashAttention's varlen kernel reads host data: it cannot be captured).
    """

    def __init__(self, forward: HiddenFn, kv_caches: list[KVCache], sizes: list[int],
                 num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, max_prompt_tokens: int = 0) -> None:
        if not sizes or min(sizes) < 1:
            raise ValueError(f"piecewise sizes must be positive, got {sizes}")
        self.forward = forward
        self.kv_caches = kv_caches
        self.sizes = sorted(sizes)
        self.device = device
        self.max_prompt_tokens = max_prompt_tokens
        n = self.sizes[-1]
        self.token_inputs = TokenInputs(n, device)
        self.attn_out = torch.zeros(n, num_heads, head_dim, dtype=dtype, device=device)
        self.qkv_out = torch.zeros(n, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype,
                                   device=device)
        self._no_seqs = torch.zeros(1, dtype=torch.int32, device=device)
        # A lone prompt's `query_start_loc`, [0, T] (its context_lens: [T], the same memory).
        self._one_prompt = torch.zeros(2, dtype=torch.int32, device=device)
        self._one_table = torch.zeros(1, 1, dtype=torch.int32, device=device)
        self.pieces: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self.calls: dict[int, list[_AttentionCall]] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.prompt_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.prompt_outputs: dict[int, torch.Tensor] = {}

    def padded_size(self, num_tokens: int) -> int | None:
        """The captured size a step of `num_tokens` runs at, or None if it is too big."""
        i = bisect.bisect_left(self.sizes, num_tokens)
        return self.sizes[i] if i < len(self.sizes) else None

    def _forward(self, size: int, split: AttentionSplit) -> torch.Tensor:
        # Only the pieces read this metadata (the KV write's slots); every
        # attention goes to `split`.
        meta = CudaAttentionMetadata(
            slot_mapping=self.token_inputs.rows[2, :size], query_start_loc=self._no_seqs,
            context_lens=self._no_seqs[:0], block_tables=self._no_seqs[:0].view(0, 1),
            max_query_len=size, max_context_len=0, query_start_loc_cpu=[0],
            context_lens_cpu=[], split=split, qkv_out=self.qkv_out[:size])
        return self.forward(self.token_inputs.rows[0, :size], self.token_inputs.rows[1, :size],
                            self.kv_caches, meta)

    def _forward_prompt(self, size: int) -> torch.Tensor:
        """The forward of one prompt of up to `size` tokens, attention included:
        every length it reads on the device (`_one_prompt`), its bounds (`size`)
        on the host."""
        loc = self._one_prompt
        meta = CudaAttentionMetadata(
            slot_mapping=self.token_inputs.rows[2, :size], query_start_loc=loc,
            context_lens=loc[1:], block_tables=self._one_table, max_query_len=size,
            max_context_len=size, query_start_loc_cpu=[0, size], context_lens_cpu=[size],
            prefill_query_start_loc=loc, prefill_query_start_loc_cpu=[0, size],
            prefill_context_lens_cpu=[size], qkv_out=self.qkv_out[:size])
        return self.forward(self.token_inputs.rows[0, :size], self.token_inputs.rows[1, :size],
                            self.kv_caches, meta)

    def has_prompt_graph(self, size: int) -> bool:
        """Whether a lone prompt padded to `size` tokens replays one graph (`run_prompt`)."""
        return size in self.prompt_graphs

    def _attend(self, call: _AttentionCall, num_tokens: int,
                meta: CudaAttentionMetadata) -> None:
        """Attention over the step's first `num_tokens` rows, into `attn_out`."""
        t = num_tokens
        out = call.backend.paged_attention(
            call.q[:t], call.k_cache, call.v_cache, meta, call.scale,
            None if call.key is None else call.key[:t],
            None if call.value is None else call.value[:t])
        self.attn_out[:t].copy_(out)

    # --8<-- [start:piecewise_capture]
    @torch.inference_mode()
    def capture(self, pool: tuple[int, int] | None = None) -> None:
        """Warm up and capture every size, largest first, into `pool`."""
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle() if pool is None else pool
        with capture_stream(self.device):
            for size in reversed(self.sizes):
                self._forward(size, lambda *args, size=size: self.attn_out[:size])  # warm-up
                torch.cuda.synchronize(self.device)
                self._capture_size(size, pool)
            for size in reversed([s for s in self.sizes if s <= self.max_prompt_tokens]):
                self._one_prompt[1:].fill_(size)  # captured for its longest prompt
                self._forward_prompt(size)  # warm-up
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                graph.capture_begin(pool=pool)
                try:
                    out = self._forward_prompt(size)
                finally:
                    graph.capture_end()
                self.prompt_graphs[size], self.prompt_outputs[size] = graph, out
        logger.info("captured piecewise CUDA graphs for %d token counts (%d..%d), %d pieces "
                    "each, and whole-forward graphs of a lone prompt up to %d tokens, in %.1f s",
                    len(self.sizes), self.sizes[0], self.sizes[-1],
                    len(self.pieces[self.sizes[0]]), max(self.prompt_graphs, default=0),
                    time.perf_counter() - start)

    def _capture_size(self, size: int, pool: tuple[int, int]) -> None:
        pieces = [torch.cuda.CUDAGraph()]
        calls: list[_AttentionCall] = []

        def split(backend: CudaAttentionBackend, q: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, scale: float, key: torch.Tensor | None,
                  value: torch.Tensor | None) -> torch.Tensor:
            q, key, value = self._stage(q, key, value, size)  # (recorded in this piece)
            pieces[-1].capture_end()  # this piece ends where attention begins
            calls.append(_AttentionCall(backend, q, k_cache, v_cache, scale, key, value))
            pieces.append(torch.cuda.CUDAGraph())
            pieces[-1].capture_begin(pool=pool)  # the next one begins after it
            return self.attn_out[:size]

        pieces[0].capture_begin(pool=pool)
        try:
            out = self._forward(size, split)
        finally:
            pieces[-1].capture_end()
        self.pieces[size], self.calls[size], self.outputs[size] = pieces, calls, out
    # --8<-- [end:piecewise_capture]

    def _stage(self, q: torch.Tensor, key: torch.Tensor | None, value: torch.Tensor | None,
               size: int) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """`q`, `key` and `value` as views of `qkv_out`, copied there when the forward
        wrote them elsewhere (a model without the fused forward, GPT-2): attention
        reads them after their piece ends, so each layer's own tensors would stay
        allocated in the graphs' memory for every layer and every size."""
        buf = self.qkv_out[:size]
        start, end = buf.data_ptr(), buf.data_ptr() + buf.numel() * buf.element_size()
        if key is None or value is None or start <= q.data_ptr() < end:
            return q, key, value
        hq, hkv, d = q.shape[1], key.shape[1], q.shape[2]
        q_buf, k_buf, v_buf = buf.split([hq * d, hkv * d, hkv * d], dim=-1)
        staged = (q_buf.view(size, hq, d), k_buf.view(size, hkv, d), v_buf.view(size, hkv, d))
        for dst, src in zip(staged, (q, key, value)):
            dst.copy_(src)
        return staged

    # --8<-- [start:piecewise_replay]
    def run(self, token_inputs: torch.Tensor, meta: CudaAttentionMetadata, num_tokens: int,
            token_fixes: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Fill the static buffers, then replay the pieces with attention between them.

        Args:
            token_inputs: `[3, S]` int64 ids / positions / slots of the step's
                `num_tokens` tokens, padded to a captured size `S`.
            meta: the step's attention metadata (its first `num_tokens` rows).
            num_tokens: the step's real tokens.
            token_fixes: `(rows, ids)`, as in `TokenInputs.fill`.

        Returns:
            `[num_tokens, hidden]` last hidden states (graph memory: valid
            until the next step).
        """
        size = token_inputs.shape[1]
        self.token_inputs.fill(token_inputs, token_fixes)
        pieces = self.pieces.get(size)
        if pieces is None:  # not captured (CPU checks of the layout): the pieces, eagerly
            def attend(backend: CudaAttentionBackend, *args: object) -> torch.Tensor:
                self._attend(_AttentionCall(backend, *args), num_tokens, meta)
                return self.attn_out[:size]
            return self._forward(size, attend)[:num_tokens]
        for piece, call in zip(pieces, self.calls[size]):
            piece.replay()
            self._attend(call, num_tokens, meta)
        pieces[-1].replay()
        return self.outputs[size][:num_tokens]
    # --8<-- [end:piecewise_replay]

    # --8<-- [start:prompt_replay]
    def run_prompt(self, token_inputs: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """One prompt with no cached prefix, alone in its step: one replay.

        Args:
            token_inputs: `[3, S]` int64 ids / positions / slots of its
                `num_tokens` tokens, padded to a size `S` with `has_prompt_graph(S)`.
            num_tokens: its tokens.

        Returns:
            `[num_tokens, hidden]` last hidden states (graph memory: valid
            until the next step).
        """
        size = token_inputs.shape[1]
        self.token_inputs.fill(token_inputs, None)
        self._one_prompt[1:].fill_(num_tokens)  # its length, on the device: no sync
        self.prompt_graphs[size].replay()
        return self.prompt_outputs[size][:num_tokens]
    # --8<-- [end:prompt_replay]


__all__ = ["CONTEXT_BOUNDS", "MAX_CAPTURE_SIZE", "MAX_PROMPT_GRAPH_TOKENS", "CudaGraphRunner",
           "DecodeInputs", "HostInputs", "PiecewiseGraphRunner", "TokenInputs", "capture_sizes",
           "capture_stream", "context_bounds", "piecewise_sizes"]
