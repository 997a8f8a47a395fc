"""The model runner: weights, the KV cache, and one forward per engine step.

The scheduler decides, for each running sequence, which new tokens to
compute this step and which cache blocks it owns (`BatchEntry`). The runner
turns that into one flat batch (`build_batch`), runs the model over it and
returns logits only where a token is sampled (`execute`).

This is the reference runner: simple, on any device. On a GPU the engine
uses `mini_vllm.gpu.GPUModelRunner`, which extends it (CUDA kernels, CUDA
graphs, a step with no host synchronisation; chapter 9).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from mini_vllm.attention import AttentionBackend, AttentionMetadata, KVCache
from mini_vllm.config import EngineConfig
from mini_vllm.distributed.parallel_state import ParallelContext
from mini_vllm.layers.parallel_linear import kv_heads_per_rank
from mini_vllm.models.loader import load_model

logger = logging.getLogger(__name__)


# --8<-- [start:batch_entry]
@dataclass
class BatchEntry:
    """One sequence's share of a step.

    Attributes:
        token_ids: the new tokens to compute this step (a whole prompt, a
            chunk of one, or the one token sampled last step).
        start_pos: tokens of this sequence already in the KV cache; the new
            tokens take positions `start_pos .. start_pos + len(token_ids) - 1`.
        block_table: the sequence's cache blocks in order; it must cover
            `start_pos + len(token_ids)` tokens.
        sample: whether to return logits for the last new token (False for a
            prompt chunk that is not the last).
        prev_sample_row: -1, or the row of `execute`'s `prev_sampled` that holds
            the real value of the last of `token_ids`: a token the previous step
            sampled, still on the device, for which `token_ids` holds a
            placeholder (async scheduling).
        num_logits: with `sample`, return logits for the last `num_logits`
            new tokens, not only the last one (speculative decoding verifies
            the last known token and the proposals after it in one forward).
    """

    token_ids: list[int]
    start_pos: int
    block_table: list[int]
    sample: bool = True
    prev_sample_row: int = -1
    num_logits: int = 1
# --8<-- [end:batch_entry]


# --8<-- [start:logits_rows]
def logits_rows(ends: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Rows of the flat batch whose logits are returned: the last `counts[i]`
    tokens of entry `i`, whose tokens end before row `ends[i]`, entry after entry.

        ends   [3, 8, 9]    counts [1, 3, 0]    ->    [2, 5, 6, 7]
    """
    starts = np.repeat(ends - counts, counts)  # [N]: each row's entry's first logits row
    offsets = np.arange(len(starts)) - np.repeat(np.cumsum(counts) - counts, counts)
    return starts + offsets
# --8<-- [end:logits_rows]


@dataclass
class ModelInput:
    """A step's device tensors, built by `ModelRunner.build_batch`.

    Attributes:
        input_ids: `[T] int64` new tokens, entry after entry.
        positions: `[T] int64` each token's position in its sequence.
        attn_metadata: slots, query starts, context lengths, block tables.
        logits_indices: `[N] int64` rows of the hidden states to turn into
            logits: the last `num_logits` new tokens of each entry with `sample=True`.
        num_tokens: `T`.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_metadata: AttentionMetadata
    logits_indices: torch.Tensor
    num_tokens: int


# --8<-- [start:host_copy]
class HostCopy:
    """Tensors of a step on their way to the host (`ModelRunner.to_host`).

    On the CPU they are there already and `wait` returns them; a GPU runner
    queues the copies behind the step and `wait` blocks until they land.
    """

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.tensors = [t.cpu() for t in tensors]

    def wait(self) -> list[torch.Tensor]:
        """The tensors, on the host."""
        return self.tensors

    def gpu_seconds(self) -> float | None:
        """The step's time on the GPU, when the runner timed it (after `wait`)."""
        return None
# --8<-- [end:host_copy]


def _check_prev(prev_sampled: torch.Tensor | None) -> torch.Tensor:
    if prev_sampled is None:
        raise ValueError("an entry has prev_sample_row >= 0 but execute() got no prev_sampled")
    return prev_sampled


class ModelRunner:
    """Owns the model and its KV cache and runs one flat batch per step.

    Args:
        engine_config: the checkpoint directory (`model`), `dtype`, `device`,
            and the cache / scheduler limits that size the KV cache.
        parallel: the tensor-parallel group this runner is one rank of (one
            rank when None): it holds that rank's share of the weights and a
            KV cache of that rank's KV heads.

    Attributes:
        model: the loaded model (the class `config.json` names, from the registry).
        kv_caches: per layer `(k_cache, v_cache)`, each
            `[num_blocks, block_size, num_kv_heads, head_dim]`, views of one tensor.
        num_blocks: KV blocks in the cache (block 0 is the padding block), the
            same on every rank.
        block_size: tokens per block.
        num_heads / num_kv_heads: the query and KV heads on this rank.
    """

    def __init__(self, engine_config: EngineConfig,
                 parallel: ParallelContext | None = None) -> None:
        self.engine_config = engine_config
        self.model_config = engine_config.model_config
        self.parallel = parallel or ParallelContext()
        self.device = torch.device(engine_config.device)
        self.dtype = engine_config.dtype
        self.block_size = engine_config.cache_config.block_size
        self.vocab_size = self.model_config.vocab_size
        world = self.parallel.world_size
        self.num_heads = self.model_config.num_attention_heads // world
        self.num_kv_heads = kv_heads_per_rank(self.model_config.num_key_value_heads, world)
        self.attn_backend = self._attention_backend()
        self.model = load_model(
            engine_config.model, self.model_config, self.dtype, self.device,
            attn_backend=self.attn_backend,
            load_format=engine_config.load_format, seed=engine_config.seed,
            parallel=self.parallel,
        )
        # Every rank holds the same blocks (the scheduler's block ids mean the
        # same slots everywhere): the fewest that fit any rank's memory.
        self.num_blocks = self.parallel.min_int(self._determine_num_blocks())
        self.kv_cache = self._allocate_kv_cache()
        self.kv_caches: list[KVCache] = [
            (self.kv_cache[layer, 0], self.kv_cache[layer, 1])
            for layer in range(self.model_config.num_hidden_layers)
        ]
        max_model_len = engine_config.scheduler_config.max_model_len
        num_tokens = (self.num_blocks - 1) * self.block_size
        logger.info(
            "KV cache: %d blocks of %d tokens (%d tokens, %.2f GiB, %s); "
            "max concurrency %.2fx for %d-token requests",
            self.num_blocks, self.block_size, num_tokens,
            self.kv_cache.numel() * self.kv_cache.element_size() / 2**30, self.device,
            num_tokens / max_model_len, max_model_len,
        )
        if num_tokens < max_model_len:
            logger.warning(
                "the KV cache holds %d tokens, fewer than max_model_len (%d)",
                num_tokens, max_model_len,
            )

    def _attention_backend(self) -> AttentionBackend | None:
        """How attention reads and writes the cache: None, the torch reference."""
        return None

    # --8<-- [start:num_blocks]
    @property
    def block_bytes(self) -> int:
        """Bytes one KV block takes across all layers (K and V), on this rank."""
        cfg = self.model_config
        per_token = cfg.num_hidden_layers * 2 * self.num_kv_heads * cfg.head_dim
        return per_token * self.block_size * self.dtype.itemsize

    def _determine_num_blocks(self) -> int:
        """How many KV blocks fit the memory budget (block 0 included).

        `num_gpu_blocks_override` wins on any device. Otherwise the budget is
        `_kv_budget_bytes()` (`cpu_kv_cache_gb` here; what the GPU has left on
        a GPU), capped at what `max_num_seqs` sequences of `max_model_len`
        tokens could ever use. A draft model for speculative decoding takes
        its share: its K/V in every block, and on a GPU its weights.
        """
        cache_cfg = self.engine_config.cache_config
        sched_cfg = self.engine_config.scheduler_config
        if cache_cfg.num_gpu_blocks_override is not None:
            return cache_cfg.num_gpu_blocks_override
        budget, block_bytes = self._kv_budget_bytes(), self.block_bytes
        spec = self.engine_config.speculative_config
        if spec is not None:  # a draft model: its cache uses the same block ids
            block_bytes += spec.draft_kv_bytes_per_block(self.block_size, self.dtype)
            if self.device.type == "cuda":  # its weights are loaded after this is sized
                budget -= spec.draft_weight_bytes(self.dtype)
        num_blocks = budget // block_bytes
        blocks_per_seq = -(-sched_cfg.max_model_len // self.block_size)
        num_blocks = min(num_blocks, sched_cfg.max_num_seqs * blocks_per_seq + 1)
        if num_blocks < 2:
            raise ValueError(
                f"not enough memory for the KV cache: one block of {self.block_size} tokens "
                f"takes {block_bytes} bytes and the budget is {max(budget, 0)} bytes; "
                "raise gpu_memory_utilization / cpu_kv_cache_gb or set num_gpu_blocks_override"
            )
        return num_blocks

    def _kv_budget_bytes(self) -> int:
        """Bytes the KV cache may take: `cpu_kv_cache_gb`."""
        return int(self.engine_config.cache_config.cpu_kv_cache_gb * 2**30)
    # --8<-- [end:num_blocks]

    def _allocate_kv_cache(self) -> torch.Tensor:
        cfg = self.model_config
        # [layers, K/V, num_blocks, block_size, num_kv_heads, head_dim]: each
        # layer's K (or V) cache is a contiguous slice of one allocation.
        return torch.zeros(
            cfg.num_hidden_layers, 2, self.num_blocks, self.block_size,
            self.num_kv_heads, cfg.head_dim,
            dtype=self.dtype, device=self.device,
        )

    # --8<-- [start:build_batch]
    def build_batch(self, entries: list[BatchEntry]) -> ModelInput:
        """Lay the entries out as one flat batch and its attention metadata.

        Everything is computed on the host with numpy and sent to the device
        in a single copy. With block size 4:

            entry        A: 3 new, start 0   B: 2 new, start 5    C: 1 new, start 8
            input_ids    a0 a1 a2            b5 b6                c8
            positions     0  1  2             5  6                 8
            query_start_loc  0 ------------- 3 -------------- 5 -------- 6
            block_table  [7]                 [2, 9]               [4, 5, 3]
            slot         7*4+0 7*4+1 7*4+2   9*4+1 9*4+2          3*4+0
            context_lens 3                   7                    9

        Raises:
            ValueError: an entry is empty, its positions exceed the model's,
                or its block table is too short or names a block outside
                `1 .. num_blocks - 1`.
        """
        if not entries:
            raise ValueError("build_batch: no entries")
        bs = self.block_size
        query_lens = np.array([len(e.token_ids) for e in entries], dtype=np.int64)  # [S]
        starts = np.array([e.start_pos for e in entries], dtype=np.int64)  # [S]
        context_lens = starts + query_lens  # [S]
        blocks_needed = -(-context_lens // bs)  # [S], ceil division
        self._check_entries(entries, query_lens, starts, context_lens, blocks_needed)

        num_seqs, num_tokens = len(entries), int(query_lens.sum())
        query_start_loc = np.zeros(num_seqs + 1, dtype=np.int64)
        np.cumsum(query_lens, out=query_start_loc[1:])
        # Per token: its entry, then its position = entry start + offset in the entry.
        seq_of_token = np.repeat(np.arange(num_seqs), query_lens)  # [T]
        offsets = np.arange(num_tokens) - query_start_loc[:-1][seq_of_token]  # [T]
        positions = starts[seq_of_token] + offsets  # [T]
        # Only the blocks that hold this step's context, padded with block 0.
        max_blocks = int(blocks_needed.max())
        block_tables = np.zeros((num_seqs, max_blocks), dtype=np.int64)
        for i, e in enumerate(entries):
            block_tables[i, : blocks_needed[i]] = e.block_table[: blocks_needed[i]]
        slot_mapping = (
            block_tables[seq_of_token, positions // bs] * bs + positions % bs
        )  # [T]
        counts = np.array([e.num_logits if e.sample else 0 for e in entries], dtype=np.int64)
        logits_indices = logits_rows(query_start_loc[1:], counts)  # [N] the last new tokens

        input_ids = np.fromiter(
            chain.from_iterable(e.token_ids for e in entries), dtype=np.int64, count=num_tokens
        )
        # One host buffer, one copy to the device, then views of it.
        parts = [input_ids, positions, slot_mapping, logits_indices, query_start_loc,
                 context_lens, block_tables.reshape(-1)]
        dev = torch.from_numpy(np.concatenate(parts)).to(self.device)
        views = dev.split([len(p) for p in parts])
        meta = AttentionMetadata(
            slot_mapping=views[2],
            query_start_loc=views[4].to(torch.int32),
            context_lens=views[5].to(torch.int32),
            block_tables=views[6].view(num_seqs, max_blocks).to(torch.int32),
            max_query_len=int(query_lens.max()),
            max_context_len=int(context_lens.max()),
            query_start_loc_cpu=query_start_loc.tolist(),
            context_lens_cpu=context_lens.tolist(),
        )
        return ModelInput(views[0], views[1], meta, views[3], num_tokens)
    # --8<-- [end:build_batch]

    def _check_entries(
        self,
        entries: list[BatchEntry],
        query_lens: np.ndarray,
        starts: np.ndarray,
        context_lens: np.ndarray,
        blocks_needed: np.ndarray,
    ) -> None:
        max_pos = self.model_config.max_position_embeddings
        for i, e in enumerate(entries):
            if query_lens[i] == 0:
                raise ValueError(f"entry {i}: token_ids is empty")
            if starts[i] < 0:
                raise ValueError(f"entry {i}: start_pos must be >= 0, got {starts[i]}")
            if context_lens[i] > max_pos:
                raise ValueError(
                    f"entry {i}: positions up to {context_lens[i] - 1} exceed the model's "
                    f"max_position_embeddings ({max_pos})"
                )
            if not 1 <= e.num_logits <= query_lens[i]:
                raise ValueError(f"entry {i}: num_logits must be in 1..{query_lens[i]} (its new "
                                 f"tokens), got {e.num_logits}")
            if len(e.block_table) < blocks_needed[i]:
                raise ValueError(
                    f"entry {i}: {context_lens[i]} tokens need {blocks_needed[i]} blocks of "
                    f"{self.block_size}, the block table has {len(e.block_table)}"
                )
            used = e.block_table[: blocks_needed[i]]
            if min(used) < 1 or max(used) >= self.num_blocks:
                raise ValueError(
                    f"entry {i}: block ids must be in 1..{self.num_blocks - 1} "
                    f"(block 0 is reserved), got {used}"
                )

    # --8<-- [start:execute]
    @torch.inference_mode()
    def execute(
        self, entries: list[BatchEntry], prev_sampled: torch.Tensor | None = None,
        float_logits: bool = True,
    ) -> torch.Tensor:
        """Run one step: write the new tokens' K/V to the cache and return logits.

        Args:
            entries: the sequences of this step, each with its new tokens.
            prev_sampled: `[M] int64` the previous step's sampled token ids, for
                entries whose last token is a placeholder (`prev_sample_row`:
                async scheduling, chapter 9); None otherwise.
            float_logits: return float32 logits (the GPU runner may return them
                in the model's dtype when False).

        Returns:
            `[N, vocab_size]` logits of the last new token of each entry with
            `sample=True` (its last `num_logits` new tokens), in entry order
            (N may be 0).
        """
        batch = self.build_batch(entries)
        self._take_previous_samples(batch, entries, prev_sampled)
        hidden = self.model(batch.input_ids, batch.positions, self.kv_caches, batch.attn_metadata)
        return self.model.compute_logits(hidden[batch.logits_indices])  # [N, vocab]
    # --8<-- [end:execute]

    def to_host(self, tensors: list[torch.Tensor]) -> HostCopy:
        """Start copying a step's results (the sampled ids) to the host."""
        return HostCopy(tensors)

    def _take_previous_samples(self, batch: ModelInput, entries: list[BatchEntry],
                               prev_sampled: torch.Tensor | None) -> None:
        """Write into `batch.input_ids` the values of placeholder tokens (async scheduling)."""
        fixes = [(batch.attn_metadata.query_start_loc_cpu[i + 1] - 1, e.prev_sample_row)
                 for i, e in enumerate(entries) if e.prev_sample_row >= 0]
        if fixes:
            rows, src = zip(*fixes)
            batch.input_ids[list(rows)] = _check_prev(prev_sampled)[list(src)].to(
                batch.input_ids.device)


__all__ = ["BatchEntry", "HostCopy", "ModelInput", "ModelRunner", "logits_rows"]
