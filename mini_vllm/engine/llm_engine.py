"""`LLMEngine`: the synchronous step loop that ties every phase together.

One call of `step()` is one iteration of continuous batching:

```
Scheduler.schedule()          which requests run, how many new tokens each (phase 4)
  └─► ModelRunner.execute()   one flat batch through the model over the paged cache (2-3)
        └─► Sampler()         one token per request that finished its prompt (phase 5)
              └─► to the host the sampled ids; reading them is the step's one
                    │         host synchronisation
                    └─► detokenize + stop checks ─► RequestOutput deltas (phases 1, 5)
```

With async scheduling (on by default on a GPU: `engine/async_scheduling.py`,
chapter 9) the next step is launched before this one is read back, so the
host's work overlaps the device's.

A request with `n > 1` becomes `n` child requests (`"<id>#<i>"`) that share
the prompt's cached blocks; their outputs are gathered back under the
parent's id.

Beside the loop: the state of requests and of a launched step
(`engine/request_state.py`), recording tokens and making outputs
(`engine/output_processor.py`), and requests held while their grammar
compiles (`engine/structured_outputs.py`, chapter 18).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future

import torch

from mini_vllm.config import EngineArgs, EngineConfig
from mini_vllm.distributed.executor import Executor, WorkerDiedError
from mini_vllm.engine.async_scheduling import AsyncScheduling
from mini_vllm.engine.input_processor import InputProcessor, ProcessedRequest
from mini_vllm.engine.output_processor import OutputProcessing
from mini_vllm.engine.request_state import (
    _Completion,
    _depends_on_tokens,
    _Group,
    _LogprobRows,
    _Step,
)
from mini_vllm.engine.speculative import SpeculativeSteps
from mini_vllm.engine.structured_outputs import StructuredOutputSteps
from mini_vllm.kv_cache import KVCacheManager
from mini_vllm.model_runner import BatchEntry, ModelRunner
from mini_vllm.outputs import RequestOutput
from mini_vllm.sampler import Sampler
from mini_vllm.sampling_metadata import SamplingMetadata, SamplingRequest, make_generator
from mini_vllm.sampling_params import RequestOutputKind, SamplingParams
from mini_vllm.scheduler import Scheduler
from mini_vllm.scheduler_output import SchedulerOutput
from mini_vllm.sequence import Request
from mini_vllm.stop_checker import StopChecker
from mini_vllm.tokenizer import IncrementalDetokenizer

logger = logging.getLogger(__name__)


class LLMEngine(OutputProcessing, StructuredOutputSteps, AsyncScheduling, SpeculativeSteps):
    """Scheduler + model runner + sampler + detokenizer, one `step()` at a time.

    Not thread-safe: one thread drives it (`LLM` directly, `AsyncLLM` from its
    engine thread).

    Args:
        engine_config: the resolved configuration.
    """

    def __init__(self, engine_config: EngineConfig) -> None:
        if engine_config.parallel_config.data_parallel_size > 1:
            raise ValueError("data_parallel_size: an engine is one replica; serve several "
                             "with `mini-vllm serve --data-parallel-size N` (on Ray)")
        self.config = engine_config
        self.input_processor = InputProcessor(engine_config)
        self.tokenizer = self.input_processor.tokenizer
        self.generation_config = self.input_processor.generation_config
        self.eos_token_ids = list(self.tokenizer.eos_token_ids)
        self.model_runner = make_model_runner(engine_config)
        self.vocab_size = engine_config.model_config.vocab_size
        self.max_model_len = engine_config.scheduler_config.max_model_len
        self.kv_cache_manager = KVCacheManager(
            num_blocks=self.model_runner.num_blocks,
            block_size=engine_config.cache_config.block_size,
            enable_caching=engine_config.cache_config.enable_prefix_caching,
            max_model_len=self.max_model_len,
        )
        self.scheduler = Scheduler(engine_config.scheduler_config, self.kv_cache_manager)
        self.sampler = make_sampler(engine_config.device)
        self._init_speculative(engine_config)  # speculative decoding, when configured
        self.reasoning_parser = None
        if engine_config.reasoning_parser is not None:
            from mini_vllm.reasoning import REASONING_PARSERS

            self.reasoning_parser = REASONING_PARSERS[engine_config.reasoning_parser](
                self.tokenizer)
            _ = self.reasoning_parser.reasoning_end_token_id  # a ValueError without </think>
        # Requests whose grammar is still compiling (vLLM's WAITING_FOR_FSM): id -> Future.
        self._compiling: dict[str, Future] = {}
        self._groups: dict[str, _Group] = {}
        self._children: dict[str, tuple[_Group, _Completion]] = {}
        self.async_scheduling = engine_config.async_scheduling
        self._in_flight: _Step | None = None  # launched, not read back (async scheduling)
        # The completions and sampling metadata of the last launched step's rows
        # (see _sampling_metadata).
        self._last_sampling: tuple[list[_Completion], SamplingMetadata] | None = None
        self.stats = {"num_requests_finished": 0, "prompt_tokens_total": 0,
                      "generation_tokens_total": 0, "num_requests_failed": 0,
                      # Seconds the host sat waiting for sampled tokens: near 0
                      # over a run means the host, not the GPU, set the pace.
                      "gpu_wait_s": 0.0, "num_steps": 0,
                      # GPU time of the steps (CUDA events around each, on a GPU):
                      # a run's wall time minus this is time the GPU sat idle.
                      "gpu_busy_s": 0.0, "gpu_busy_decode_s": 0.0,
                      # Structured outputs: tokens a grammar constrained, and the host's
                      # seconds building the sampling metadata of steps with such rows
                      # (the bitmasks are filled there).
                      "structured_output_tokens_total": 0, "structured_output_metadata_s": 0.0}

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> LLMEngine:
        return cls(engine_args.create_engine_config())

    def process_inputs(
        self,
        request_id: str,
        prompt: str | list[int] | dict,
        params: SamplingParams,
        priority: int = 0,
        arrival_time: float | None = None,
    ) -> ProcessedRequest:
        """Tokenize and validate a request (see `InputProcessor.process_inputs`)."""
        return self.input_processor.process_inputs(request_id, prompt, params, priority,
                                                   arrival_time)

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int] | dict,
        params: SamplingParams,
        priority: int = 0,
        arrival_time: float | None = None,
    ) -> None:
        """Validate a request and queue it (see `process_inputs` for the errors).

        A structured output is compiled here, blocking the caller, so that an
        invalid schema is this call's `ValueError` (`AsyncLLM` compiles off its
        event loop instead).
        """
        req = self.process_inputs(request_id, prompt, params, priority, arrival_time)
        if req.params.structured_outputs is not None:
            self.structured_output_manager.compile(req.params.structured_outputs)
        self.add_processed_request(req)

    # --8<-- [start:add_request]
    def add_processed_request(self, req: ProcessedRequest) -> None:
        """Queue a request that `process_inputs` validated.

        A request with a structured output whose grammar is still compiling is
        held here, out of the scheduler, until it has compiled (`_admit_compiled`).

        Raises:
            ValueError: if the id is in use, the request can never fit the cache,
                or its structured output is invalid (when that is already known).
        """
        if req.request_id in self._groups:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        spec = req.params.structured_outputs
        compiling = None if spec is None else self.structured_output_manager.submit(spec)
        n = req.params.n
        group = _Group(req.request_id, req.prompt, req.prompt_token_ids, [], req.arrival_time,
                       final_only=req.params.output_kind == RequestOutputKind.FINAL_ONLY)
        for i in range(n):
            child_id = req.request_id if n == 1 else f"{req.request_id}#{i}"
            # Each completion of a seeded request gets its own, reproducible stream.
            seed = None if req.params.seed is None else req.params.seed + i
            request = Request(child_id, req.prompt_token_ids, req.params, req.arrival_time,
                              priority=req.priority, eos_token_ids=self.eos_token_ids,
                              parent_id=req.request_id if n > 1 else None)
            if self.spec_policy is not None:
                self.spec_policy.start(request)
            group.completions.append(_Completion(
                index=i,
                request=request,
                detokenizer=IncrementalDetokenizer(
                    self.tokenizer, req.prompt_token_ids, req.params.skip_special_tokens),
                # A grammar decides where its output may end: min_tokens does not apply.
                stop_checker=StopChecker(req.params if spec is None
                                         else req.params.replace(min_tokens=0),
                                         self.eos_token_ids),
                generator=None if seed is None else make_generator(seed, self.model_runner.device),
                # A seeded completion's noise key comes from its generator's seed.
                noise_key=(None if seed is not None
                           else int(torch.randint(-(2**63), 2**63 - 1, ()))),
                text_at_end=self._detokenizes_at_end(req.params),
                logprobs=[] if req.params.logprobs is not None else None,
            ))
        if compiling is not None and not compiling.done():
            for c in group.completions:  # refused now if it could never run
                self.scheduler.check_request(c.request)
            self._compiling[req.request_id] = compiling
        else:
            if compiling is not None:
                self._attach_grammars(group, compiling.result())  # raises the spec's ValueError
            self._schedule_group(group)
        self._groups[req.request_id] = group
        for c in group.completions:
            self._children[c.request.request_id] = (group, c)

    def _schedule_group(self, group: _Group) -> None:
        added: list[str] = []
        try:
            for c in group.completions:
                self.scheduler.add_request(c.request)
                added.append(c.request.request_id)
        except ValueError:
            self.scheduler.abort_requests(added)
            raise
    # --8<-- [end:add_request]

    def has_unfinished_requests(self) -> bool:
        return bool(self._groups) or self._in_flight is not None

    # --8<-- [start:step]
    def step(self) -> list[RequestOutput]:
        """Run one engine iteration; return a delta for each request that progressed."""
        # Requests whose grammar has compiled join the scheduler (chapter 18).
        outputs = self._admit_compiled() if self._compiling else []
        if self.async_scheduling:  # plan the next step before reading this one (chapter 9)
            return outputs + self.step_async()
        sched = self.scheduler.schedule()
        if not sched.scheduled:
            self._last_sampling = None  # no token drawn: the next rows start afresh
            return outputs
        launched = self._launch(sched)
        if isinstance(launched, list):  # the step failed
            return outputs + launched
        return outputs + self._process(launched)
    # --8<-- [end:step]

    # --8<-- [start:launch]
    def _launch(self, sched: SchedulerOutput, prev: _Step | None = None,
                before_sampling: Callable[[], None] | None = None
                ) -> _Step | list[RequestOutput]:
        """Run the model and the sampler for a scheduled step without waiting for them.

        `prev`: the step launched before and not read back yet (async scheduling).
        `before_sampling`: called once the forward is queued, before the
        sampler's inputs are built (async scheduling reads `prev` back there).
        A step with proposal slots is a speculative step (`_launch_spec`).
        """
        if self._speculates(sched):
            return self._launch_spec(sched, prev, before_sampling)
        entries = self._batch_entries(sched, prev)
        sampling = [self._children[s.request.request_id] for s in sched.scheduled if s.sample]
        try:
            logits = self.model_runner.execute(  # [len(sampling), V]
                entries, prev.sampled if prev is not None else None, float_logits=False)
            decode_only = sched.num_prefill_tokens == 0
            if not sampling:  # only prompt chunks that are not the last: nothing to sample
                self._last_sampling = None
                return _Step([], self.model_runner.to_host([]), {}, None, False, decode_only)
            if before_sampling is not None:
                before_sampling()
            metadata = self._sampling_metadata(sampling, logits.device)
            sampled = self.sampler(logits, metadata)
        except WorkerDiedError:
            raise  # not this step's fault: the engine itself cannot go on
        except Exception as e:  # fail these requests, keep the engine alive
            logger.exception("engine step failed")
            self._last_sampling = None
            return self._fail([s.request.request_id for s in sched.scheduled], repr(e))
        rows = [(g, c, c.request.append_placeholder_token()) for g, c in sampling]
        tensors = [sampled.sampled_token_ids]
        if sampled.logprobs is not None:
            tensors += [sampled.logprobs_token_ids, sampled.logprobs, sampled.ranks]
        return _Step(
            rows=rows,
            host=self.model_runner.to_host(tensors),  # the copies start; nothing waits
            row_of={c.request.request_id: i for i, (_, c, _) in enumerate(rows)},
            sampled=sampled.sampled_token_ids,
            needs_values=self._wants_values(sampling),
            decode_only=decode_only,
            sampler_needs_values=any(_depends_on_tokens(c) for _, c in sampling),
        )
    # --8<-- [end:launch]

    def _batch_entries(self, sched: SchedulerOutput, prev: _Step | None) -> list[BatchEntry]:
        """The runner's entries for a scheduled step."""
        entries = []
        for s in sched.scheduled:
            req = s.request
            # The last token may be step `prev`'s sample, still on the device.
            from_prev = (prev is not None and req.num_unresolved_tokens > 0
                         and s.start_pos + s.num_new_tokens == req.num_tokens)
            entries.append(BatchEntry(
                token_ids=s.token_ids, start_pos=s.start_pos, block_table=s.block_table,
                sample=s.sample, prev_sample_row=prev.row_of[req.request_id] if from_prev else -1,
            ))
        return entries

    # --8<-- [start:sampling_metadata]
    def _sampling_metadata(self, sampling: list[tuple[_Group, _Completion]],
                           device: torch.device) -> SamplingMetadata:
        """The step's sampling metadata: last step's, advanced, when the rows are the same."""
        rows = [c for _, c in sampling]
        last = self._last_sampling
        # The same completions (by identity: an id can come back as a new request)
        # in the same rows as the step launched just before, each of which drew one token.
        same = (last is not None and len(last[0]) == len(rows)
                and all(a is b for a, b in zip(last[0], rows)))
        # A grammar's mask or a bad word's ban moves with every token, even on a
        # step where it happens to mask nothing: such rows are built anew.
        constrained = any(c.grammar is not None or c.request.sampling_params.bad_words_token_ids
                          for c in rows)
        metadata = last[1].next_step() if same and not constrained else None
        if metadata is None:
            start = time.perf_counter()
            metadata = self.sampler.build_metadata(
                [self._sampling_request(c) for _, c in sampling],
                device=device, vocab_size=self.vocab_size, eos_token_ids=self.eos_token_ids,
            )
            if metadata.grammar_bitmask is not None:
                self.stats["structured_output_metadata_s"] += time.perf_counter() - start
        self._last_sampling = (rows, metadata)
        return metadata
    # --8<-- [end:sampling_metadata]

    def _sampling_request(self, c: _Completion) -> SamplingRequest:
        """What the sampler needs to know about a completion's row."""
        r = c.request
        return SamplingRequest(r.sampling_params, c.generator, r.prompt_token_ids,
                               r.output_token_ids, c.noise_key,
                               grammar=c.grammar if c.reasoning_ended else None)

    # --8<-- [start:process]
    def _process(self, step: _Step) -> list[RequestOutput]:
        """Read a launched step's tokens back (the host sync) and record them."""
        t0 = time.perf_counter()
        tensors = step.host.wait()  # the step's one host sync
        now = time.monotonic()
        self.stats["gpu_wait_s"] += time.perf_counter() - t0
        self.stats["num_steps"] += 1
        busy = step.host.gpu_seconds()  # on a GPU: the step's time on it
        if busy is not None:
            self.stats["gpu_busy_s"] += busy
            if step.decode_only:
                self.stats["gpu_busy_decode_s"] += busy
        if not step.rows:
            return []
        logprobs = _LogprobRows(*tensors[1:]) if len(tensors) > 1 else None
        if step.spec is not None:  # several tokens a row (engine/speculative.py)
            return self._record_spec(step, tensors, logprobs, now)
        token_ids = tensors[0].tolist()
        touched: dict[str, _Group] = {}
        skipped = 0
        for row, ((group, c, index), token_id) in enumerate(zip(step.rows, token_ids)):
            if c.finish_reason is not None:  # finished or aborted since it was launched
                skipped += 1
                continue
            c.request.resolve_token(index, token_id)
            if group.first_token_time is None:
                group.first_token_time = now
            self._record_token(c, token_id, index + 1, logprobs, row)
            # A final-only group has one output, once its last completion has finished.
            if not group.final_only or (c.finish_reason is not None and group.finished):
                touched[group.request_id] = group
        self.stats["generation_tokens_total"] += len(step.rows) - skipped
        return [self._make_output(g) for g in touched.values()]
    # --8<-- [end:process]

    def shutdown(self) -> None:
        """Release what the engine started: a tensor-parallel engine's workers (no-op
        otherwise). The engine cannot step afterwards."""
        shutdown = getattr(self.model_runner, "shutdown", None)
        if shutdown is not None:
            shutdown()
        self.input_processor.shutdown()

    def get_stats(self) -> dict:
        """Scheduler and KV-cache statistics plus token counters, JSON-friendly."""
        stats = dict(vars(self.scheduler.get_stats()))
        stats.update(self.stats)
        if self.spec_stats is not None:
            stats.update(self.spec_stats.as_dict())
        return stats


def make_model_runner(engine_config: EngineConfig) -> ModelRunner | Executor:
    """The reference runner, or on a GPU the runner of its fast path (chapter 9);
    with `tensor_parallel_size > 1`, an executor that runs either on every rank
    (Part IV)."""
    if engine_config.parallel_config.tensor_parallel_size > 1:
        from mini_vllm.distributed.executor import make_executor

        return make_executor(engine_config)
    if engine_config.device.type == "cuda":
        from mini_vllm.gpu.model_runner import GPUModelRunner

        return GPUModelRunner(engine_config)
    return ModelRunner(engine_config)


def make_sampler(device: torch.device) -> Sampler:
    """The reference sampler, or on a GPU the fused one (chapter 9)."""
    if device.type == "cuda":
        from mini_vllm.gpu.sampler import FusedSampler

        return FusedSampler()
    return Sampler()


__all__ = ["InputProcessor", "LLMEngine", "ProcessedRequest", "make_model_runner",
           "make_sampler"]
