"""`LLM`: the offline batch API, shaped like vLLM's.

```python
from mini_vllm import LLM, SamplingParams

llm = LLM()  # the embedded tiny model; LLM("./qwen3") for a real checkpoint
outs = llm.generate(["Hello", "The capital of France is"], SamplingParams(max_tokens=32))
print(outs[0].outputs[0].text)
```
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from mini_vllm.config import EngineArgs
from mini_vllm.engine.llm_engine import LLMEngine
from mini_vllm.outputs import RequestOutput
from mini_vllm.sampling_params import RequestOutputKind, SamplingParams

PromptType = str | list[int] | dict


class LLM:
    """Generate completions for a batch of prompts with continuous batching.

    Args:
        model: a Hugging Face checkpoint directory (Qwen3, Llama, Mistral, Qwen2,
            GPT-2, Qwen3-MoE: `models.supported_architectures()`); `None` for the
            embedded tiny model.
        **engine_args: any `EngineArgs` field (`dtype`, `max_num_seqs`,
            `enable_prefix_caching`, `num_gpu_blocks_override`, ...).

    Raises:
        ValueError: for an unknown engine argument or an invalid value.
    """

    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        unknown = set(engine_args) - EngineArgs.field_names()
        if unknown:
            raise ValueError(f"unknown engine argument(s): {sorted(unknown)}")
        self.engine = LLMEngine.from_engine_args(EngineArgs(model=model, **engine_args))
        self._counter = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    # --8<-- [start:generate]
    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in the input order.

        Args:
            prompts: a string, `{"prompt_token_ids": [...]}`, a token-id list,
                or a list of those.
            sampling_params: one for all prompts, or one per prompt
                (default: `SamplingParams()` with the model's defaults).
            use_tqdm: show a progress bar.
            priority: per-prompt priorities (lower runs first).
        """
        if isinstance(prompts, (str, dict)) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(
                    f"sampling_params: got {len(params_list)} for {len(prompts)} prompts"
                )
        priorities = list(priority) if priority is not None else [0] * len(prompts)
        # One output per request, when it finishes: no per-step deltas to build and merge.
        final: dict[int, SamplingParams] = {}  # one copy per distinct params object
        for p in params_list:
            if id(p) not in final:
                final[id(p)] = p.replace(output_kind=RequestOutputKind.FINAL_ONLY)
        params_list = [final[id(p)] for p in params_list]

        ids = []
        try:
            for prompt, params, prio in zip(prompts, params_list, priorities):
                rid = str(next(self._counter))
                self.engine.add_request(rid, prompt, params, priority=prio)
                ids.append(rid)
            return self._run_engine(ids, use_tqdm)
        except BaseException:
            self.engine.abort_request(ids)  # leave the engine clean for the next call
            raise
    # --8<-- [end:generate]

    # --8<-- [start:chat]
    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict | None = None,
    ) -> list[RequestOutput]:
        """Like `generate`, for one conversation or a list of them (chat template applied).

        The rendered text is tokenized without the tokenizer's own special tokens:
        a template that wants a BOS (Llama 3's) writes it itself.

        Raises:
            NoChatTemplateError: the model has no chat template (pass `chat_template=`).
        """
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tok = self.engine.tokenizer
        prompts = []
        for conv in conversations:
            text = tok.apply_chat_template(conv, add_generation_prompt=add_generation_prompt,
                                           **(chat_template_kwargs or {}))
            prompts.append({"prompt": text, "prompt_token_ids": tok.encode(text)})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)
    # --8<-- [end:chat]

    # --8<-- [start:run_engine]
    def _run_engine(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        results: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm or len(ids) < 2)
        while self.engine.has_unfinished_requests():
            for delta in self.engine.step():
                if delta.error is not None:
                    raise RuntimeError(delta.error)
                acc = results.get(delta.request_id)
                if acc is None:
                    results[delta.request_id] = delta
                else:
                    acc.add(delta)
                if delta.finished:
                    bar.update(1)
        bar.close()
        return [results[rid] for rid in ids]
    # --8<-- [end:run_engine]


__all__ = ["LLM"]
