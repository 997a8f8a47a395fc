"""CUDA graphs for decode steps: capture once per batch size, replay every step.

A decode step of a 0.6B model is a few hundred small kernels; launched one
by one from Python, the launches take longer than the GPU work. A CUDA graph
records the launches of the whole forward (and the logits) once, for a fixed
batch size reading fixed input buffers, and replays them with one call.

    capture sizes   1  2  4  8  16  24  32  ...  max            (one graph each)
    static inputs   input_ids, positions, slot_mapping   [3, max]  int64
                    context_lens                         [max]     int32
                    block_tables                         [max, W]  int32
    a step of n sequences runs the graph of the smallest size bs >= n:

        row        0 .. n-1          n .. bs-1 (padding)
        token      the real tokens   0
        position   the real ones     0
        slot       the real ones     -1        (the KV write skips it)
        context    the real ones     1         (reads block 0, reserved)
        blocks     the real tables   [0, ...]

Padded rows compute garbage that nothing reads: their K/V are not written
and their logits are sliced off. The graphs share one memory pool, captured
largest first so that the smaller ones reuse its blocks; their outputs alias,
so a replay's logits are valid until the next replay.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable

import torch

from mini_vllm.attention import KVCache
from mini_vllm.cuda_backend import CudaAttentionMetadata

logger = logging.getLogger(__name__)

MAX_CAPTURE_SIZE = 512
# A graph is captured for contexts up to max_model_len, but most steps see far
# shorter ones: small batches get the decode kernel's partitions sized for this
# many tokens (measured at batch 1 on an H200: 1.31 ms per output token at a
# 576-token context with partitions sized for 8,256, 1.02 ms at 192 tokens).
GRAPH_TYPICAL_CONTEXT_LEN = 2048

# (input_ids, positions, kv_caches, metadata) -> logits [bs, vocab]
ForwardFn = Callable[[torch.Tensor, torch.Tensor, list[KVCache], CudaAttentionMetadata],
                     torch.Tensor]


# --8<-- [start:capture_sizes]
def capture_sizes(max_num_seqs: int, max_size: int = MAX_CAPTURE_SIZE) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, 8, then every multiple of 8, up to the limit.

    The limit is `min(max_num_seqs, max_size)` and is itself always captured.
    """
    limit = min(max_num_seqs, max_size)
    sizes = [s for s in (1, 2, 4) if s < limit]
    sizes += list(range(8, limit, 8))
    return sorted(set(sizes) | {limit})
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
        max_context_len: the context-length bound the decode kernel is
            captured with (`max_model_len`).
        device: the GPU.
    """

    def __init__(
        self,
        forward: ForwardFn,
        kv_caches: list[KVCache],
        sizes: list[int],
        max_blocks_per_seq: int,
        max_context_len: int,
        device: torch.device,
    ) -> None:
        if not sizes or min(sizes) < 1:
            raise ValueError(f"capture sizes must be positive, got {sizes}")
        self.forward = forward
        self.kv_caches = kv_caches
        self.sizes = sorted(sizes)
        self.max_size = self.sizes[-1]
        self.max_context_len = max_context_len
        self.device = device
        n = self.max_size
        # Rows of `token_inputs`: input ids, positions, slots (one copy fills all three).
        self.token_inputs = torch.zeros(3, n, dtype=torch.int64, device=device)
        self.token_inputs[2].fill_(-1)
        self.context_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    def padded_size(self, num_seqs: int) -> int | None:
        """The captured size a batch of `num_seqs` runs at, or None if it is too big."""
        i = bisect.bisect_left(self.sizes, num_seqs)
        return self.sizes[i] if i < len(self.sizes) else None

    def _metadata(self, bs: int) -> CudaAttentionMetadata:
        # The host lists describe the padded capture-time batch; the decode
        # path reads only the device tensors and the bound.
        return CudaAttentionMetadata(
            slot_mapping=self.token_inputs[2, :bs],
            query_start_loc=self.query_start_loc[: bs + 1],
            context_lens=self.context_lens[:bs],
            block_tables=self.block_tables[:bs],
            max_query_len=1,
            max_context_len=self.max_context_len,
            query_start_loc_cpu=list(range(bs + 1)),
            context_lens_cpu=[1] * bs,
            num_decodes=bs,
            decode_max_context_len=self.max_context_len,
            # Partitions for the contexts a step usually has, not for the bound.
            decode_typical_context_len=GRAPH_TYPICAL_CONTEXT_LEN,
        )

    def _run_eager(self, bs: int) -> torch.Tensor:
        return self.forward(self.token_inputs[0, :bs], self.token_inputs[1, :bs],
                            self.kv_caches, self._metadata(bs))

    # --8<-- [start:capture]
    @torch.inference_mode()
    def capture(self) -> None:
        """Warm up and capture every size, largest first, into one memory pool."""
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        # Capture on a side stream (as torch.cuda.graph() does, without its
        # per-capture gc.collect()); warm up on it too, so that per-stream
        # library workspaces exist before capture.
        stream = torch.cuda.Stream(self.device)
        torch.cuda.synchronize(self.device)
        with torch.cuda.stream(stream):
            for bs in reversed(self.sizes):
                self._run_eager(bs)  # warm-up: library handles, workspaces, lazy init
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                graph.capture_begin(pool=pool)
                try:
                    out = self._run_eager(bs)
                finally:
                    graph.capture_end()
                self.graphs[bs], self.outputs[bs] = graph, out
        torch.cuda.synchronize(self.device)
        logger.info("captured %d CUDA graphs (batch sizes %d..%d) in %.1f s",
                    len(self.sizes), self.sizes[0], self.max_size, time.perf_counter() - start)
    # --8<-- [end:capture]

    # --8<-- [start:replay]
    def run(self, token_inputs: torch.Tensor, context_lens: torch.Tensor,
            block_tables: torch.Tensor,
            token_fixes: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Fill the static buffers and replay the graph of their padded size.

        Args:
            token_inputs: `[3, bs]` int64 ids / positions / slots, padded to a
                captured size `bs` as the module docstring shows.
            context_lens: `[bs]` int32, padded with 1.
            block_tables: `[bs, w]` int32 with `w <= W`, padded rows all 0;
                columns past `w` keep stale block ids that no context reaches.
            token_fixes: `(rows, ids)` device tensors: input ids to overwrite
                after the copy (tokens sampled by the previous step, never on
                the host).

        Returns:
            `[bs, vocab]` float32 logits (a graph output: valid until the next run).
        """
        bs, width = block_tables.shape
        self.token_inputs[:, :bs].copy_(token_inputs)
        self.context_lens[:bs].copy_(context_lens)
        self.block_tables[:bs, :width].copy_(block_tables)
        if token_fixes is not None:
            rows, ids = token_fixes
            self.token_inputs[0].index_copy_(0, rows, ids.to(torch.int64))
        graph = self.graphs.get(bs)
        if graph is None:  # not captured (CPU checks of the padding): same buffers, eagerly
            return self._run_eager(bs)
        graph.replay()
        return self.outputs[bs]
    # --8<-- [end:replay]
# --8<-- [end:graph_runner]


__all__ = ["MAX_CAPTURE_SIZE", "CudaGraphRunner", "capture_sizes"]
