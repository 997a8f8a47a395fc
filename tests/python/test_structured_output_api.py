"""Structured outputs, tool calls and reasoning through the engine and the OpenAI server.

The engine runs the tiny random-weight checkpoint: whatever its weights, a
constrained output must validate. The server tests talk to a real uvicorn
server with the official `openai` client (raw `httpx` for the error cases);
the reasoning tests use the trained default model, which opens every answer
with an empty `<think>` block, and the tiny model forced to write the tags.
"""

from __future__ import annotations

import json
import random
import re
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from server_thread import serving
from test_structured_output import SCHEMAS  # the schemas the sampler-level tests use

from mini_vllm import LLM, SamplingParams
from mini_vllm.config import EngineArgs
from mini_vllm.engine.async_engine import AsyncLLM
from mini_vllm.engine.llm_engine import LLMEngine
from mini_vllm.entrypoints.args import FrontendArgs
from mini_vllm.entrypoints.openai_server import build_app
from mini_vllm.reasoning import Qwen3ReasoningParser
from mini_vllm.tokenizer import Tokenizer

pytestmark = pytest.mark.structured_output

MODEL = "tiny-test"
MAX_MODEL_LEN = 512
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
SCHEMA_LIST = [(p.id, p.values[0]) for p in SCHEMAS]

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"enum": ["C", "F"]}}, "required": ["city", "unit"]}}}
ADD = {"type": "function", "function": {
    "name": "add", "parameters": {"type": "object", "properties": {
        "a": {"type": "integer", "minimum": 0, "maximum": 99},
        "b": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["a", "b"]}}}
TOOLS = [WEATHER, ADD]
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def slow_choice(seed: int) -> dict[str, list[str]]:
    """A `choice` of 20,000 strings: about a second or more to compile."""
    rng = random.Random(seed)
    return {"choice": ["".join(rng.choice("abcdefghij") for _ in range(12))
                       for _ in range(20_000)]}


# ============================================================================ the engine


@pytest.fixture(scope="module")
def tok(tiny_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_pretrained(tiny_model_dir)


def _llm(model_dir: Path, **kwargs: Any) -> LLM:
    args = {"max_model_len": MAX_MODEL_LEN, "num_gpu_blocks_override": 256, **kwargs}
    return LLM(str(model_dir), **args)


def _check_json(text: str, schema: dict) -> None:
    jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_llm_generate_mixed_batch(tiny_model_dir: Path, async_scheduling: bool) -> None:
    """Constrained rows of every kind, with n > 1, beside free rows in one batch: the
    constrained outputs validate, and async scheduling gives the same tokens."""
    llm = _llm(tiny_model_dir, async_scheduling=async_scheduling)
    schema = dict(SCHEMA_LIST)["nested-object"]
    specs = [{"json": schema}, {"regex": r"[a-e]{2,6}-[0-9]{3}"},
             {"choice": ["yes", "no", "maybe"]}, {"grammar": 'root ::= "(" [0-9] [0-9]? [0-9]? ")"'},
             None, None]
    params = [SamplingParams(temperature=1.0, seed=10 + i, max_tokens=400, n=3,
                             structured_outputs=spec) for i, spec in enumerate(specs)]
    outs = llm.generate(["Reply:"] * len(specs), params, use_tqdm=False)
    for spec, out in zip(specs, outs):
        assert len(out.outputs) == 3
        for c in out.outputs:
            if spec is None:
                assert c.token_ids  # free rows ran too
                continue
            assert c.finish_reason == "stop", (spec, c.text)
            if "json" in spec:
                _check_json(c.text, schema)
            elif "regex" in spec:
                assert re.fullmatch(spec["regex"], c.text), c.text
            elif "choice" in spec:
                assert c.text in spec["choice"]
            else:
                assert re.fullmatch(r"\([0-9]{1,3}\)", c.text), c.text
    stats = llm.engine.get_stats()
    assert stats["structured_output_tokens_total"] > 0
    if async_scheduling:
        ref = _llm(tiny_model_dir, async_scheduling=False).generate(
            ["Reply:"] * len(specs), params, use_tqdm=False)
        assert [[c.token_ids for c in o.outputs] for o in outs] == \
               [[c.token_ids for c in o.outputs] for o in ref]


def test_async_reads_grammar_rows_back_during_the_next_forward(tiny_model_dir: Path) -> None:
    """With async scheduling a constrained step is read back after the next step's
    forward is queued and before that step's mask is built."""
    llm = _llm(tiny_model_dir, async_scheduling=True)
    engine, events = llm.engine, []
    execute, process, metadata = (engine.model_runner.execute, engine._process,
                                  engine._sampling_metadata)
    engine.model_runner.execute = lambda *a, **k: (events.append("forward"), execute(*a, **k))[1]
    engine._process = lambda step: (events.append("read"), process(step))[1]
    engine._sampling_metadata = lambda *a: (events.append("mask"), metadata(*a))[1]
    out = llm.generate("x", SamplingParams(max_tokens=8,
                                           structured_outputs={"regex": "[a-z]{80}"}),
                       use_tqdm=False)
    assert re.fullmatch("[a-z]+", out[0].outputs[0].text)
    # f(orward), r(ead back), m(ask): every read but the last comes between the next
    # step's forward and its mask.
    order = "".join(e[0] for e in events)
    assert re.fullmatch(r"fm(frm){5,}(fr)?r?", order), order


def test_llm_invalid_spec_is_a_value_error(tiny_model_dir: Path) -> None:
    llm = _llm(tiny_model_dir)
    with pytest.raises(ValueError, match=r"structured_outputs\.regex: invalid regular"):
        llm.generate("x", SamplingParams(structured_outputs={"regex": "(a"}), use_tqdm=False)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        llm.generate("x", SamplingParams(prompt_logprobs=2), use_tqdm=False)
    with pytest.raises(ValueError, match="allowed_token_ids: token id 99999"):
        llm.generate("x", SamplingParams(allowed_token_ids=[1, 99999]), use_tqdm=False)
    out = llm.generate("x", SamplingParams(max_tokens=4, structured_outputs={"choice": ["ok"]}),
                       use_tqdm=False)
    assert out[0].outputs[0].text == "ok"  # the engine goes on


def test_prefix_caching_and_preemption_keep_the_grammar(tiny_model_dir: Path) -> None:
    """A cache too small for the batch preempts (and recomputes) constrained requests
    that share a cached prefix; their matchers depend only on the output, so every
    output still validates."""
    llm = _llm(tiny_model_dir, num_gpu_blocks_override=24, block_size=16, max_num_seqs=16)
    schema = {"type": "array", "minItems": 6, "maxItems": 8,
              "items": {"type": "integer", "minimum": 100, "maximum": 999}}
    prefix = "The numbers of the day, in order, without a word more: " * 4
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=200,
                            structured_outputs={"json": schema})
    outs = llm.generate([prefix + str(i) for i in range(12)], params, use_tqdm=False)
    for out in outs:
        assert out.outputs[0].finish_reason == "stop"
        _check_json(out.outputs[0].text, schema)
    stats = llm.engine.get_stats()
    assert stats["num_preemptions"] > 0
    assert stats["prefix_cache_hits"] > 0


def test_min_tokens_does_not_apply_to_a_grammar(tiny_model_dir: Path) -> None:
    llm = _llm(tiny_model_dir)
    out = llm.generate("x", SamplingParams(min_tokens=20, max_tokens=30,
                                           structured_outputs={"choice": ["yes", "no"]}),
                       use_tqdm=False)[0].outputs[0]
    assert out.text in ("yes", "no") and out.finish_reason == "stop"


def test_token_controls_through_the_engine(tiny_model_dir: Path, tok: Tokenizer) -> None:
    llm = _llm(tiny_model_dir)
    a, b, x = (tok.encode(s)[0] for s in ("a", "b", "x"))
    allowed = llm.generate("x", SamplingParams(temperature=1.0, seed=1, max_tokens=30,
                                               allowed_token_ids=[a, b]), use_tqdm=False)
    assert set(allowed[0].outputs[0].token_ids) <= {a, b}
    banned = llm.generate("x", SamplingParams(temperature=1.0, seed=1, max_tokens=30,
                                              allowed_token_ids=[a, b], bad_words=["b"]),
                          use_tqdm=False)
    assert set(banned[0].outputs[0].token_ids) == {a}
    forced = llm.generate("x", SamplingParams(temperature=1.0, seed=1, max_tokens=10,
                                              logit_bias={x: 100}), use_tqdm=False)
    assert forced[0].outputs[0].token_ids == [x] * 10


# ---------------------------------------------------------------------------- held requests


def _run(engine: LLMEngine, timeout: float = 60.0) -> dict[str, Any]:
    """Step until the engine is idle; the final output of each request."""
    finals: dict[str, Any] = {}
    deadline = time.monotonic() + timeout
    while engine.has_unfinished_requests():
        assert time.monotonic() < deadline, "the engine did not finish"
        for out in engine.step():
            acc = finals.get(out.request_id)
            if acc is None:
                finals[out.request_id] = out
            else:
                acc.add(out)
    return finals


@pytest.fixture
def engine(tiny_model_dir: Path) -> Iterator[LLMEngine]:
    e = LLMEngine(EngineArgs(model=str(tiny_model_dir), max_model_len=MAX_MODEL_LEN,
                             num_gpu_blocks_override=128).create_engine_config())
    yield e
    e.shutdown()


def test_request_waits_for_its_grammar(engine: LLMEngine) -> None:
    """A request whose grammar is still compiling is held out of the scheduler while
    a free request runs; it joins once compiled. One aborted while held just ends."""
    slow = SamplingParams(max_tokens=20, structured_outputs=slow_choice(1))
    engine.add_processed_request(engine.process_inputs("held", "x", slow))
    engine.add_processed_request(engine.process_inputs(
        "aborted", "x", SamplingParams(max_tokens=20, structured_outputs=slow_choice(2))))
    engine.add_request("free", "x", SamplingParams(max_tokens=3))
    assert set(engine._compiling) == {"held", "aborted"}
    assert set(engine.scheduler.requests) == {"free"}
    aborted = engine.abort_request(["aborted"])
    assert aborted[0].finished and aborted[0].outputs[0].finish_reason == "abort"
    finals = _run(engine)
    assert finals["held"].outputs[0].text in slow.structured_outputs.choice
    assert finals["free"].outputs[0].finish_reason == "length"
    assert not engine._compiling and not engine.scheduler.requests


def test_a_grammar_that_fails_while_held_fails_its_request(engine: LLMEngine) -> None:
    engine.structured_output_manager.compile_timeout_s = 0.05
    engine.add_processed_request(engine.process_inputs(
        "slow", "x", SamplingParams(max_tokens=5, structured_outputs=slow_choice(3))))
    finals = _run(engine)
    assert "did not compile within" in finals["slow"].error
    assert finals["slow"].outputs[0].finish_reason == "error"


def test_a_refused_token_fails_only_its_request(engine: LLMEngine) -> None:
    """A matcher that refuses the sampled token (a bug) ends that request with an
    error; the rest of the batch goes on."""
    engine.add_request("bad", "x", SamplingParams(
        max_tokens=20, structured_outputs={"regex": "[a-z]+"}))
    engine.add_request("ok", "x", SamplingParams(max_tokens=5))
    engine._children["bad"][1].grammar.accept_token = lambda token_id: False
    finals = _run(engine)
    assert "broke the request's grammar" in finals["bad"].error
    assert finals["ok"].error is None and finals["ok"].outputs[0].finish_reason == "length"


# ---------------------------------------------------------------------------- reasoning


def test_starts_in_reasoning(tok: Tokenizer) -> None:
    parser = Qwen3ReasoningParser(tok)
    msgs = [{"role": "user", "content": "hi"}]
    thinking = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    off = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True,
                                  enable_thinking=False)
    assert parser.starts_in_reasoning(thinking)
    assert not parser.starts_in_reasoning(off)
    assert parser.starts_in_reasoning(tok.encode("Question: why?<think>\nBecause"))
    assert not parser.starts_in_reasoning(tok.encode("<think>a</think>Once upon a time"))
    assert not parser.starts_in_reasoning(tok.encode("Once upon a time"))


def test_grammar_applies_after_the_reasoning_default_model() -> None:
    """The trained default model opens its answers with `<think>\\n\\n</think>`: with a
    reasoning parser the grammar constrains what follows; with thinking off, or
    without a parser, it constrains the whole output."""
    schema = {"type": "object", "properties": {
        "answer": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["answer"]}
    msgs = [{"role": "user", "content": "What is 2 + 3?"}]
    params = SamplingParams(temperature=0, max_tokens=200, structured_outputs={"json": schema})
    llm = LLM(reasoning_parser="qwen3", max_model_len=MAX_MODEL_LEN)
    free = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=60), use_tqdm=False)
    assert free[0].outputs[0].text.startswith("<think>\n\n</think>")
    text = llm.chat(msgs, params, use_tqdm=False)[0].outputs[0].text
    reasoning, content = Qwen3ReasoningParser().extract_reasoning(text)
    assert text.startswith("<think>") and reasoning is None
    _check_json(content, schema)
    off = llm.chat(msgs, params, use_tqdm=False, chat_template_kwargs={"enable_thinking": False})
    _check_json(off[0].outputs[0].text, schema)
    plain = LLM(max_model_len=MAX_MODEL_LEN).chat(msgs, params, use_tqdm=False)
    _check_json(plain[0].outputs[0].text, schema)  # no parser: from the first token


# ============================================================================ the server


@dataclass
class Server:
    base_url: str
    engine: AsyncLLM
    client: openai.OpenAI
    http: httpx.Client

    def post(self, path: str, body: dict[str, Any]) -> httpx.Response:
        return self.http.post(self.base_url + path, json={"model": MODEL, **body})


@contextmanager
def _serve(model_dir: Path | None, args: FrontendArgs, **engine_args: Any) -> Iterator[Server]:
    engine = AsyncLLM(EngineArgs(
        model=None if model_dir is None else str(model_dir), max_model_len=1024,
        num_gpu_blocks_override=400, max_num_seqs=64, **engine_args).create_engine_config())
    app = build_app(engine, served_model_name=MODEL, args=args)
    with serving(app, args, start_timeout=60) as port:
        base = f"http://127.0.0.1:{port}"
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0,
                               timeout=120)
        with httpx.Client(timeout=120) as http:
            yield Server(base, engine, client, http)


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path) -> Iterator[Server]:
    """The tiny model, with `--reasoning-parser qwen3 --enable-auto-tool-choice
    --tool-call-parser hermes`, its engine on a thread."""
    with _serve(tiny_model_dir, FrontendArgs(enable_auto_tool_choice=True,
                                             tool_call_parser="hermes"),
                reasoning_parser="qwen3", engine_process=False) as s:
        yield s


@pytest.fixture(scope="module")
def process_server(tiny_model_dir: Path) -> Iterator[Server]:
    """The tiny model with no tool or reasoning flags, its engine in a process of its own."""
    with _serve(tiny_model_dir, FrontendArgs(), engine_process=True) as s:
        yield s


def _chat(server: Server, stream: bool, **kwargs: Any) -> list[dict[str, Any]]:
    """Each choice of a chat answer as `{content, reasoning, tool_calls, finish_reason}`,
    joined from the stream's deltas when streamed."""
    kwargs.setdefault("messages", [{"role": "user", "content": "Answer in the format asked."}])
    if not stream:
        response = server.client.chat.completions.create(model=MODEL, **kwargs)
        out = []
        for choice in sorted(response.choices, key=lambda c: c.index):
            m = choice.message
            assert (m.model_extra or {}).get("reasoning_content") == \
                   (m.model_extra or {}).get("reasoning")
            out.append({"content": m.content, "reasoning": (m.model_extra or {}).get("reasoning"),
                        "tool_calls": [{"id": c.id, "name": c.function.name,
                                        "arguments": c.function.arguments}
                                       for c in m.tool_calls or []],
                        "finish_reason": choice.finish_reason})
        return out
    n = kwargs.get("n", 1)
    parts: list[dict[str, Any]] = [{"content": "", "reasoning": "", "calls": {},
                                    "finish_reason": None} for _ in range(n)]
    for chunk in server.client.chat.completions.create(model=MODEL, stream=True, **kwargs):
        for choice in chunk.choices:
            part, delta = parts[choice.index], choice.delta
            assert part["finish_reason"] is None, "a delta after the finish"
            part["content"] += delta.content or ""
            part["reasoning"] += (delta.model_extra or {}).get("reasoning") or ""
            for call in delta.tool_calls or []:
                if call.index not in part["calls"]:  # its first piece has the id and name
                    assert call.id and call.function.name
                    part["calls"][call.index] = {"id": call.id, "name": call.function.name,
                                                 "arguments": ""}
                part["calls"][call.index]["arguments"] += call.function.arguments or ""
            part["finish_reason"] = choice.finish_reason
    return [{"content": p["content"] or None, "reasoning": p["reasoning"] or None,
             "tool_calls": [p["calls"][i] for i in sorted(p["calls"])],
             "finish_reason": p["finish_reason"]} for p in parts]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_response_format_json_schema(server: Server, temperature: float, stream: bool) -> None:
    """Every schema, n = 2, sent at once: each choice validates."""
    def ask(item: tuple[str, dict]) -> list[dict]:
        name, schema = item
        return _chat(server, stream, n=2, temperature=temperature, seed=5, max_tokens=450,
                     response_format={"type": "json_schema",
                                      "json_schema": {"name": name, "schema": schema,
                                                      "strict": True}},
                     extra_body=NO_THINKING)
    with ThreadPoolExecutor(len(SCHEMA_LIST)) as pool:
        answers = list(pool.map(ask, SCHEMA_LIST))
    for (name, schema), choices in zip(SCHEMA_LIST, answers):
        assert len(choices) == 2
        for c in choices:
            assert c["finish_reason"] == "stop", (name, c)
            _check_json(c["content"], schema)


@pytest.mark.parametrize("stream", [False, True])
def test_structured_outputs_kinds(server: Server, stream: bool) -> None:
    """vLLM's `structured_outputs` (regex, choice, grammar) and `json_object`, on chat
    and on completions."""
    regex, choices = r"(red|blue)-[0-9]{2,4}", ["a \"quoted\" one", "new\nline", "😀"]
    cases = [({"regex": regex}, lambda t: re.fullmatch(regex, t)),
             ({"choice": choices}, lambda t: t in choices),
             ({"grammar": 'root ::= num " + " num (" + " num)?\nnum ::= [1-9] [0-9]?'},
              lambda t: re.fullmatch(r"[1-9][0-9]?( \+ [1-9][0-9]?){1,2}", t))]
    for spec, ok in cases:
        chat = _chat(server, stream, n=2, temperature=1.0, seed=2, max_tokens=100,
                     extra_body={"structured_outputs": spec, **NO_THINKING})
        assert all(c["finish_reason"] == "stop" and ok(c["content"]) for c in chat), chat
        texts = _complete(server, stream, prompt="Say it:", n=2, temperature=1.0, seed=2,
                          max_tokens=100, extra_body={"structured_outputs": spec})
        assert all(ok(t) for t in texts), texts
    # Any object: the random model fills its strings until max_tokens, so only the
    # start is certain; whatever finishes is an object.
    objects = _chat(server, stream, n=4, temperature=1.0, seed=4, max_tokens=100,
                    response_format={"type": "json_object"}, extra_body=NO_THINKING)
    for c in objects:
        assert c["content"].startswith("{")
        if c["finish_reason"] == "stop":
            assert isinstance(json.loads(c["content"]), dict)


def _complete(server: Server, stream: bool, **kwargs: Any) -> list[str]:
    if not stream:
        response = server.client.completions.create(model=MODEL, **kwargs)
        assert all(c.finish_reason == "stop" for c in response.choices)
        return [c.text for c in sorted(response.choices, key=lambda c: c.index)]
    texts = [""] * kwargs.get("n", 1)
    for chunk in server.client.completions.create(model=MODEL, stream=True, **kwargs):
        for c in chunk.choices:
            texts[c.index] += c.text
    return texts


def _check_calls(calls: list[dict], named: str | None) -> None:
    assert calls, "no tool call"
    for call in calls:
        assert call["id"].startswith("chatcmpl-tool-")
        assert call["name"] == named if named else call["name"] in PARAMETERS
        jsonschema.validate(json.loads(call["arguments"]), PARAMETERS[call["name"]])


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(("tool_choice", "parallel"), [
    ("required", True), ("required", False),
    ({"type": "function", "function": {"name": "add"}}, True)])
def test_forced_tool_calls(server: Server, tool_choice: Any, parallel: bool,
                           stream: bool) -> None:
    """`required` and a named function force well-formed calls out of random weights:
    ids, names and arguments that validate against the tool's parameters,
    `content` None and `finish_reason` "tool_calls", streamed as OpenAI's deltas."""
    named = tool_choice["function"]["name"] if isinstance(tool_choice, dict) else None
    choices = _chat(server, stream, n=2, temperature=1.0, seed=7, max_tokens=400, tools=TOOLS,
                    tool_choice=tool_choice, parallel_tool_calls=parallel,
                    messages=[{"role": "user", "content": "What is the weather in Oslo?"}],
                    extra_body=NO_THINKING)
    for c in choices:
        assert c["finish_reason"] == "tool_calls", c
        assert c["content"] is None
        _check_calls(c["tool_calls"], named)
        if named or not parallel:
            assert len(c["tool_calls"]) == 1


@pytest.mark.parametrize("stream", [False, True])
def test_auto_tool_choice_parses_what_the_model_wrote(server: Server, stream: bool) -> None:
    """With "auto" the model decides; here a grammar makes it write some text and a
    call, which the hermes parser takes apart."""
    said = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": '
            '{"city": "Oslo", "unit": "C"}}\n</tool_call>')
    choices = _chat(server, stream, tools=TOOLS, max_tokens=100,
                    extra_body={"structured_outputs": {"choice": [said]}, **NO_THINKING})
    c = choices[0]
    assert c["content"] == "Let me look." and c["finish_reason"] == "tool_calls"
    assert [(t["name"], json.loads(t["arguments"])) for t in c["tool_calls"]] == \
           [("get_weather", {"city": "Oslo", "unit": "C"})]


def test_tools_rendered_unless_the_choice_is_none(server: Server) -> None:
    def prompt_tokens(**kwargs: Any) -> int:
        return server.client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=1,
            extra_body=NO_THINKING, **kwargs).usage.prompt_tokens
    plain = prompt_tokens()
    assert prompt_tokens(tools=TOOLS, tool_choice="none") == plain
    assert prompt_tokens(tools=TOOLS) > plain


def test_conversation_with_a_tool_result(server: Server) -> None:
    """An assistant message with `tool_calls` and the `tool` answer go back in."""
    messages = [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call-1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "C"}'}}]},
        {"role": "tool", "tool_call_id": "call-1", "content": "12 degrees"}]
    response = server.client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, max_tokens=4, extra_body=NO_THINKING)
    rendered = server.engine.tokenizer.apply_chat_template(
        messages, tools=TOOLS, add_generation_prompt=True, enable_thinking=False)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"' in rendered
    assert "<tool_response>\n12 degrees\n</tool_response>" in rendered
    assert response.usage.prompt_tokens == len(server.engine.tokenizer.encode(rendered))


@pytest.mark.parametrize("stream", [False, True])
def test_reasoning_split_forced_tags(server: Server, tok: Tokenizer, stream: bool) -> None:
    """Thinking on, the tiny model may only write the tags (made likely) and a few
    letters: each choice's `reasoning` and `content` are what the parser finds in
    the raw text (the same request sent as a completion)."""
    start, end = tok.token_to_id("<think>"), tok.token_to_id("</think>")
    extra = {"allowed_token_ids": [start, end, *(tok.encode(s)[0] for s in ("a", "b", " c"))],
             "logit_bias": {str(start): 6, str(end): 6}}
    msgs = [{"role": "user", "content": "Think first."}]
    common = {"n": 32, "temperature": 1.0, "seed": 11, "max_tokens": 16}
    choices = _chat(server, stream, messages=msgs, extra_body=extra, **common)
    prompt = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    raw = server.client.completions.create(model=MODEL, prompt=prompt, extra_body=extra,
                                           **common)
    parser = Qwen3ReasoningParser()
    expected = [parser.extract_reasoning(c.text)
                for c in sorted(raw.choices, key=lambda c: c.index)]
    assert [(c["reasoning"], c["content"]) for c in choices] == expected
    assert any(r for r, _ in expected) and any(c for _, c in expected)  # both parts occur


@pytest.fixture(scope="module")
def default_server() -> Iterator[Server]:
    """The trained default model with `--reasoning-parser qwen3`."""
    with _serve(None, FrontendArgs(), reasoning_parser="qwen3", engine_process=False) as s:
        yield s


@pytest.mark.parametrize("stream", [False, True])
def test_reasoning_parser_default_model(default_server: Server, stream: bool) -> None:
    """The empty think block the default model writes is not content any more, and a
    JSON schema constrains the answer after it."""
    msgs = [{"role": "user", "content": "What is 2 + 3?"}]
    answer = _chat(default_server, stream, messages=msgs, temperature=0, max_tokens=60)[0]
    assert answer["reasoning"] is None and "5" in answer["content"]
    assert "<think>" not in answer["content"] and not answer["content"].startswith("\n")
    schema = {"type": "object", "properties": {
        "answer": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["answer"]}
    js = _chat(default_server, stream, messages=msgs, temperature=0, max_tokens=200,
               response_format={"type": "json_schema",
                                "json_schema": {"name": "a", "schema": schema}})[0]
    assert js["reasoning"] is None and js["finish_reason"] == "stop"
    _check_json(js["content"], schema)


# ---------------------------------------------------------------------------- errors

_BIG = 10**6
ERRORS = [
    ("chat", {"response_format": {"type": "xml"}}, "response_format"),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format"),
    ("chat", {"response_format": {"type": "json_schema",
                                  "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
     "response_format"),
    ("completions", {"structured_outputs": {"regex": "(a"}}, "structured_outputs"),
    ("completions", {"structured_outputs": {"grammar": "root ::= foo"}}, "structured_outputs"),
    ("completions", {"structured_outputs": {"json": {"type": "object"}, "regex": "a"}},
     "structured_outputs"),
    ("completions", {"structured_outputs": {"jsn": {}}}, "structured_outputs"),
    ("chat", {"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}},
     "structured_outputs"),
    ("chat", {"tool_choice": "required"}, "tool_choice"),
    ("chat", {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ("chat", {"tools": TOOLS, "tool_choice": "required",
              "response_format": {"type": "json_object"}}, "tool_choice"),
    ("chat", {"tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "foo"}}}}}],
        "tool_choice": "required"}, "tools"),
    ("chat", {"tools": []}, "tools"),
    ("completions", {"logit_bias": {"5": 101}}, "logit_bias"),
    ("completions", {"logit_bias": {"five": 1}}, "logit_bias"),
    ("completions", {"logit_bias": {str(_BIG): 1}}, "logit_bias"),
    ("completions", {"allowed_token_ids": [1, _BIG]}, "allowed_token_ids"),
    ("completions", {"allowed_token_ids": []}, "allowed_token_ids"),
    ("completions", {"bad_words": [" "]}, "bad_words"),
    ("completions", {"prompt_logprobs": 1}, "prompt_logprobs"),
    ("completions", {"suffix": "the end"}, "suffix"),
    ("completions", {"best_of": 2}, "best_of"),
    ("completions", {"best_of": 1, "n": 2}, "best_of"),
]


@pytest.mark.parametrize(("endpoint", "body", "param"), ERRORS,
                         ids=[f"{e}-{p}-{i}" for i, (e, _, p) in enumerate(ERRORS)])
def test_bad_requests_are_400_naming_the_field(server: Server, endpoint: str, body: dict,
                                               param: str) -> None:
    if endpoint == "chat":
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **body}
        response = server.post("/v1/chat/completions", body)
    else:
        response = server.post("/v1/completions", {"prompt": "hi", "max_tokens": 4, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    assert error["type"] == "invalid_request_error" and error["message"]


def test_what_changes_nothing_is_accepted(server: Server) -> None:
    ok = server.post("/v1/completions", {"prompt": "hi", "max_tokens": 2, "n": 2, "best_of": 2,
                                         "suffix": "", "response_format": {"type": "text"}})
    assert ok.status_code == 200, ok.text


def test_slow_grammar_is_refused_and_the_server_goes_on(server: Server) -> None:
    manager = server.engine.processor.structured_output_manager
    saved, manager.compile_timeout_s = manager.compile_timeout_s, 0.1
    try:
        response = server.post("/v1/completions", {"prompt": "x", "max_tokens": 4,
                                                   "structured_outputs": slow_choice(9)})
    finally:
        manager.compile_timeout_s = saved
    assert response.status_code == 400, response.text
    assert "did not compile within 0.1 s" in response.json()["error"]["message"]
    assert response.json()["error"]["param"] == "structured_outputs"
    assert server.http.get(server.base_url + "/health").status_code == 200
    again = server.post("/v1/completions", {"prompt": "x", "max_tokens": 4,
                                            "structured_outputs": {"choice": ["fine"]}})
    assert again.status_code == 200 and again.json()["choices"][0]["text"] == "fine"


def test_engine_process_and_auto_tool_choice_flags(process_server: Server) -> None:
    """In process mode the engine compiles its own copy of the grammar; a server
    started without --enable-auto-tool-choice refuses "auto"."""
    schema = dict(SCHEMA_LIST)["array-of-objects"]
    c = _chat(process_server, False, n=2, temperature=1.0, seed=1, max_tokens=450,
              response_format={"type": "json_schema", "json_schema": {"name": "x",
                                                                      "schema": schema}},
              extra_body=NO_THINKING)
    for choice in c:
        _check_json(choice["content"], schema)
    calls = _chat(process_server, True, tools=TOOLS, tool_choice="required", max_tokens=400,
                  parallel_tool_calls=False, extra_body=NO_THINKING)
    _check_calls(calls[0]["tool_calls"], None)
    for body in ({"tools": TOOLS}, {"tools": TOOLS, "tool_choice": "auto"}):
        response = process_server.post("/v1/chat/completions", {
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **body})
        assert response.status_code == 400
        assert response.json()["error"]["param"] == "tool_choice"
    none = process_server.post("/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "tools": TOOLS,
        "tool_choice": "none"})
    assert none.status_code == 200


# ============================================================================ the benchmark


def test_throughput_json_schema_smoke(tiny_model_dir: Path, tmp_path: Path) -> None:
    """`benchmarks/throughput.py --json-schema records` runs the plain and the
    constrained workload in one job; every constrained output token is under the mask."""
    import importlib.util
    import sys

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "throughput.py"
    spec = importlib.util.spec_from_file_location("_so_throughput", path)
    throughput = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = throughput
    spec.loader.exec_module(throughput)
    out = tmp_path / "tp.json"
    throughput.main([
        "--model", str(tiny_model_dir), "--num-requests", "4", "--input-len-range", "8", "24",
        "--max-tokens-range", "8", "12", "--backends", "mini-vllm", "--device", "cpu",
        "--copy-bytes", str(32 * 2**20), "--num-gpu-blocks-override", "64",
        "--json-schema", "records", "--output", str(out)])
    data = json.loads(out.read_text())
    plain, constrained = data["results"]["mini-vllm"], data["results"]["mini-vllm-json"]
    assert plain["status"] == constrained["status"] == "ok", constrained
    assert constrained["output_tokens"] == plain["output_tokens"] == data["workload"][
        "output_tokens"]
    assert constrained["structured_output"]["constrained_fraction"] == 1.0
    assert "structured_output" not in plain
    cost = data["structured_output"]
    assert cost["json_schema"] == "records" and cost["steps"]["constrained"] > 0
    assert cost["output_tok_s_ratio"] == pytest.approx(
        constrained["output_tok_s"] / plain["output_tok_s"])
    with pytest.raises(SystemExit, match="neither a builtin"):
        throughput.main(["--json-schema", str(tmp_path / "missing.json")])
