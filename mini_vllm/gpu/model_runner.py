"""The GPU model runner: the reference runner's step, with nothing in it waiting.

`GPUModelRunner` extends `ModelRunner` (chapter 2) for a GPU (chapter 9):

- attention runs on the CUDA kernels of phase 8 (`gpu.attention`);
- the model runs its fused forward where it can (`gpu.fused_layers`): norms
  folded into the weights, the layer's element-wise work in a few kernels;
- the batch is built on the host with numpy and crosses to the device in one
  pinned copy (`StagingBuffer`);
- a decode step replays a CUDA graph (`gpu.cuda_graphs`) instead of launching
  the forward kernel by kernel; a step with prompt tokens replays the forward
  between its attentions as graphs too.

Nothing in a step waits for the GPU; the engine's read of the sampled tokens
is the step's one synchronisation.
"""

from __future__ import annotations

import logging
from itertools import chain, islice

import numpy as np
import torch

from mini_vllm.attention import AttentionMetadata, KVCache
from mini_vllm.config import EngineConfig
from mini_vllm.distributed.parallel_state import ParallelContext
from mini_vllm.gpu.attention import (
    CudaAttentionBackend,
    CudaAttentionMetadata,
    check_sliding_window,
    select_attention_backend,
)
from mini_vllm.gpu.cuda_graphs import (
    MAX_PROMPT_GRAPH_TOKENS,
    CudaGraphRunner,
    PiecewiseGraphRunner,
    capture_sizes,
    context_bounds,
    piecewise_sizes,
)
from mini_vllm.gpu.fused_layers import prepare_forward
from mini_vllm.model_runner import BatchEntry, HostCopy, ModelRunner, _check_prev, logits_rows
from mini_vllm.ops._extension import num_sms
from mini_vllm.ops.paged_attention import decode_grid, default_decode_version, longest_first
from mini_vllm.ops.prefill import CAPTURABLE_PREFILL_BACKENDS

logger = logging.getLogger(__name__)

# GPU memory held back for the CUDA context, kernels' workspaces and
# fragmentation, on top of the estimated activations.
_GPU_FIXED_MARGIN_BYTES = 512 * 2**20


# --8<-- [start:staging]
class StagingBuffer:
    """One pinned host buffer and its device twin: a step's inputs cross in one copy.

    `to_device` packs numpy arrays into the host buffer (each at a 16-byte
    aligned offset), copies the used prefix with `non_blocking=True` and
    returns device views of the same shapes and dtypes:

        host (pinned)  | ids ....... | positions . | slots ..... | ctx .. | ...
                          one cudaMemcpyAsync of the used bytes
        device         | ids ....... | positions . | slots ..... | ctx .. | ...

    The host buffer is rewritten by the next step only after the previous
    copy has finished (an event, normally long done since the engine has
    read the sampled tokens in between). Device views stay valid until the
    next `to_device`: kernels that read them run on the same stream before
    the next copy lands.

    Args:
        device: where the views live (pinned memory only on a GPU).
        nbytes: initial size; the buffers grow when a step needs more.
    """

    def __init__(self, device: torch.device, nbytes: int = 1 << 20) -> None:
        self.device = device
        self._cuda = device.type == "cuda"
        self._copied = torch.cuda.Event() if self._cuda else None
        self._allocate(nbytes)

    def _allocate(self, nbytes: int) -> None:
        self.host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self._cuda)
        self._host_np = self.host.numpy()
        self.dev = torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def to_device(self, arrays: list[np.ndarray]) -> list[torch.Tensor]:
        """Copy `arrays` (int32 / int64) to the device at once; return their device views."""
        offsets, total = [], 0
        for a in arrays:
            offsets.append(total)
            total += -(-a.nbytes // 16) * 16
        if self._copied is not None and not self._copied.query():
            self._copied.synchronize()  # the previous step's copy still reads the host buffer
        if total > self.host.numel():
            self._allocate(max(total, 2 * self.host.numel()))
        for a, off in zip(arrays, offsets):
            self._host_np[off : off + a.nbytes] = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
        self.dev[:total].copy_(self.host[:total], non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        return [
            self.dev[off : off + a.nbytes].view(_TORCH_DTYPES[a.dtype.type]).view(a.shape)
            for a, off in zip(arrays, offsets)
        ]
# --8<-- [end:staging]


_TORCH_DTYPES = {np.int32: torch.int32, np.int64: torch.int64}


def _token_rows(host: dict[str, np.ndarray], width: int) -> np.ndarray:
    """`[3, width]` int64 ids / positions / slots of `_host_layout`'s tokens, padded
    past them with id 0, position 0 and slot -1 (a graph's padding rows write nothing)."""
    rows = np.zeros((3, width), dtype=np.int64)
    rows[2] = -1
    n = len(host["input_ids"])
    rows[:, :n] = host["input_ids"], host["positions"], host["slot_mapping"]
    return rows


# --8<-- [start:pinned_copy]
class PinnedCopy(HostCopy):
    """Tensors on their way from the GPU into pinned host memory.

    The copies are queued on the step's stream right behind the sampler, and an
    event after them marks their end, so the host can go on (and launch the
    next step) until `wait()`. With `start`, the event recorded before the
    step's first kernel, the two events time the step on the GPU.
    """

    def __init__(self, tensors: list[torch.Tensor], start: torch.cuda.Event | None,
                 stream: torch.cuda.Stream | None) -> None:
        self.start = start
        self.tensors = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
        for host, dev in zip(self.tensors, tensors):
            host.copy_(dev, non_blocking=True)
        self.event = torch.cuda.Event(enable_timing=start is not None)
        self.event.record(stream)

    def wait(self) -> list[torch.Tensor]:
        self.event.synchronize()  # the step's one host sync
        return self.tensors

    def gpu_seconds(self) -> float | None:
        return None if self.start is None else self.start.elapsed_time(self.event) / 1e3
# --8<-- [end:pinned_copy]


class GPUModelRunner(ModelRunner):
    """`ModelRunner` on the GPU's fast path: kernels, CUDA graphs, no host sync.

    It also runs on the CPU (the tests check its host logic there against the
    reference runner), where it captures no graphs.

    Args:
        engine_config: as for `ModelRunner`; `enforce_eager` captures no graphs.

    Attributes:
        forward: the forward every step runs (`gpu.fused_layers.prepare_forward`).
        graph_runner / piecewise_runner: the captured CUDA graphs, or None.
        step_start: an event recorded just before the last step's forward (after
            its inputs were copied): with an event after it, it times the step
            on the GPU, without the host's work of preparing it.
        step_stream: the stream the last step was launched on.
    """

    def __init__(self, engine_config: EngineConfig,
                 parallel: ParallelContext | None = None) -> None:
        super().__init__(engine_config, parallel)
        self.forward = prepare_forward(self.model, self.device, self.dtype)
        self.staging = StagingBuffer(self.device)
        self.step_start: torch.cuda.Event | None = None
        # (asking for the current stream costs the host microseconds: a step asks once)
        self.step_stream: torch.cuda.Stream | None = None
        self.graph_runner: CudaGraphRunner | None = None
        self.piecewise_runner: PiecewiseGraphRunner | None = None
        self.graph_memory_bytes = 0  # what the CUDA graphs' memory pool holds
        if self.device.type == "cuda" and not engine_config.enforce_eager:
            # A block that reads device data on the host (the experts' loop, where
            # PyTorch has no grouped GEMM for this GPU) cannot run inside a graph.
            held = [type(m).__name__ for m in self.model.modules()
                    if not getattr(m, "capturable", True)]
            if held:
                logger.warning("%s cannot run inside a CUDA graph here: every step runs "
                               "eagerly", held[0])
            else:
                self._capture_cuda_graphs()

    def _attention_backend(self) -> CudaAttentionBackend | None:
        cfg = self.model_config
        if self.device.type == "cuda" and cfg.layer_types:
            check_sliding_window(cfg.sliding_window,
                                 self.engine_config.scheduler_config.max_model_len)
        return select_attention_backend(self.device, self.dtype, cfg.head_dim,
                                        self.num_heads // self.num_kv_heads)

    def _kv_budget_bytes(self) -> int:
        """What is left of `total * gpu_memory_utilization` once the loaded weights
        and an estimate of the activations of the largest step are taken out."""
        if self.device.type != "cuda":  # (the tests run this runner on the CPU)
            return super()._kv_budget_bytes()
        cfg, sched_cfg = self.model_config, self.engine_config.scheduler_config
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        used = total - free  # our weights, the CUDA context, other processes
        # Largest step: every batched token's widest activations at once, plus
        # float32 logits for every sequence (an estimate, not a profile; the
        # logits are whole on every rank, gathered).
        world = self.parallel.world_size
        widest = 4 * cfg.hidden_size + 3 * cfg.intermediate_size // world + (
            self.num_heads + 2 * self.num_kv_heads
        ) * cfg.head_dim
        if cfg.num_experts:  # each token's k expert rows: gathered input, gate|up, act, out
            widest += cfg.num_experts_per_tok * (2 * cfg.hidden_size
                                                 + 3 * cfg.moe_intermediate_size)
        activations = sched_cfg.max_num_batched_tokens * widest * self.dtype.itemsize
        logits = 2 * sched_cfg.max_num_seqs * cfg.vocab_size * 4
        # The piecewise graphs' QKV buffer, which attention reads between two
        # pieces (one for every layer and size: PiecewiseGraphRunner).
        qkv_width = (self.num_heads + 2 * self.num_kv_heads) * cfg.head_dim
        pieces = 0 if self.engine_config.enforce_eager else (
            max(self._piecewise_sizes(), default=0) * qkv_width * self.dtype.itemsize)
        budget = int(total * self.engine_config.cache_config.gpu_memory_utilization)
        return budget - used - activations - logits - pieces - _GPU_FIXED_MARGIN_BYTES

    def to_host(self, tensors: list[torch.Tensor]) -> HostCopy:
        if self.step_start is None and not any(t.is_cuda for t in tensors):
            return super().to_host(tensors)  # (the CPU, in tests)
        return PinnedCopy(tensors, self.step_start, self.step_stream)

    @torch.inference_mode()
    def execute(
        self, entries: list[BatchEntry], prev_sampled: torch.Tensor | None = None,
        float_logits: bool = True,
    ) -> torch.Tensor:
        """`ModelRunner.execute` on the fast path (see `execute_fast`).

        Returns:
            `[N, vocab_size]` logits, float32 unless `float_logits=False` (then in
            the model's dtype: the fused sampler reads them as they are, which
            saves a pass over `[N, vocab]`). They may be a view of a CUDA graph's
            output: valid until the next step.
        """
        logits = self.execute_fast(entries, prev_sampled)
        return logits.float() if float_logits else logits

    def _forward_logits(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Forward and LM head over every row (model dtype): what a decode graph records."""
        return self.model.lm_head(self.forward(input_ids, positions, kv_caches, meta))

    def _piecewise_sizes(self) -> list[int]:
        """Token counts of the piecewise graphs (none without the CUDA attention backend)."""
        if not isinstance(self.attn_backend, CudaAttentionBackend):
            return []
        sched = self.engine_config.scheduler_config
        return piecewise_sizes(min(self.engine_config.max_piecewise_graph_tokens,
                                   sched.max_num_batched_tokens))

    def _capture_cuda_graphs(self) -> None:
        """Decode graphs, and piecewise graphs for steps with prompts, in one memory pool."""
        sched, cfg = self.engine_config.scheduler_config, self.model_config
        reserved = torch.cuda.memory_reserved(self.device)
        pool = torch.cuda.graph_pool_handle()
        sizes = self._piecewise_sizes()
        if sizes:
            flash = self.attn_backend.prefill_impl in CAPTURABLE_PREFILL_BACKENDS
            self.piecewise_runner = PiecewiseGraphRunner(
                self.forward, self.kv_caches, sizes, self.num_heads,
                self.num_kv_heads, cfg.head_dim, self.dtype, self.device,
                # (a lone prompt is at most max_model_len tokens)
                max_prompt_tokens=min(MAX_PROMPT_GRAPH_TOKENS, sched.max_model_len) if flash else 0)
            self.piecewise_runner.capture(pool)
        max_seqs = min(sched.max_num_seqs, sched.max_num_batched_tokens)
        self.graph_runner = CudaGraphRunner(
            self._forward_logits, self.kv_caches, capture_sizes(max_seqs),
            max_blocks_per_seq=-(-sched.max_model_len // self.block_size),
            max_context_len=sched.max_model_len, device=self.device,
            bounds=lambda bs: context_bounds(
                sched.max_model_len, lambda bound: self._decode_grid(bs, bound)),
        )
        self.graph_runner.capture(pool)
        self.graph_memory_bytes = torch.cuda.memory_reserved(self.device) - reserved
        logger.info("CUDA graphs hold %.0f MiB of GPU memory", self.graph_memory_bytes / 2**20)

    def _decode_grid(self, num_seqs: int, bound: int) -> tuple[int, int] | None:
        """The decode kernel's (partition size, splits) for contexts up to `bound`."""
        if self.attn_backend is None or self.attn_backend.decode_impl != "kernel":
            return None  # the torch decode has no grid to size
        cfg = self.model_config
        size, splits = decode_grid(
            num_seqs, self.num_heads, self.num_kv_heads, bound,
            num_sms(self.device), default_decode_version(cfg.head_dim, self.block_size))
        return (size, splits) if splits > 1 else (0, 1)  # one split: the size is moot

    def _mark_step_start(self, stream: torch.cuda.Stream | None = None) -> None:
        if self.device.type == "cuda":  # (the fast path also runs on the CPU in tests)
            self.step_stream = stream or torch.cuda.current_stream(self.device)
            self.step_start = torch.cuda.Event(enable_timing=True)
            self.step_start.record(self.step_stream)

    # --8<-- [start:execute_fast]
    @torch.inference_mode()
    def execute_fast(
        self,
        entries: list[BatchEntry],
        prev_sampled: torch.Tensor | None = None,
        use_graph: bool = True,
    ) -> torch.Tensor:
        """`execute` without host synchronisation: CUDA graphs, kernels for attention.

        Args:
            entries: the sequences of this step.
            prev_sampled: as in `execute`.
            use_graph: replay CUDA graphs: a decode-only step the decode graph
                of a large enough batch size, any other step the piecewise
                graphs of a large enough token count, when captured.

        Returns:
            `[N, vocab_size]` logits in the model's dtype. After a graph
            replay they are a view of the graph's output buffer: valid until
            the next step.
        """
        if not entries:
            raise ValueError("execute: no entries")
        n = len(entries)
        query_lens = np.fromiter((len(e.token_ids) for e in entries), np.int64, n)
        starts = np.fromiter((e.start_pos for e in entries), np.int64, n)
        sample = np.fromiter((e.sample for e in entries), np.bool_, n)
        prev_rows = np.fromiter((e.prev_sample_row for e in entries), np.int64, n)
        if prev_rows.max() >= 0:
            _check_prev(prev_sampled)
        if use_graph and self.graph_runner is not None and query_lens.max() == 1:
            padded = self.graph_runner.padded_size(n)
            if padded is not None:
                return self._replay_decode(entries, query_lens, starts, sample, prev_rows,
                                           prev_sampled, padded)
        num_logits = np.fromiter((e.num_logits for e in entries), np.int64, n)
        if num_logits.min() < 1 or (num_logits > query_lens).any():
            i = int(np.flatnonzero((num_logits < 1) | (num_logits > query_lens))[0])
            raise ValueError(f"entry {i}: num_logits must be in 1..{query_lens[i]} (its new "
                             f"tokens), got {num_logits[i]}")
        return self._run_flat(entries, query_lens, starts, np.where(sample, num_logits, 0),
                              prev_rows, prev_sampled, use_graph)
    # --8<-- [end:execute_fast]

    def _host_layout(
        self, entries: list[BatchEntry], query_lens: np.ndarray, starts: np.ndarray,
        num_rows: int,
    ) -> dict[str, np.ndarray]:
        """`build_batch`'s arithmetic, vectorised, checked, on the host only.

        `num_rows >= len(entries)` rows of block table; rows past the
        entries are all block 0 (graph padding).
        """
        bs, n = self.block_size, len(entries)
        context_lens = starts + query_lens  # [S]
        blocks_needed = -(-context_lens // bs)  # [S]
        tables = [e.block_table for e in entries]
        table_lens = np.fromiter(map(len, tables), np.int64, n)
        if (query_lens.min() < 1 or starts.min() < 0 or (table_lens < blocks_needed).any()
                or context_lens.max() > self.model_config.max_position_embeddings):
            self._check_entries(entries, query_lens, starts, context_lens, blocks_needed)
        # The blocks holding context this step, entry after entry. The engine's
        # tables are int32 arrays (KVCacheManager.allocate_slots): joined as
        # arrays; lists (tests, callers of the runner) are read an int at a
        # time, which at 256 sequences of 1k tokens takes over half a millisecond.
        if all(type(t) is np.ndarray for t in tables):
            if (table_lens == blocks_needed).all():
                used = np.concatenate(tables).astype(np.int32, copy=False)
            else:
                used = np.concatenate([t[:k] for t, k in zip(tables, blocks_needed.tolist())]
                                      ).astype(np.int32, copy=False)
        else:
            used = np.fromiter(
                chain.from_iterable(islice(t, k) for t, k in zip(tables, blocks_needed.tolist())),
                np.int32, int(blocks_needed.sum()),
            )
        if used.min() < 1 or used.max() >= self.num_blocks:
            self._check_entries(entries, query_lens, starts, context_lens, blocks_needed)
        max_blocks = int(blocks_needed.max())
        block_tables = np.zeros((num_rows, max_blocks), dtype=np.int32)
        # Row-major boolean assignment: row i takes the next blocks_needed[i] ids.
        block_tables[:n][np.arange(max_blocks) < blocks_needed[:, None]] = used

        num_tokens = int(query_lens.sum())
        if num_tokens == n:  # one token per entry: no per-token expansion
            seq_of_token, positions = np.arange(n), starts
        else:
            query_start = np.cumsum(query_lens) - query_lens  # [S]
            seq_of_token = np.repeat(np.arange(n), query_lens)  # [T]
            positions = starts[seq_of_token] + np.arange(num_tokens) - query_start[seq_of_token]
        slot_mapping = block_tables[seq_of_token, positions // bs].astype(np.int64) * bs + (
            positions % bs
        )  # [T]
        input_ids = np.fromiter(
            chain.from_iterable(e.token_ids for e in entries), np.int64, num_tokens
        )
        return {"input_ids": input_ids, "positions": positions, "slot_mapping": slot_mapping,
                "context_lens": context_lens, "block_tables": block_tables}

    # --8<-- [start:replay_decode]
    def _replay_decode(
        self, entries: list[BatchEntry], query_lens: np.ndarray, starts: np.ndarray,
        sample: np.ndarray, prev_rows: np.ndarray, prev_sampled: torch.Tensor | None,
        padded: int,
    ) -> torch.Tensor:
        """A decode-only step through the CUDA graph of batch size `padded`."""
        n = len(entries)
        host = self._host_layout(entries, query_lens, starts, num_rows=n)
        inputs = self.graph_runner.inputs
        view = inputs.host(padded, host["block_tables"].shape[1])  # the pinned mirror
        view.rows[:, :n] = host["input_ids"], host["positions"], host["slot_mapping"]
        view.seq[0, :n] = host["context_lens"]
        view.tables[:n] = host["block_tables"]
        view.pad(n)  # rows n..padded-1
        view.seq[1] = longest_first(view.seq[0])  # the order the decode grid takes
        fix_rows = np.flatnonzero(prev_rows >= 0)  # placeholders: take the previous sample
        view.fixes[: len(fix_rows), 0] = fix_rows
        view.fixes[: len(fix_rows), 1] = prev_rows[fix_rows]
        stream = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        inputs.stage(padded, view.tables.shape[1], len(fix_rows), prev_sampled, stream)
        self._mark_step_start(stream)
        logits = self.graph_runner.replay(padded, int(host["context_lens"].max()))
        if sample.all():
            return logits[:n]  # of [padded, vocab]
        return logits[self.staging.to_device([np.flatnonzero(sample)])[0]]  # no host sync
    # --8<-- [end:replay_decode]

    # --8<-- [start:run_flat]
    def _run_flat(
        self, entries: list[BatchEntry], query_lens: np.ndarray, starts: np.ndarray,
        num_logits: np.ndarray, prev_rows: np.ndarray, prev_sampled: torch.Tensor | None,
        use_graph: bool,
    ) -> torch.Tensor:
        """Any step as one flat batch, its decodes moved to the front.

        The decode kernel takes the first `num_decodes` sequences, prefill
        attention the rest (a speculative step's verified runs among them:
        several new tokens after a cached context, as a prompt chunk has);
        the logits (the last `num_logits[i]` tokens of entry `i`, 0 for an
        entry that does not sample) come back in the entries' order. With
        `use_graph` and a piecewise graph of enough tokens, the step replays
        it (its tokens padded to that size), and a lone prompt with no cached
        prefix the graph of its whole forward where there is one; otherwise
        it runs eagerly.
        """
        n = len(entries)
        order = np.argsort(query_lens != 1, kind="stable")  # decodes first, else in order
        if (order != np.arange(n)).any():
            entries = [entries[i] for i in order]
            query_lens, starts, prev_rows = query_lens[order], starts[order], prev_rows[order]
        num_decodes = int((query_lens == 1).sum())
        host = self._host_layout(entries, query_lens, starts, num_rows=n)
        num_tokens = len(host["input_ids"])
        pieces = self.piecewise_runner if use_graph else None
        size = pieces.padded_size(num_tokens) if pieces is not None else None
        token_inputs = _token_rows(host, size or num_tokens)
        query_start_loc = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(query_lens, out=query_start_loc[1:])
        ends = np.empty(n, dtype=np.int64)  # where each entry's tokens end, entry order
        ends[order] = query_start_loc[1:]
        logits_indices = logits_rows(ends, num_logits)  # [N]
        prefill_start_loc = query_start_loc[num_decodes:] - query_start_loc[num_decodes]
        context_lens = host["context_lens"]
        has_prev = prev_rows >= 0
        views = self.staging.to_device([
            token_inputs, logits_indices,
            query_start_loc.astype(np.int32), context_lens.astype(np.int32),
            host["block_tables"], prefill_start_loc.astype(np.int32),
            query_start_loc[1:][has_prev] - 1, prev_rows[has_prev],  # placeholders, sources
            longest_first(context_lens[:num_decodes]),
        ])
        token_fixes = None
        if has_prev.any():  # placeholders: take the values the previous step sampled
            token_fixes = (views[6], prev_sampled.index_select(0, views[7]).long())
        meta = CudaAttentionMetadata(
            slot_mapping=views[0][2, :num_tokens],
            query_start_loc=views[2],
            context_lens=views[3],
            block_tables=views[4],
            max_query_len=int(query_lens.max()),
            max_context_len=int(context_lens.max()),
            query_start_loc_cpu=query_start_loc.tolist(),
            context_lens_cpu=context_lens.tolist(),
            num_decodes=num_decodes,
            decode_max_context_len=int(context_lens[:num_decodes].max()) if num_decodes else 0,
            prefill_query_start_loc=views[5] if num_decodes < n else None,
            prefill_query_start_loc_cpu=prefill_start_loc.tolist(),
            prefill_context_lens_cpu=context_lens[num_decodes:].tolist(),
            decode_order=views[8] if num_decodes else None,
        )
        self._mark_step_start()
        if (size is not None and n == 1 and num_decodes == 0 and starts[0] == 0
                and token_fixes is None and pieces.has_prompt_graph(size)):
            hidden = pieces.run_prompt(views[0], num_tokens)  # a lone prompt: one replay
        elif size is not None:
            hidden = pieces.run(views[0], meta, num_tokens, token_fixes)
        else:
            input_ids, positions = views[0][0], views[0][1]
            if token_fixes is not None:
                input_ids.index_copy_(0, *token_fixes)
            hidden = self.forward(input_ids, positions, self.kv_caches, meta)  # [T, hidden]
        return self.model.lm_head(hidden[views[1]])  # [N, vocab], model dtype
    # --8<-- [end:run_flat]


__all__ = ["GPUModelRunner", "PinnedCopy", "StagingBuffer"]
