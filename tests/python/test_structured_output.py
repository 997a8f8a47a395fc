"""Structured outputs, token constraints in the sampler, reasoning and tool-call parsers.

Constrained generation is driven token by token through the reference `Sampler`
with logits from two sources: random logits (many rows and seeds, cheap) and
the tiny random-weight Qwen3 checkpoint run by Hugging Face transformers (real
logits, batched). Every output must validate, and end with EOS, not run out.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import jsonschema
import pytest
import torch
import xgrammar as xgr

from mini_vllm.reasoning import Qwen3ReasoningParser
from mini_vllm.sampler import Sampler
from mini_vllm.sampling_metadata import SamplingMetadata, SamplingRequest, make_generator
from mini_vllm.sampling_params import SamplingParams
from mini_vllm.structured_output import (
    GrammarCompileTimeout,
    StructuredOutputGrammar,
    StructuredOutputManager,
    StructuredOutputsParams,
    allocate_token_bitmask,
    apply_token_bitmask,
    fill_bitmasks,
    unpack_bitmask,
)
from mini_vllm.tokenizer import Tokenizer
from mini_vllm.tool_parsers import (
    HermesToolParser,
    tool_call_schema,
    tool_choice_structured_outputs,
)

pytestmark = [
    pytest.mark.structured_output,
    # transformers renames the cache argument across versions; both spellings work here.
    pytest.mark.filterwarnings("ignore:.*past_key_values.*:FutureWarning"),
]

VOCAB = 2368  # the tiny preset's vocab_size; its tokenizer has 2331 tokens, the rest is padding


@pytest.fixture(scope="module")
def tok(tiny_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def manager(tok: Tokenizer):
    m = StructuredOutputManager(tok, VOCAB)
    yield m
    m.shutdown()


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir: Path):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


# ----------------------------------------------------------------------------- helpers


def random_logits(seed: int, scale: float = 4.0) -> Callable:
    """Logits source: fresh Gaussian logits every step (seeded)."""
    gen = torch.Generator().manual_seed(seed)

    def step(outputs: list[list[int]]) -> torch.Tensor:
        return torch.randn(len(outputs), VOCAB, generator=gen) * scale
    return step


class TinyModelLogits:
    """Logits source: the tiny checkpoint, every row continuing the same prompt."""

    def __init__(self, model, prompt: list[int], num_rows: int) -> None:
        self.model, self.past = model, None
        self.pending = torch.tensor([prompt] * num_rows)

    @torch.no_grad()
    def __call__(self, outputs: list[list[int]]) -> torch.Tensor:
        if self.past is not None:  # feed each row's last token (finished rows repeat theirs)
            self.pending = torch.tensor([[o[-1]] for o in outputs])
        out = self.model(input_ids=self.pending, past_key_values=self.past, use_cache=True)
        self.past = out.past_key_values
        return out.logits[:, -1, :].float()


def generate(rows: Sequence[tuple[StructuredOutputGrammar | None, SamplingParams]],
             logits_fn: Callable, eos: Sequence[int], max_steps: int = 400) -> list[list[int]]:
    """Sample every row token by token through the reference sampler until EOS.

    A constrained row's grammar must accept every token the sampler draws.
    Tensors this small run fastest on one thread (and do not fight other
    processes for the cores).
    """
    torch.set_num_threads(1)
    sampler = Sampler()
    gens = [make_generator(p.seed, "cpu") if p.seed is not None else None for _, p in rows]
    outs: list[list[int]] = [[] for _ in rows]
    done = [False] * len(rows)
    for _ in range(max_steps):
        live = [i for i in range(len(rows)) if not done[i]]
        if not live:
            break
        logits = logits_fn(outs)[live]
        reqs = [SamplingRequest(rows[i][1], gens[i], [], outs[i], None, rows[i][0]) for i in live]
        meta = SamplingMetadata.build(reqs, "cpu", VOCAB, eos_token_ids=eos)
        for i, t in zip(live, sampler(logits, meta).sampled_token_ids.tolist()):
            if rows[i][0] is not None:
                assert rows[i][0].accept_token(t), f"row {i}: the sampler drew forbidden token {t}"
            outs[i].append(t)
            done[i] = t in eos
    return outs


def finished_text(tok: Tokenizer, ids: list[int]) -> str:
    """The text before the final EOS; the output must have ended with one."""
    assert ids and ids[-1] in tok.eos_token_ids, "the output ran out of steps before EOS"
    return tok.decode(ids[:-1])


SCHEMAS = [
    pytest.param({"type": "object", "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 10},
        "address": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 8},
            "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"]}},
        "required": ["name", "address"]}, id="nested-object"),
    pytest.param({"type": "object", "properties": {
        "scores": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 100},
                   "minItems": 2, "maxItems": 4}},
        "required": ["scores"]}, id="bounded-array"),
    pytest.param({"type": "object", "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "size": {"type": "string", "enum": ["S", "M", "L"]},
        "flag": {"const": True}},
        "required": ["color", "size", "flag"]}, id="enums"),
    pytest.param({"type": "object", "properties": {
        "x": {"type": "number", "minimum": -2.5, "maximum": 2.5},
        "n": {"type": "integer", "exclusiveMinimum": -3, "exclusiveMaximum": 3}},
        "required": ["x", "n"]}, id="number-ranges"),
    pytest.param({"type": "object", "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 999},
        "note": {"type": "string", "maxLength": 5},
        "ok": {"type": "boolean"}},
        "required": ["id"]}, id="optional-fields"),
    pytest.param({"type": "array", "minItems": 1, "maxItems": 3, "items": {
        "type": "object", "properties": {
            "k": {"type": "string", "maxLength": 3},
            "v": {"type": ["integer", "null"], "minimum": 0, "maximum": 9}},
        "required": ["k", "v"]}}, id="array-of-objects"),
    pytest.param({"anyOf": [{"type": "integer", "minimum": 0, "maximum": 50},
                            {"type": "string", "maxLength": 4}]}, id="any-of"),
    pytest.param({"$defs": {"pt": {"type": "object", "properties": {
        "x": {"type": "integer", "minimum": 0, "maximum": 9},
        "y": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["x", "y"]}},
        "type": "object", "properties": {"a": {"$ref": "#/$defs/pt"}, "b": {"$ref": "#/$defs/pt"}},
        "required": ["a", "b"]}, id="refs"),
]


# ----------------------------------------------------------------------------- params


@pytest.mark.parametrize(("kwargs", "field"), [
    ({}, "exactly one"),
    ({"json": {"type": "object"}, "regex": "a"}, "exactly one"),
    ({"json": "{not json"}, "structured_outputs.json"),
    ({"json": "[1, 2]"}, "structured_outputs.json"),
    ({"json_object": "yes"}, "structured_outputs.json_object"),
    ({"regex": ""}, "structured_outputs.regex"),
    ({"choice": []}, "structured_outputs.choice"),
    ({"choice": ["a", 3]}, "structured_outputs.choice"),
    ({"choice": "ab"}, "structured_outputs.choice"),
    ({"grammar": 5}, "structured_outputs.grammar"),
    ({"regex": "a", "disable_any_whitespace": 1}, "disable_any_whitespace"),
])
def test_params_validation_names_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=re.escape(field)):
        StructuredOutputsParams(**kwargs)


def test_params_key_is_canonical_and_keeps_property_order() -> None:
    a = StructuredOutputsParams(json={"type": "object", "properties": {"b": {}, "a": {}}})
    b = StructuredOutputsParams(json='{ "type" : "object",\n "properties": {"b": {}, "a": {}} }')
    assert a.key == b.key and a.kind == "json"
    assert a.json.index('"b"') < a.json.index('"a"')  # never sorted: order is output order
    assert a.key != StructuredOutputsParams(json=a.json, disable_any_whitespace=True).key
    assert StructuredOutputsParams(choice=["x", "y"]).key != StructuredOutputsParams(
        choice=["y", "x"]).key
    with pytest.raises(ValueError, match="unknown field"):
        StructuredOutputsParams.from_dict({"regex": "a", "schema": {}})
    assert StructuredOutputsParams.from_dict({"choice": ("a", "b")}).choice == ["a", "b"]


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"logit_bias": {5: 101}}, "logit_bias[5]"),
    ({"logit_bias": {5: "x"}}, "logit_bias[5]"),
    ({"logit_bias": {"five": 1}}, "logit_bias"),
    ({"logit_bias": {-1: 1}}, "logit_bias"),
    ({"logit_bias": [1, 2]}, "logit_bias"),
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"allowed_token_ids": [1, -2]}, "allowed_token_ids"),
    ({"allowed_token_ids": [1.5]}, "allowed_token_ids"),
    ({"bad_words": ["ok", ""]}, "bad_words"),
    ({"bad_words": ["  "]}, "bad_words"),
    ({"bad_words": [3]}, "bad_words"),
    ({"bad_words_token_ids": [[1], []]}, "bad_words_token_ids"),
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt_logprobs": -1}, "prompt_logprobs"),
    ({"structured_outputs": "json"}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "bogus": 1}}, "structured_outputs"),
])
def test_sampling_params_token_controls_validation(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=re.escape(field)):
        SamplingParams(**kwargs)


def test_sampling_params_token_controls_normalise(tok: Tokenizer) -> None:
    p = SamplingParams(logit_bias={"12": 5, 7: -100.0}, allowed_token_ids=(3, 4),
                       bad_words="hello", prompt_logprobs=2,
                       structured_outputs={"regex": "[ab]+"})
    assert p.logit_bias == {12: 5.0, 7: -100.0}
    assert p.allowed_token_ids == [3, 4] and p.bad_words == ["hello"]
    assert p.structured_outputs == StructuredOutputsParams(regex="[ab]+")
    p.check_token_ids(VOCAB)
    with pytest.raises(ValueError, match=f"logit_bias: token id {VOCAB}"):
        p.replace(logit_bias={VOCAB: 1}).check_token_ids(VOCAB)
    with pytest.raises(ValueError, match="allowed_token_ids: token id"):
        p.replace(allowed_token_ids=[1, VOCAB + 3]).check_token_ids(VOCAB)
    # bad words: the plain and the spaced encodings, kept through later replaces
    encoded = p.update_from_tokenizer(tok)
    assert tok.encode("hello") in encoded.bad_words_token_ids
    spaced = tok.encode(" hello")
    assert (spaced in encoded.bad_words_token_ids) == (
        spaced[0] != tok.encode("hello")[0] and len(spaced) == len(tok.encode("hello")))
    assert encoded.replace(max_tokens=5).bad_words_token_ids == encoded.bad_words_token_ids
    assert SamplingParams().update_from_tokenizer(tok).bad_words_token_ids is None


# ----------------------------------------------------------------------------- tokenizer info


def test_tokenizer_info_bytes_specials_and_padding(tok: Tokenizer, manager) -> None:
    info = manager.tokenizer_info
    assert info.vocab_size == tok.vocab_size  # padding ids are not xgrammar's business
    vocab = info.decoded_vocab
    for i in range(0, 2305, 7):  # ordinary tokens: the bytes the tokenizer decodes them to
        text = tok.decode([i])
        if "\ufffd" not in text:
            assert vocab[i] == text.encode("utf-8"), i
    assert vocab[tok.token_to_id("<tool_call>")] == b"<tool_call>"  # added, not special
    special = set(info.special_token_ids)
    assert tok.token_to_id("<|im_start|>") in special  # never inside constrained text
    assert set(info.stop_token_ids) == set(tok.eos_token_ids)
    assert not set(tok.eos_token_ids) & special
    # The bitmask still covers the model's vocabulary; padding ids are never allowed,
    # on one row or many (the threaded fill), wherever the grammar is.
    compiled = manager.compile(StructuredOutputsParams(regex="[\\s\\S]*"))  # any text
    grammars = [manager.new_grammar(compiled) for _ in range(40)]
    bitmask = allocate_token_bitmask(40, VOCAB)
    fill_bitmasks(grammars, bitmask)
    allowed = unpack_bitmask(bitmask, VOCAB)
    assert not allowed[:, tok.vocab_size:].any()
    assert allowed[:, :tok.vocab_size].sum(dim=1).min() > tok.vocab_size // 2
    one = allocate_token_bitmask(3, VOCAB)
    grammars[0].fill_bitmask(one, 2)
    assert torch.equal(one[2], bitmask[0]) and (one[:2] == -1).all()


# ----------------------------------------------------------------------------- bitmask


@pytest.mark.parametrize("vocab", [VOCAB, 70, 64])
def test_apply_token_bitmask_matches_xgrammar_and_leaves_other_rows(vocab: int) -> None:
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(6, vocab, generator=gen)
    rows = torch.tensor([4, 1, 2])
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, (vocab + 31) // 32), generator=gen,
                            dtype=torch.int64).to(torch.int32)
    ours = apply_token_bitmask(logits, rows, bitmask)
    theirs = logits.clone()
    full = torch.full((6, bitmask.shape[1]), -1, dtype=torch.int32)
    full[rows] = bitmask
    xgr.apply_token_bitmask_inplace(theirs, full, vocab_size=vocab, indices=rows.tolist())
    assert torch.equal(ours, theirs)
    assert torch.equal(ours[[0, 3, 5]], logits[[0, 3, 5]])  # unconstrained rows: bit for bit
    assert torch.isinf(ours).any()
    allowed = unpack_bitmask(bitmask, vocab)
    for r, row in enumerate(rows.tolist()):  # bit j of word k is id 32k + j
        for token in (0, 31, 32, vocab - 1):
            bit = (int(bitmask[r, token // 32]) >> (token % 32)) & 1
            assert bool(allowed[r, token]) == bool(bit)
            assert torch.isfinite(ours[row, token]) == bool(bit)
    with pytest.raises(ValueError, match="bitmask must be"):
        apply_token_bitmask(logits, rows, bitmask[:, :-1])


@pytest.mark.gpu
def test_apply_token_bitmask_on_cuda_matches_cpu() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(8, VOCAB, generator=gen)
    rows = torch.tensor([0, 5, 7])
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, (VOCAB + 31) // 32), generator=gen,
                            dtype=torch.int64).to(torch.int32)
    cpu = apply_token_bitmask(logits, rows, bitmask)
    cuda = apply_token_bitmask(logits.cuda(), rows.cuda(), bitmask.cuda())
    assert torch.equal(cuda.cpu(), cpu)


# ----------------------------------------------------------------------------- matcher


def test_eos_only_where_the_grammar_may_end(tok: Tokenizer, manager) -> None:
    eos = tok.eos_token_ids
    g = manager.new_grammar(manager.compile(StructuredOutputsParams(
        json={"type": "object", "properties": {"a": {"type": "string", "maxLength": 3}},
              "required": ["a"]}, disable_any_whitespace=True)))
    bitmask = allocate_token_bitmask(1, VOCAB)
    never = [tok.token_to_id("<|im_start|>"), *range(tok.vocab_size, VOCAB)]
    for token in tok.encode('{"a": "x"}'):
        g.fill_bitmask(bitmask, 0)
        allowed = unpack_bitmask(bitmask, VOCAB)[0]
        assert not g.is_completed()
        assert not allowed[eos].any(), "EOS allowed before the grammar can end"
        assert not allowed[never].any(), "a special or padding id allowed"
        assert allowed[token]
        assert g.accept_token(token)
    g.fill_bitmask(bitmask, 0)
    allowed = unpack_bitmask(bitmask, VOCAB)[0]
    assert g.is_completed() and allowed[eos].all() and allowed.sum() == len(eos)
    assert g.accept_token(eos[0]) and g.is_terminated()
    assert not g.accept_token(tok.encode("x")[0])


def test_accept_rollback_validate(tok: Tokenizer, manager) -> None:
    g = manager.new_grammar(manager.compile(StructuredOutputsParams(regex="ab+c")))
    a, b, c = (tok.encode(ch)[0] for ch in "abc")
    assert not g.accept_token(b) and g.num_accepted == 0  # refused: no change
    assert g.accept_tokens([a, b, b]) and g.num_accepted == 3
    assert not g.accept_tokens([b, a, c]) and g.num_accepted == 3  # all or nothing
    assert g.validate_tokens([b, c, a, c]) == 2 and g.num_accepted == 3  # state unchanged
    g.rollback(2)
    assert g.num_accepted == 1 and not g.accept_token(c) and g.accept_token(b)
    with pytest.raises(ValueError, match="rollback"):
        g.rollback(5)
    g.reset()
    assert g.num_accepted == 0 and g.accept_token(a)
    # a request's own stop tokens end it only where the grammar may end
    stop = tok.encode("z")[0]
    g2 = manager.new_grammar(manager.compile(StructuredOutputsParams(regex="ab")),
                             stop_token_ids=[stop])
    assert not g2.accept_token(stop) and g2.accept_tokens([a, b]) and g2.accept_token(stop)
    assert g2.is_terminated()


def test_invalid_specs_are_value_errors_that_say_why(manager) -> None:
    cases = [
        (StructuredOutputsParams(json={"type": "foo"}), r"structured_outputs\.json: .*foo"),
        (StructuredOutputsParams(json={"type": "object", "properties": {"a": {"$ref": "#/x"}}}),
         r"structured_outputs\.json: "),
        (StructuredOutputsParams(regex="a(b"), r"structured_outputs\.regex: .*parenthesis"),
        (StructuredOutputsParams(regex="(?<=a)b"), r"structured_outputs\.regex: .*ookbehind"),
        (StructuredOutputsParams(grammar='root ::= foo'), r"structured_outputs\.grammar: .*foo"),
        (StructuredOutputsParams(grammar='start ::= "a"'), r"structured_outputs\.grammar: .*root"),
        (StructuredOutputsParams(structural_tag={"type": "structural_tag", "format": {
            "type": "nope"}}), r"structured_outputs\.structural_tag: "),
    ]
    for params, pattern in cases:
        with pytest.raises(ValueError, match=pattern) as info:
            manager.compile(params)
        assert "/project/" not in str(info.value) and ".cc:" not in str(info.value)
        with pytest.raises(ValueError, match=pattern):  # cached: refused again, same reason
            manager.compile(params)


# ----------------------------------------------------------------------------- constrained


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schemas_always_validate_random_logits(tok: Tokenizer, manager,
                                                    temperature: float) -> None:
    schemas = [p.values[0] for p in SCHEMAS]
    rows = []
    for seed in range(3):
        for schema in schemas:
            so = StructuredOutputsParams(json=schema, disable_any_whitespace=seed == 2)
            rows.append((manager.new_grammar(manager.compile(so)),
                         SamplingParams(temperature=temperature, seed=seed)))
    rows.append((None, SamplingParams(temperature=temperature)))  # a free row in the batch
    outs = generate(rows, random_logits(int(temperature * 10)), tok.eos_token_ids)
    for (_, _), ids, schema in zip(rows, outs, schemas * 3):
        text = finished_text(tok, ids)
        jsonschema.validate(json.loads(text), schema)
    compact = [finished_text(tok, ids) for ids in outs[2 * len(schemas):3 * len(schemas)]]
    for text in compact:  # disable_any_whitespace: exactly json.dumps' layout
        assert text == json.dumps(json.loads(text), ensure_ascii=False)


def test_json_object_regex_choice_grammar_random_logits(tok: Tokenizer, manager) -> None:
    quote, close = tok.encode('"')[0], tok.encode("}")[0]
    choices = ['a "q"', "back\\slash", "naïve 😀", "new\nline", "x"]
    grammar = 'root ::= expr\nexpr ::= term ("+" term)*\nterm ::= [0-9] | "(" expr ")"'
    kinds = [
        (StructuredOutputsParams(json_object=True), lambda t: isinstance(json.loads(t), dict)),
        (StructuredOutputsParams(regex=r"[a-c]{2,5}-\d{3}"),
         lambda t: re.fullmatch(r"[a-c]{2,5}-\d{3}", t) is not None),
        (StructuredOutputsParams(choice=choices), lambda t: t in choices),
        (StructuredOutputsParams(grammar=grammar),
         lambda t: re.fullmatch(r"[0-9()+]+", t) is not None and isinstance(eval(t), int)),
    ]
    rows = []
    for seed in range(8):
        for so, _ in kinds:
            # a logit_bias on '"' and '}' keeps any-JSON objects short
            bias = {quote: 6.0, close: 6.0} if so.json_object else None
            rows.append((manager.new_grammar(manager.compile(so)),
                         SamplingParams(temperature=1.0, seed=seed, logit_bias=bias)))
    outs = generate(rows, random_logits(7), tok.eos_token_ids, max_steps=600)
    seen_choices = set()
    for i, ids in enumerate(outs):
        text = finished_text(tok, ids)
        assert kinds[i % len(kinds)][1](text), (kinds[i % len(kinds)][0].kind, text)
        if kinds[i % len(kinds)][0].choice:
            seen_choices.add(text)
    assert len(seen_choices) >= 3  # the draw is not stuck on one choice


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_tiny_model_outputs_validate(tok: Tokenizer, manager, hf_model,
                                     temperature: float) -> None:
    schemas = [p.values[0] for p in SCHEMAS if p.id in (
        "nested-object", "bounded-array", "enums", "optional-fields", "array-of-objects",
        "refs")]
    specs = [StructuredOutputsParams(json=s) for s in schemas] + [
        StructuredOutputsParams(regex=r"(yes|no), [0-9]{2}"),
        StructuredOutputsParams(choice=["Paris", "Rome", "Berlin"])]
    n = 2  # two completions per spec (different seeds), plus one free row
    rows = [(manager.new_grammar(manager.compile(so)),
             SamplingParams(temperature=temperature, seed=i))
            for so in specs for i in range(n)]
    rows.append((None, SamplingParams(temperature=temperature, seed=99)))
    prompt = tok.apply_chat_template([{"role": "user", "content": "Answer in JSON."}],
                                     add_generation_prompt=True, tokenize=True,
                                     enable_thinking=False)
    outs = generate(rows, TinyModelLogits(hf_model, prompt, len(rows)), tok.eos_token_ids,
                    max_steps=300)
    for k, ids in enumerate(outs[:-1]):
        text = finished_text(tok, ids)
        spec = specs[k // n]
        if spec.json is not None:
            jsonschema.validate(json.loads(text), json.loads(spec.json))
        elif spec.regex is not None:
            assert re.fullmatch(spec.regex, text), text
        else:
            assert text in spec.choice


# ----------------------------------------------------------------------------- the sampler


def meta_of(rows: list[SamplingRequest], eos: Sequence[int] = ()) -> SamplingMetadata:
    return SamplingMetadata.build(rows, "cpu", VOCAB, eos_token_ids=eos)


def req(params: SamplingParams, output: Sequence[int] = (), grammar=None) -> SamplingRequest:
    return SamplingRequest(params, None, [], list(output), None, grammar)


def test_constraint_stages_touch_only_their_rows(tok: Tokenizer, manager) -> None:
    g = manager.new_grammar(manager.compile(StructuredOutputsParams(regex="[0-9]+")))
    plain = SamplingParams(temperature=1.0)
    rows = [req(plain), req(plain.replace(allowed_token_ids=[5, 6])), req(plain),
            req(plain.replace(logit_bias={9: 3.0})), req(plain, grammar=g),
            req(plain.replace(bad_words=["x"]).update_from_tokenizer(tok)), req(plain)]
    meta = meta_of(rows)
    assert meta.constrains_tokens
    logits = torch.randn(7, VOCAB)
    out = Sampler.apply_token_constraints(logits, meta)
    for i in (0, 2, 6):
        assert torch.equal(out[i], logits[i])  # bit for bit
    assert set(torch.isfinite(out[1]).nonzero().flatten().tolist()) == {5, 6}
    assert out[3, 9] == logits[3, 9] + 3.0
    assert torch.equal(out[3, :9], logits[3, :9]) and torch.equal(out[3, 10:], logits[3, 10:])
    digits = {tok.encode(str(d))[0] for d in range(10)}
    assert digits <= set(torch.isfinite(out[4]).nonzero().flatten().tolist())
    assert not torch.isfinite(out[4, tok.encode("a")[0]])
    assert out[5, tok.encode("x")[0]] == -torch.inf
    # no constraint: nothing built, the fused GPU path stays open
    free = meta_of([req(plain)] * 3)
    assert not free.constrains_tokens and free.grammar_bitmask is None
    assert free.logit_bias is None and free.bad_words_index is None


def test_logit_bias_forces_and_bans() -> None:
    logits = torch.zeros(3, VOCAB)
    logits[:, 7] = 5.0
    rows = [req(SamplingParams(temperature=0.0, logit_bias={11: 100})),
            req(SamplingParams(temperature=0.0, logit_bias={7: -100})),
            req(SamplingParams(temperature=0.0))]
    ids = Sampler()(logits, meta_of(rows)).sampled_token_ids.tolist()
    assert ids[0] == 11 and ids[1] != 7 and ids[2] == 7


def test_allowed_token_ids_sample_only_inside_the_set() -> None:
    allowed = [3, 40, 41, 2000]
    rows = [req(SamplingParams(temperature=1.0, allowed_token_ids=allowed))] * 64
    meta = meta_of(rows)
    drawn = set()
    for _ in range(5):
        drawn |= set(Sampler()(torch.randn(64, VOCAB) * 3, meta).sampled_token_ids.tolist())
    assert drawn <= set(allowed) and len(drawn) == len(allowed)


def test_bad_words_ban_the_last_token_after_the_rest(tok: Tokenizer) -> None:
    word = "hello world"  # several tokens
    params = SamplingParams(temperature=0.0, bad_words=[word, "a"]).update_from_tokenizer(tok)
    seqs = params.bad_words_token_ids
    multi = next(s for s in seqs if len(s) > 1)
    single = [s[0] for s in seqs if len(s) == 1]
    logits = torch.zeros(3, VOCAB)
    logits[:, multi[-1]] = 10.0  # the model wants to finish the bad word
    logits[:, single] = 20.0
    rows = [req(params, output=[1, *multi[:-1]]),  # the rest of the word was just written
            req(params, output=[1, *multi[:-2]]) if len(multi) > 2 else req(params, output=[1]),
            req(SamplingParams(temperature=0.0), output=multi[:-1])]
    meta = meta_of(rows)
    ids = Sampler()(logits, meta).sampled_token_ids.tolist()
    assert ids[0] not in (multi[-1], *single)  # both banned here
    assert ids[1] == multi[-1]  # the word is not about to be completed: its last token is fine
    assert ids[2] in single  # no bad words on this row
    with pytest.raises(ValueError, match="update_from_tokenizer"):
        meta_of([req(SamplingParams(bad_words=["x"]))])


def test_grammar_and_bad_words_rebuild_the_next_step(tok: Tokenizer, manager) -> None:
    g = manager.new_grammar(manager.compile(StructuredOutputsParams(regex="[0-9]+")))
    from mini_vllm.gpu.sampler import FusedSamplingMetadata

    def reusable(row: SamplingRequest) -> bool:
        meta = FusedSamplingMetadata(**vars(meta_of([row])))  # the fused sampler's, as on a GPU
        meta.noise_seeds, meta.keyed = torch.zeros(1, 2, dtype=torch.int64), True
        return meta.next_step() is not None

    assert not reusable(req(SamplingParams(), grammar=g))  # the bitmask moves with the grammar
    assert not reusable(req(SamplingParams(bad_words=["x"]).update_from_tokenizer(tok)))
    assert reusable(req(SamplingParams(logit_bias={3: 1.0}, allowed_token_ids=[3, 4])))
    with pytest.raises(ValueError, match="grammar covers"):
        other = StructuredOutputManager(tok, VOCAB + 32)
        try:
            g2 = other.new_grammar(other.compile(StructuredOutputsParams(regex="a")))
        finally:
            other.shutdown()
        meta_of([req(SamplingParams(), grammar=g2)])


# ----------------------------------------------------------------------------- compiling


def test_cache_returns_the_same_future_and_evicts_lru(tok: Tokenizer) -> None:
    m = StructuredOutputManager(tok, VOCAB, cache_size=2)
    try:
        a, b, c = (StructuredOutputsParams(regex=r) for r in ("a+", "b+", "c+"))
        fa = m.submit(a)
        assert m.submit(StructuredOutputsParams(regex="a+")) is fa
        fb = m.submit(b)
        assert m.submit(a) is fa  # a is now the most recently used
        m.submit(c)  # evicts b
        assert m.submit(a) is fa and m.submit(b) is not fb
        assert m.compile(a) is fa.result()
    finally:
        m.shutdown()
    with pytest.raises(ValueError, match="max_workers"):
        StructuredOutputManager(tok, VOCAB, max_workers=0)


def slow_choice() -> StructuredOutputsParams:
    """A grammar that takes about a second or more to compile (20,000 alternatives)."""
    rng = random.Random(0)
    return StructuredOutputsParams(choice=[
        "".join(rng.choice("abcdefghij") for _ in range(12)) for _ in range(20_000)])


def test_compile_timeout_refuses_and_remembers(tok: Tokenizer) -> None:
    m = StructuredOutputManager(tok, VOCAB, max_workers=2, compile_timeout_s=0.2)
    try:
        slow = slow_choice()
        t0 = time.monotonic()
        with pytest.raises(GrammarCompileTimeout, match=r"choice: .*within 0\.2 s"):
            m.compile(slow)
        assert time.monotonic() - t0 < 2.0  # refused at the bound, not when it finished
        # the second worker still serves other grammars meanwhile
        assert m.compile(StructuredOutputsParams(regex="ok")) is not None
        t0 = time.monotonic()
        with pytest.raises(GrammarCompileTimeout):
            m.compile(slow)  # remembered: refused at once, no second compile
        assert time.monotonic() - t0 < 0.1
    finally:
        m.shutdown()


def test_timeout_in_the_queue_is_not_remembered(tok: Tokenizer) -> None:
    m = StructuredOutputManager(tok, VOCAB, max_workers=1, compile_timeout_s=0.3)
    try:
        slow = m.submit(slow_choice())  # occupies the only worker
        fast = StructuredOutputsParams(regex="queued")
        with pytest.raises(GrammarCompileTimeout):
            m.compile(fast)  # waited behind the slow one
        with pytest.raises(GrammarCompileTimeout):
            slow.result()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # once the worker is free, it compiles
            try:
                m.compile(fast)
                break
            except GrammarCompileTimeout:
                time.sleep(0.2)
        else:
            pytest.fail("the queued grammar never compiled")
    finally:
        m.shutdown()


def test_compile_async_does_not_block_the_event_loop(tok: Tokenizer) -> None:
    m = StructuredOutputManager(tok, VOCAB, compile_timeout_s=60)

    async def main() -> tuple[int, float]:
        ticks = 0
        done = asyncio.Event()

        async def heartbeat() -> None:
            nonlocal ticks
            while not done.is_set():
                ticks += 1
                await asyncio.sleep(0.01)

        beat = asyncio.create_task(heartbeat())
        t0 = time.monotonic()
        await m.compile_async(slow_choice())
        elapsed = time.monotonic() - t0
        done.set()
        await beat
        return ticks, elapsed

    try:
        ticks, elapsed = asyncio.run(main())
    finally:
        m.shutdown()
    assert elapsed > 0.2 and ticks >= elapsed / 0.01 * 0.3  # the loop ran throughout


def test_compiles_run_in_parallel_with_the_caller(tok: Tokenizer) -> None:
    m = StructuredOutputManager(tok, VOCAB, compile_timeout_s=60)
    try:
        future = m.submit(slow_choice())
        assert not future.done()  # submit returned before the compile finished
        assert threading.current_thread() is threading.main_thread()
        assert future.result(timeout=60) is not None
    finally:
        m.shutdown()


# ----------------------------------------------------------------------------- reasoning


REASONING_CASES = [
    ("<think>\nThe user asks.\n</think>\n\nParis.", ("The user asks.", "Paris.")),
    ("Paris.", (None, "Paris.")),
    ("  <think>x</think>y", ("x", "y")),
    ("<think>\nnever closed because max_tokens", ("never closed because max_tokens", None)),
    ("<think>\n\n</think>\n\n", (None, None)),
    ("<thinking> is not the tag", (None, "<thinking> is not the tag")),
    ("an answer that mentions </think> later", (None, "an answer that mentions </think> later")),
    ("<think>a\n</thin\nk> still thinking</think>\n\nc\n", ("a\n</thin\nk> still thinking", "c\n")),
    ("", (None, None)),
]


def split_feed(feed: Callable[[str], object], finish: Callable[[], object], text: str,
               seed: int) -> list:
    rng = random.Random(seed)
    deltas, i = [], 0
    while i < len(text):
        j = i + rng.randint(1, 4)
        deltas.append(feed(text[i:j]))
        i = j
    deltas.append(finish())
    return deltas


@pytest.mark.parametrize(("text", "expected"), REASONING_CASES)
def test_reasoning_whole_and_streamed(text: str, expected: tuple) -> None:
    assert Qwen3ReasoningParser().extract_reasoning(text) == expected
    for seed in range(30):
        p = Qwen3ReasoningParser()
        deltas = split_feed(p.extract_reasoning_streaming, p.finish_streaming, text, seed)
        reasoning = "".join(d.reasoning for d in deltas)
        content = "".join(d.content for d in deltas)
        assert (reasoning or None, content or None) == expected, seed
        # no piece of a tag ever leaks into either part
        for d in deltas:
            assert "<think>" not in d.reasoning and "</think>" not in d.reasoning


def test_reasoning_tag_split_across_token_pieces() -> None:
    p = Qwen3ReasoningParser()
    pieces = ["<", "thi", "nk>\nI", " think", "\n", "</", "think", ">\n", "\nDone"]
    got = [(d.reasoning, d.content) for d in map(p.extract_reasoning_streaming, pieces)]
    assert got == [("", ""), ("", ""), ("I", ""), (" think", ""), ("", ""), ("", ""), ("", ""),
                   ("", ""), ("", "Done")]
    assert not p.finish_streaming()


def test_reasoning_switches(tok: Tokenizer) -> None:
    off = Qwen3ReasoningParser(enable_thinking=False)
    assert off.extract_reasoning("<think>a</think>b") == (None, "<think>a</think>b")
    prompt = "<|im_start|>assistant\n<think>\n"
    assert Qwen3ReasoningParser.prompt_ends_in_reasoning(prompt)
    rendered = tok.apply_chat_template([{"role": "user", "content": "q"}],
                                       add_generation_prompt=True, enable_thinking=False)
    assert not Qwen3ReasoningParser.prompt_ends_in_reasoning(rendered)
    opened = Qwen3ReasoningParser(prompt_opens_reasoning=True)
    assert opened.extract_reasoning("\nhmm\n</think>\n\nok") == ("hmm", "ok")
    assert opened.extract_reasoning("still going") == ("still going", None)


def test_reasoning_end_on_token_ids(tok: Tokenizer) -> None:
    p = Qwen3ReasoningParser(tok)
    think, end = tok.token_to_id("<think>"), tok.token_to_id("</think>")
    nl, word = tok.encode("\n")[0], tok.encode("hi")
    assert not p.is_reasoning_end([])
    assert not p.is_reasoning_end([nl])  # undecided
    assert not p.is_reasoning_end([think, *word])  # thinking
    assert p.is_reasoning_end([think, *word, end])
    assert p.extract_content_ids([think, *word, end, nl, *word]) == [nl, *word]
    assert p.is_reasoning_end(word) and p.extract_content_ids(word) == word  # no think block
    assert p.extract_content_ids([think, *word]) == []
    assert Qwen3ReasoningParser(tok, enable_thinking=False).is_reasoning_end([])
    opened = Qwen3ReasoningParser(tok, prompt_opens_reasoning=True)
    assert not opened.is_reasoning_end(word) and opened.is_reasoning_end([*word, end])
    with pytest.raises(ValueError, match="tokenizer"):
        Qwen3ReasoningParser().is_reasoning_end([1])


# ----------------------------------------------------------------------------- tool calls


def collect_stream(deltas: list) -> tuple[str, list[dict]]:
    """Join streamed deltas as an OpenAI client does: content, and calls by index."""
    content, calls = "", {}
    for d in deltas:
        content += d.content
        for tc in d.tool_calls:
            c = calls.setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
            if tc.id is not None:
                assert c["id"] is None, "a call's id is sent once"
                c["id"] = tc.id
            if tc.name is not None:
                c["name"] = tc.name
            c["arguments"] += tc.arguments
    return content, [calls[i] for i in sorted(calls)]


TOOL_TEXTS = [
    (('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa\\"ris}", '
      '"days": [1, {"x": 2}]}}\n</tool_call>\n<tool_call>\n{"name": "add", "arguments": {}}\n'
      "</tool_call>"),
     "Let me check.", [("get_weather", '{"city": "Pa\\"ris}", "days": [1, {"x": 2}]}'),
                       ("add", "{}")]),
    ('<tool_call>{"arguments": {"a": 1}, "name": "f"}</tool_call>', None, [("f", '{"a": 1}')]),
    ('<tool_call>\n{"name": "f", "arguments": "{\\"a\\": 1}"}\n</tool_call>', None,
     [("f", '{"a": 1}')]),
    ('<tool_call>\n{"name": "f", "arguments": {"a": [1, 2]}}', None, [("f", '{"a": [1, 2]}')]),
]


@pytest.mark.parametrize(("text", "content", "calls"), TOOL_TEXTS)
def test_hermes_whole_and_streamed(text: str, content: str | None, calls: list) -> None:
    whole = HermesToolParser().extract_tool_calls(text)
    assert whole.tools_called and whole.content == content
    assert [(c.name, c.arguments) for c in whole.tool_calls] == calls
    for c in whole.tool_calls:
        assert c.id.startswith("chatcmpl-tool-") and json.loads(c.arguments) is not None
        assert c.to_openai()["function"] == {"name": c.name, "arguments": c.arguments}
    assert len({c.id for c in whole.tool_calls}) == len(calls)
    for seed in range(40):
        p = HermesToolParser()
        deltas = split_feed(p.extract_tool_calls_streaming, p.finish_streaming, text, seed)
        streamed_content, streamed = collect_stream(deltas)
        assert (streamed_content or None) == content
        assert [(c["name"], c["arguments"]) for c in streamed] == calls
        assert all(c["id"] for c in streamed) and p.tools_called
        for d in deltas:  # no tag text ever leaks into content
            assert "<tool_call" not in d.content and "tool_call>" not in d.content


def test_hermes_streams_arguments_before_the_call_closes() -> None:
    p = HermesToolParser()
    first = p.extract_tool_calls_streaming('<tool_call>\n{"name": "f", "arguments": {"a"')
    assert [tc.to_openai() for tc in first.tool_calls] == [{
        "index": 0, "id": first.tool_calls[0].id, "type": "function",
        "function": {"name": "f", "arguments": '{"a"'}}]
    more = p.extract_tool_calls_streaming(': "}"}}\n</tool_')
    assert [tc.to_openai() for tc in more.tool_calls] == [
        {"index": 0, "function": {"arguments": ': "}"}'}}]  # a brace in a string is text
    assert not p.extract_tool_calls_streaming("call>\n")
    assert not p.finish_streaming()


@pytest.mark.parametrize("text", [
    "Just an answer, no tools.\n",
    "Hello <tool_c there",
    "x <tool_call>not json</tool_call> y",
    '<tool_call>\n{"name": "f", "arguments": {"a": 1',  # cut off
    '<tool_call>\n{"arguments": {}}\n</tool_call>',  # no name
])
def test_hermes_text_without_valid_calls_is_content(text: str) -> None:
    whole = HermesToolParser().extract_tool_calls(text)
    assert not whole.tools_called and whole.tool_calls == [] and whole.content == text
    if "<tool_call>" not in text:
        p = HermesToolParser()
        deltas = split_feed(p.extract_tool_calls_streaming, p.finish_streaming, text, 0)
        assert collect_stream(deltas) == (text, []) and not p.tools_called


def test_chat_template_renders_what_the_parser_reads(tok: Tokenizer) -> None:
    calls = [{"type": "function", "function": {"name": "get_weather",
                                               "arguments": {"city": "Paris", "n": [1, 2]}}},
             {"type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}]
    text = tok.apply_chat_template([{"role": "user", "content": "q"},
                                    {"role": "assistant", "content": "Sure.",
                                     "tool_calls": calls}], tools=TOOLS)
    assert "# Tools" in text and json.dumps(TOOLS[0], ensure_ascii=False) in text
    turn = text.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    reasoning, content = Qwen3ReasoningParser().extract_reasoning(turn)  # the server's order
    assert reasoning is None  # the template's empty think block
    parsed = HermesToolParser().extract_tool_calls(content)
    assert parsed.content == "Sure."
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [
        ("get_weather", {"city": "Paris", "n": [1, 2]}), ("add", {"a": 1})]
    tool_turn = tok.apply_chat_template([{"role": "user", "content": "q"},
                                         {"role": "tool", "content": "18C"},
                                         {"role": "tool", "content": "3"}])
    assert tool_turn.endswith("<|im_start|>user\n<tool_response>\n18C\n</tool_response>\n"
                              "<tool_response>\n3\n</tool_response><|im_end|>\n")


# ----------------------------------------------------------------------------- tool_choice


TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 8},
            "unit": {"enum": ["C", "F"]}}, "required": ["city", "unit"]}}},
    {"type": "function", "function": {
        "name": "add", "parameters": {"type": "object", "properties": {
            "a": {"type": "integer", "minimum": 0, "maximum": 99},
            "b": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["a", "b"]}}},
    {"type": "function", "function": {"name": "ping"}},  # no parameters
]


def test_tool_choice_validation() -> None:
    assert tool_choice_structured_outputs(TOOLS, "auto") is None
    assert tool_choice_structured_outputs(TOOLS, "none") is None
    assert tool_choice_structured_outputs(TOOLS, None) is None
    for tools, choice, field in [
        ([], "required", "tools"),
        ([{"type": "function", "function": {"name": ""}}], "required", "tools[0].function.name"),
        ([{"type": "retrieval"}], "required", "tools[0]"),
        ([{"function": {"name": "f", "parameters": 3}}], "required", "parameters"),
        (TOOLS, "sometimes", "tool_choice"),
        (TOOLS, {"type": "function", "function": {"name": "nope"}}, "tool_choice"),
        (TOOLS, {"type": "function"}, "tool_choice"),
    ]:
        with pytest.raises(ValueError, match=re.escape(field)):
            tool_choice_structured_outputs(tools, choice)
    one = tool_call_schema(TOOLS, {"type": "function", "function": {"name": "add"}})
    assert one["properties"]["name"] == {"const": "add"}
    assert len(tool_call_schema(TOOLS, "required")["anyOf"]) == 3


def check_calls(text: str, named: str | None) -> list:
    parsed = HermesToolParser().extract_tool_calls(text)
    assert parsed.tools_called and parsed.content is None, text
    by_name = {t["function"]["name"]: t["function"] for t in TOOLS}
    for call in parsed.tool_calls:
        schema = by_name[call.name].get("parameters", {"type": "object", "properties": {}})
        jsonschema.validate(json.loads(call.arguments), schema)
    if named is not None:
        assert [c.name for c in parsed.tool_calls] == [named]
    return parsed.tool_calls


@pytest.mark.parametrize("choice", ["required", "required-one", "add", "get_weather"])
def test_forced_tool_calls_always_parse_random_logits(tok: Tokenizer, manager, choice) -> None:
    one = choice != "required"
    tool_choice = choice if choice == "required" else {"type": "function",
                                                       "function": {"name": choice}}
    if choice == "required-one":
        tool_choice = "required"
    so = tool_choice_structured_outputs(TOOLS, tool_choice, parallel_tool_calls=not one)
    rows = [(manager.new_grammar(manager.compile(so)),
             SamplingParams(temperature=t, seed=s)) for t in (0.0, 1.0) for s in range(6)]
    outs = generate(rows, random_logits(3), tok.eos_token_ids, max_steps=600)
    names, counts = set(), set()
    for ids in outs:
        text = finished_text(tok, ids)
        calls = check_calls(text, choice if choice in ("add", "get_weather") else None)
        names |= {c.name for c in calls}
        counts.add(len(calls))
        # streamed the same way, the client sees the same calls
        p = HermesToolParser()
        deltas = split_feed(p.extract_tool_calls_streaming, p.finish_streaming, text, 1)
        assert [(c["name"], json.loads(c["arguments"])) for c in collect_stream(deltas)[1]] == [
            (c.name, json.loads(c.arguments)) for c in HermesToolParser().extract_tool_calls(
                text).tool_calls]
    if choice.startswith("required"):
        assert len(names) >= 2  # not always the same tool
    assert counts == {1} if one else max(counts) > 1


def test_forced_tool_calls_tiny_model(tok: Tokenizer, manager, hf_model) -> None:
    so = tool_choice_structured_outputs(TOOLS, "required", parallel_tool_calls=False)
    rows = [(manager.new_grammar(manager.compile(so)), SamplingParams(temperature=t, seed=s))
            for t, s in ((0.0, 0), (1.0, 1), (1.0, 2), (1.0, 3))]
    prompt = tok.apply_chat_template([{"role": "user", "content": "Weather in Paris?"}],
                                     tools=TOOLS, add_generation_prompt=True, tokenize=True,
                                     enable_thinking=False)
    outs = generate(rows, TinyModelLogits(hf_model, prompt, len(rows)), tok.eos_token_ids,
                    max_steps=400)
    for ids in outs:
        check_calls(finished_text(tok, ids), None)


# ----------------------------------------------------------------------------- the engine on a GPU


@pytest.mark.gpu
def test_gpu_engine_constrained_rows_validate(tiny_model_dir: Path) -> None:
    """The GPU path (fused sampler, async scheduling, CUDA graphs) with constrained and
    free rows in one batch: every constrained output validates, at temperature 0 and 1."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from mini_vllm import LLM

    llm = LLM(str(tiny_model_dir), max_model_len=1024, device="cuda")
    assert llm.engine.async_scheduling
    schemas = [p.values[0] for p in SCHEMAS for _ in (0.0, 1.0)]
    params = [SamplingParams(temperature=t, seed=i, max_tokens=450, n=2,
                             structured_outputs={"json": p.values[0]})
              for i, p in enumerate(SCHEMAS) for t in (0.0, 1.0)]
    params += [SamplingParams(temperature=1.0, seed=99, max_tokens=200, ignore_eos=True)] * 4
    outs = llm.generate(["Reply:"] * len(params), params, use_tqdm=False)
    for out, schema in zip(outs, schemas):
        for c in out.outputs:
            assert c.finish_reason == "stop", c.text
            jsonschema.validate(json.loads(c.text), schema)
    assert all(len(o.outputs[0].token_ids) == 200 for o in outs[len(schemas):])
    assert llm.engine.get_stats()["structured_output_tokens_total"] > 0
