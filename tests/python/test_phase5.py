"""Phase 5: sampling parameters, the batched sampler and the stop rules."""

from __future__ import annotations

import math
import random

import pytest
import torch

from mini_vllm.sampler import Sampler
from mini_vllm.sampling_metadata import SamplingMetadata, SamplingRequest, make_generator
from mini_vllm.sampling_params import OPENAI_DEFAULTS, SamplingParams
from mini_vllm.stop_checker import StopChecker

pytestmark = pytest.mark.phase5

# Chi-square critical values at significance 1e-4, by degrees of freedom.
CHI2_CRITICAL_1E4 = {1: 15.14, 2: 18.42, 3: 21.11, 4: 23.51, 5: 25.74, 6: 27.86, 7: 29.88}


def row(
    params: SamplingParams,
    prompt: list[int] | tuple = (),
    output: list[int] | tuple = (),
    generator: torch.Generator | None = None,
) -> SamplingRequest:
    return SamplingRequest(params, generator, list(prompt), list(output))


def build(rows: list[SamplingRequest], vocab: int, eos: tuple = (),
          device: str = "cpu") -> SamplingMetadata:
    return SamplingMetadata.build(rows, device, vocab, eos_token_ids=eos)


def kept_sets(logits: torch.Tensor, params: list[SamplingParams]) -> list[set[int]]:
    """The tokens min-p / top-k / top-p leave finite, row by row."""
    meta = build([row(p) for p in params], logits.shape[1])
    out = logits.clone()
    if meta.min_p is not None:
        out = Sampler.apply_min_p(out, meta.min_p)
    if meta.top_k is not None or meta.top_p is not None:
        out = Sampler.apply_top_k_top_p(out, meta)
    return [set(torch.isfinite(r).nonzero().flatten().tolist()) for r in out]


def logits_of(probs: list[float]) -> torch.Tensor:
    return torch.tensor(probs, dtype=torch.float32).log()


# ----------------------------------------------------------------------------- params


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"n": 0}, "n"),
        ({"n": 1.5}, "n"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.01}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"min_p": -0.01}, "min_p"),
        ({"min_p": 1.5}, "min_p"),
        ({"seed": "x"}, "seed"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
        ({"stop": ""}, "stop"),
        ({"stop": ["ok", ""]}, "stop"),
        ({"stop": [3]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"stop_token_ids": ["a"]}, "stop_token_ids"),
        ({"logprobs": -1}, "logprobs"),
        ({"logprobs": 21}, "logprobs"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"ignore_eos": "yes"}, "ignore_eos"),
        ({"include_stop_str_in_output": 1}, "include_stop_str_in_output"),
    ],
)
def test_validation_names_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_valid_edge_values_and_normalisation() -> None:
    p = SamplingParams(temperature=0, top_p=1, top_k=-1, min_p=1, max_tokens=None,
                       min_tokens=3, logprobs=20, presence_penalty=-2, frequency_penalty=2,
                       stop="###", stop_token_ids=(5, 6))
    assert p.stop == ["###"] and p.stop_token_ids == [5, 6]
    assert isinstance(p.temperature, float) and p.is_greedy
    assert SamplingParams(temperature=1e-6).is_greedy
    assert not SamplingParams(temperature=1e-3).is_greedy
    assert not SamplingParams().is_greedy  # unset = the OpenAI default of 1
    assert SamplingParams().stop == [] and SamplingParams().stop_token_ids == []


def test_with_defaults_from_generation_config() -> None:
    gen_cfg = {"temperature": 0.6, "top_k": 20, "top_p": 0.95, "do_sample": True,
               "eos_token_id": [1, 2]}
    p = SamplingParams(top_p=0.5).with_defaults(gen_cfg)
    assert (p.temperature, p.top_k, p.top_p) == (0.6, 20, 0.5)  # the request's top_p wins
    assert p.min_p == 0.0 and p.repetition_penalty == 1.0  # not in the file: OpenAI defaults
    q = SamplingParams().with_defaults(None)
    assert {k: getattr(q, k) for k in OPENAI_DEFAULTS} == dict(OPENAI_DEFAULTS)
    r = SamplingParams(temperature=0).with_defaults({"temperature": 0.7,
                                                     "repetition_penalty": 1.1})
    assert r.temperature == 0.0 and r.repetition_penalty == 1.1
    with pytest.raises(ValueError, match="generation_config.json: top_p"):
        SamplingParams().with_defaults({"top_p": 0})


def test_clone_and_replace() -> None:
    p = SamplingParams(stop=["a"], seed=3)
    c = p.clone()
    assert c == p and c.stop is not p.stop
    assert p.replace(max_tokens=100).max_tokens == 100 and p.max_tokens == 16
    with pytest.raises(ValueError, match="max_tokens"):
        p.replace(max_tokens=0)


# ----------------------------------------------------------------------------- filters


def test_top_k_kept_sets_ties_and_large_k() -> None:
    x = torch.tensor([[3.0, 1.0, 4.0, 1.0, 5.0, 9.0, 2.0, 6.0]] * 5)
    sets = kept_sets(x, [
        SamplingParams(top_k=3),
        SamplingParams(top_k=1),
        SamplingParams(top_k=100),  # larger than the vocabulary: everything
        SamplingParams(top_k=0),  # off
        SamplingParams(top_k=7),
    ])
    # k = 7: the 7th largest is 1, tied with the 8th, so both 1s stay.
    assert sets == [{4, 5, 7}, {5}, set(range(8)), set(range(8)), set(range(8))]
    # Ties at the k-th value are all kept: k = 2 over [1, 2, 2, 2, 0] keeps the three 2s.
    ties = torch.tensor([[1.0, 2.0, 2.0, 2.0, 0.0]] * 2)
    assert kept_sets(ties, [SamplingParams(top_k=2), SamplingParams(top_k=4)]) == [
        {1, 2, 3}, {0, 1, 2, 3}]


def test_top_k_row_without_top_k_is_untouched() -> None:
    x = torch.randn(3, 50)
    meta = build([row(SamplingParams(top_k=5)), row(SamplingParams()),
                  row(SamplingParams(top_k=50))], 50)
    assert meta.max_top_k == 5 and meta.top_p is None
    out = Sampler.apply_top_k_top_p(x, meta)
    assert torch.isfinite(out[0]).sum() == 5
    assert torch.equal(out[1], x[1]) and torch.equal(out[2], x[2])


def test_top_p_kept_sets() -> None:
    x = logits_of([0.1, 0.4, 0.2, 0.3]).repeat(5, 1)
    sets = kept_sets(x, [SamplingParams(top_p=p) for p in (0.01, 0.6, 0.75, 0.95, 1.0)])
    assert sets == [{1}, {1, 3}, {1, 3, 2}, {0, 1, 2, 3}, {0, 1, 2, 3}]
    # Ties at the cut: 0.5 + 0.3 + 0.1 reaches 0.85, and the other 0.1 ties with the last kept.
    tie = logits_of([0.1, 0.5, 0.1, 0.3])[None]
    assert kept_sets(tie, [SamplingParams(top_p=0.85)]) == [{0, 1, 2, 3}]
    assert kept_sets(tie, [SamplingParams(top_p=0.7)]) == [{1, 3}]


def test_top_k_then_top_p_renormalises() -> None:
    # top-k 2 leaves [0.4, 0.3] -> renormalised [4/7, 3/7]; top-p 0.5 then keeps only the first,
    # where top-p 0.5 alone would keep two (0.4 < 0.5).
    x = logits_of([0.4, 0.3, 0.2, 0.1]).repeat(3, 1)
    sets = kept_sets(x, [SamplingParams(top_k=2, top_p=0.5), SamplingParams(top_p=0.5),
                         SamplingParams(top_k=3)])
    assert sets == [{0}, {0, 1}, {0, 1, 2}]


def test_min_p_kept_sets() -> None:
    x = logits_of([0.15, 0.5, 0.1, 0.25]).repeat(4, 1)
    sets = kept_sets(x, [SamplingParams(min_p=m) for m in (0.0, 0.25, 0.45, 0.6)])
    # thresholds: 0, 0.125, 0.225, 0.3 of p_max = 0.5
    assert sets == [{0, 1, 2, 3}, {0, 1, 3}, {1, 3}, {1}]


def test_filters_are_skipped_when_no_random_row_needs_them() -> None:
    meta = build([row(SamplingParams(temperature=0, top_k=3, top_p=0.5, min_p=0.2)),
                  row(SamplingParams(temperature=1.0))], 10)
    assert meta.top_k is None and meta.top_p is None and meta.min_p is None
    assert meta.repetition_penalties is None and meta.output_token_counts is None
    assert meta.min_tokens_index is None and meta.max_num_logprobs is None
    assert not meta.all_greedy and not meta.all_random


# ----------------------------------------------------------------------------- penalties


def test_penalties_match_a_direct_computation() -> None:
    torch.manual_seed(1)
    vocab = 16
    x = torch.randn(4, vocab) * 3
    specs = [
        (SamplingParams(repetition_penalty=1.5), [1, 2, 3], [3, 4, 4]),
        (SamplingParams(presence_penalty=0.7, frequency_penalty=0.3), [5, 6], [6, 7, 7, 7]),
        (SamplingParams(repetition_penalty=0.8, presence_penalty=-0.5,
                        frequency_penalty=1.0), [8], [9, 9, 8]),
        (SamplingParams(), [1, 2], [3, 3]),  # no penalty: unchanged
    ]
    x_before = x.clone()
    meta = build([row(p, prompt, out) for p, prompt, out in specs], vocab)
    got = Sampler.apply_penalties(x, meta)
    assert torch.equal(x, x_before)  # the input is not modified
    expected = x.clone()
    for i, (p, prompt, out) in enumerate(specs):
        rep = p.repetition_penalty or 1.0
        for t in range(vocab):
            v = expected[i, t].item()
            if t in prompt or t in out:  # repetition: prompt + output
                v = v / rep if v > 0 else v * rep
            c = out.count(t)  # frequency / presence: output only
            v -= p.frequency_penalty * c + p.presence_penalty * (c > 0)
            expected[i, t] = v
    torch.testing.assert_close(got, expected)
    assert torch.equal(got[3], x[3])


def test_min_tokens_masks_eos_and_stop_tokens() -> None:
    vocab = 6
    x = torch.tensor([[9.0, 8.0, 7.0, 1.0, 0.0, 0.0]] * 4)
    params = SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[1])
    rows = [
        row(params, output=[4]),  # below min_tokens: EOS 0 and stop token 1 masked
        row(params, output=[4, 4, 4]),  # reached: free
        row(params.replace(ignore_eos=True), output=[4]),  # EOS is a plain token then
        row(SamplingParams(temperature=0), output=[]),
    ]
    out = Sampler()(x, build(rows, vocab, eos=(0,)))
    assert out.sampled_token_ids.tolist() == [2, 0, 0, 0]


# ----------------------------------------------------------------------------- sampling


def test_greedy_rows_are_unaffected_by_other_rows() -> None:
    torch.manual_seed(2)
    vocab = 64
    x = torch.randn(6, vocab)
    greedy = SamplingParams(temperature=0, repetition_penalty=1.3)
    others = [SamplingParams(temperature=1.5, top_k=3), SamplingParams(top_p=0.2, seed=5),
              SamplingParams(min_p=0.3, frequency_penalty=1.0), SamplingParams(temperature=0.7)]
    rows = [row(greedy, [1, 2], [3]), *[row(p, [4], [5, 6]) for p in others],
            row(SamplingParams(temperature=0), [], [])]
    rows[2] = rows[2]._replace(generator=make_generator(5, "cpu"))
    out = Sampler()(x, build(rows, vocab)).sampled_token_ids
    alone = Sampler()(x[:1], build(rows[:1], vocab)).sampled_token_ids
    expected0 = Sampler.apply_penalties(x[:1], build(rows[:1], vocab)).argmax().item()
    assert out[0].item() == alone.item() == expected0
    assert out[5].item() == x[5].argmax().item()


def simulated_logits(key: int, step: int, vocab: int) -> torch.Tensor:
    """Stand-in for a model: the same request and step always give the same logits."""
    return torch.randn(vocab, generator=torch.Generator().manual_seed(10_000 * key + step)) * 2


def decode(requests: list[tuple[int, SamplingParams]], steps: int, vocab: int,
           device: str = "cpu") -> dict[int, list[int]]:
    """Run `steps` decode steps of a batch; each request is (key, params)."""
    gens = {k: make_generator(p.seed, device) if p.seed is not None else None
            for k, p in requests}
    outputs: dict[int, list[int]] = {k: [] for k, _ in requests}
    sampler = Sampler()
    for step in range(steps):
        logits = torch.stack([simulated_logits(k, step, vocab) for k, _ in requests]).to(device)
        meta = SamplingMetadata.build(
            [row(p, [k, k + 1], outputs[k], gens[k]) for k, p in requests], device, vocab)
        for (k, _), t in zip(requests, sampler(logits, meta).sampled_token_ids.tolist()):
            outputs[k].append(t)
    return outputs


def seeded_batch_mixes(device: str) -> None:
    vocab = 1000
    a = SamplingParams(temperature=0.9, top_p=0.95, frequency_penalty=0.5, seed=1234)
    mixes = [
        [(0, a)],
        [(1, SamplingParams(temperature=0)), (0, a), (2, SamplingParams(temperature=1.2))],
        [(3, SamplingParams(top_k=5, seed=7)), (4, SamplingParams(min_p=0.1)),
         (2, SamplingParams()), (0, a), (5, SamplingParams(repetition_penalty=1.2))],
    ]
    results = []
    for i, mix in enumerate(mixes):
        torch.manual_seed(100 + i)  # the shared generator differs between runs
        results.append(decode(mix, steps=12, vocab=vocab, device=device)[0])
    assert results[0] == results[1] == results[2]
    other = decode([(0, a.replace(seed=4321))], steps=12, vocab=vocab, device=device)[0]
    assert other != results[0]


def test_same_seed_same_tokens_whatever_the_batch() -> None:
    seeded_batch_mixes("cpu")


def chi_square_check(params: SamplingParams, logits: torch.Tensor, expected: list[float],
                     draws: int = 20_000) -> None:
    """Sample `draws` rows at once and compare the histogram with `expected`."""
    torch.manual_seed(0)
    vocab = logits.shape[0]
    meta = build([row(params)] * draws, vocab)
    tokens = Sampler()(logits.expand(draws, vocab), meta).sampled_token_ids
    counts = torch.bincount(tokens, minlength=vocab).tolist()
    stat, df = 0.0, -1
    for c, p in zip(counts, expected):
        if p == 0:
            assert c == 0, f"a filtered-out token was drawn {c} times"
        else:
            stat += (c - draws * p) ** 2 / (draws * p)
            df += 1
    assert stat < CHI2_CRITICAL_1E4[df], (counts, expected, stat)


def test_temperature_distribution() -> None:
    x = torch.tensor([2.0, 1.0, 0.0, -1.0, -2.0])
    for t in (0.5, 1.0, 2.0):
        chi_square_check(SamplingParams(temperature=t), x, (x / t).softmax(0).tolist())


def test_top_p_and_min_p_distributions() -> None:
    x = logits_of([0.4, 0.3, 0.2, 0.06, 0.04])
    chi_square_check(SamplingParams(top_p=0.8), x, [4 / 9, 3 / 9, 2 / 9, 0, 0])
    chi_square_check(SamplingParams(min_p=0.3), x, [4 / 9, 3 / 9, 2 / 9, 0, 0])
    chi_square_check(SamplingParams(top_k=2), x, [4 / 7, 3 / 7, 0, 0, 0])
    # Temperature 2 comes first: p -> sqrt(p), i.e. [0.632, 0.548, 0.447, 0.245, 0.2] / 2.07;
    # min_p 0.5 then keeps sqrt(p) >= 0.316: the first three.
    root = [math.sqrt(p) for p in (0.4, 0.3, 0.2)]
    chi_square_check(SamplingParams(temperature=2.0, min_p=0.5), x,
                     [r / sum(root) for r in root] + [0, 0])


def test_seeded_rows_follow_the_distribution() -> None:
    x = torch.tensor([1.0, 0.0, -1.0])
    draws = 3000
    rows = [row(SamplingParams(seed=s), generator=make_generator(s, "cpu")) for s in range(draws)]
    tokens = Sampler()(x.expand(draws, 3), build(rows, 3)).sampled_token_ids
    counts = torch.bincount(tokens, minlength=3).tolist()
    expected = (x.softmax(0) * draws).tolist()
    stat = sum((c - e) ** 2 / e for c, e in zip(counts, expected))
    assert stat < CHI2_CRITICAL_1E4[2], counts


def test_logprobs_sorted_ranks_and_processed_values() -> None:
    torch.manual_seed(3)
    vocab = 40
    x = torch.randn(4, vocab) * 2
    rows = [
        row(SamplingParams(temperature=0.5, logprobs=5, top_k=3)),
        row(SamplingParams(temperature=0, logprobs=2)),
        row(SamplingParams(temperature=1.0, logprobs=0, presence_penalty=1.0), output=[7, 8]),
        row(SamplingParams(temperature=2.0)),  # asked for none
    ]
    meta = build(rows, vocab)
    out = Sampler()(x, meta)
    assert out.logprobs.shape == (4, 6) and out.logprobs_token_ids.shape == (4, 6)
    processed = Sampler.apply_penalties(x, meta) / torch.tensor([[0.5], [1.0], [1.0], [2.0]])
    reference = processed.log_softmax(dim=1)
    for i in range(4):
        tok = out.sampled_token_ids[i].item()
        assert out.logprobs_token_ids[i, 0].item() == tok
        torch.testing.assert_close(out.logprobs[i, 0], reference[i, tok])
        assert out.ranks[i].item() == int((reference[i] > reference[i, tok]).sum()) + 1
        top = out.logprobs[i, 1:]
        assert torch.all(top[:-1] >= top[1:])  # most likely first
        torch.testing.assert_close(top, reference[i].topk(5).values)
        torch.testing.assert_close(reference[i, out.logprobs_token_ids[i, 1:]], top)
    assert out.ranks[1].item() == 1  # greedy takes the most likely token
    assert out.ranks[0].item() <= 3  # top-k 3 only samples among the first three
    # Logprobs are taken before top-k: the 4th and 5th alternatives are finite.
    assert torch.isfinite(out.logprobs[0]).all()
    assert Sampler()(x, build(rows[3:] * 4, vocab)).logprobs is None


def test_logprobs_zero_gives_only_the_sampled_token() -> None:
    x = torch.tensor([[0.0, 1.0, 2.0]])
    out = Sampler()(x, build([row(SamplingParams(temperature=0, logprobs=0))], 3))
    assert out.logprobs_token_ids.tolist() == [[2]] and out.ranks.tolist() == [1]
    torch.testing.assert_close(out.logprobs[0, 0], x[0].log_softmax(0)[2])


def test_bad_logits_shape_is_refused() -> None:
    with pytest.raises(ValueError, match="logits"):
        Sampler()(torch.zeros(1, 5), build([row(SamplingParams())], 6))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_matches_cpu_rules() -> None:
    seeded_batch_mixes("cuda")
    torch.manual_seed(4)
    x = torch.randn(3, 100)
    rows = [row(SamplingParams(temperature=0, repetition_penalty=1.4), [1, 2], [3]),
            row(SamplingParams(top_k=4, top_p=0.5, min_p=0.1, logprobs=3)),
            row(SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[int(x[2].argmax())]))]
    cpu = Sampler()(x, build(rows, 100))
    gpu = Sampler()(x.cuda(), build(rows, 100, device="cuda"))
    assert gpu.sampled_token_ids[[0, 2]].tolist() == cpu.sampled_token_ids[[0, 2]].tolist()
    kept = kept_sets(x[1:2], [rows[1].params])[0]
    assert gpu.sampled_token_ids[1].item() in kept
    torch.testing.assert_close(gpu.logprobs[:, 1:].cpu(), cpu.logprobs[:, 1:])


# ----------------------------------------------------------------------------- stop rules

EOS = 0


def stream(checker: StopChecker, pieces: list[tuple[int, str]]) -> list:
    """Feed (token id, text) pairs until the checker finishes; return the results."""
    results = []
    for token_id, text in pieces:
        results.append(checker.process(token_id, text))
        if results[-1].finished:
            break
    return results


def test_stop_string_split_across_tokens_is_never_emitted() -> None:
    checker = StopChecker(SamplingParams(stop=["</end>"], max_tokens=50), [EOS])
    results = stream(checker, [(5, "Hello"), (6, " </"), (7, "e"), (8, "nd> and more")])
    assert [r.emit_text for r in results] == ["Hello", " ", "", ""]
    assert (results[-1].finish_reason, results[-1].stop_reason) == ("stop", "</end>")
    assert checker.output_text == "Hello "
    assert not any("<" in r.emit_text for r in results)


def test_stop_string_inside_one_token_discards_what_follows() -> None:
    p = SamplingParams(stop=["STOP"], max_tokens=50)
    results = stream(StopChecker(p, [EOS]), [(5, "ab"), (6, "c STOP def")])
    assert [r.emit_text for r in results] == ["ab", "c "]
    assert results[-1].stop_reason == "STOP"
    kept = StopChecker(p.replace(include_stop_str_in_output=True), [EOS])
    stream(kept, [(5, "ab"), (6, "c STOP def")])
    assert kept.output_text == "abc STOP" and kept.finish_reason == "stop"


def test_held_back_text_is_released_when_the_match_fails() -> None:
    checker = StopChecker(SamplingParams(stop=["</end>", "###"], max_tokens=50), [EOS])
    results = stream(checker, [(5, "x </e"), (6, "ra> #"), (7, "#"), (8, "!")])
    assert [r.emit_text for r in results] == ["x ", "</era> ", "", "##!"]
    assert not checker.finished and checker.output_text == "x </era> ##!"


def test_held_back_text_is_released_at_length_and_eos() -> None:
    p = SamplingParams(stop=["</end>"], max_tokens=2)
    results = stream(StopChecker(p, [EOS]), [(5, "a"), (6, " </e")])
    assert results[-1].emit_text == " </e" and results[-1].finish_reason == "length"
    results = stream(StopChecker(p.replace(max_tokens=9), [EOS]), [(5, "a </e"), (EOS, "")])
    assert [r.emit_text for r in results] == ["a ", "</e"]
    assert (results[-1].finish_reason, results[-1].stop_reason) == ("stop", None)


def test_stop_token_ids_and_eos() -> None:
    p = SamplingParams(stop_token_ids=[7], max_tokens=10)
    results = stream(StopChecker(p, [EOS]), [(5, "a"), (7, "\n"), (6, "b")])
    assert [r.emit_text for r in results] == ["a", ""]
    assert (results[-1].finish_reason, results[-1].stop_reason) == ("stop", 7)
    kept = StopChecker(p.replace(include_stop_str_in_output=True), [EOS])
    stream(kept, [(5, "a"), (7, "\n")])
    assert kept.output_text == "a\n"
    # EOS stops (its text is not part of the output) unless ignore_eos.
    eos = StopChecker(SamplingParams(max_tokens=10, skip_special_tokens=False), [EOS, 1])
    stream(eos, [(5, "a"), (1, "<|im_end|>")])
    assert (eos.finish_reason, eos.stop_reason, eos.output_text) == ("stop", None, "a")
    ignoring = StopChecker(SamplingParams(max_tokens=3, ignore_eos=True), [EOS])
    results = stream(ignoring, [(EOS, ""), (EOS, ""), (EOS, "")])
    assert [r.finish_reason for r in results] == [None, None, "length"]


def test_min_tokens_delays_every_stop_rule() -> None:
    p = SamplingParams(min_tokens=3, stop=["!"], stop_token_ids=[7], max_tokens=10)
    checker = StopChecker(p, [EOS])
    results = stream(checker, [(EOS, ""), (7, "x"), (5, "!"), (EOS, "")])
    assert [r.finish_reason for r in results] == [None, None, None, "stop"]
    assert checker.output_text == "x!"
    checker = StopChecker(p, [EOS])
    results = stream(checker, [(5, "a"), (5, "b"), (5, "c"), (5, "d!e")])
    assert results[-1].stop_reason == "!" and checker.output_text == "abcd"


def test_max_tokens_and_stop_wins_on_the_same_token() -> None:
    checker = StopChecker(SamplingParams(max_tokens=3), [EOS])
    results = stream(checker, [(5, "a"), (5, "b"), (5, "c"), (5, "d")])
    assert [r.finish_reason for r in results] == [None, None, "length"]
    assert checker.output_text == "abc"
    last = stream(StopChecker(SamplingParams(max_tokens=2, stop=["c"]), [EOS]),
                  [(5, "a"), (5, "bcd")])[-1]
    assert (last.finish_reason, last.stop_reason) == ("stop", "c")
    last = stream(StopChecker(SamplingParams(max_tokens=2), [EOS]), [(5, "a"), (EOS, "")])[-1]
    assert last.finish_reason == "stop"
    # max_tokens unset: the engine passes what fits, or ends the request itself.
    checker = StopChecker(SamplingParams(max_tokens=None, stop=["xyz"]), [EOS], max_tokens=2)
    assert stream(checker, [(5, "a"), (5, "x")])[-1].finish_reason == "length"
    checker = StopChecker(SamplingParams(max_tokens=None, stop=["xyz"]), [EOS])
    assert checker.process(5, "ax").emit_text == "a"
    assert checker.finish("length").emit_text == "x" and checker.output_text == "ax"
    with pytest.raises(RuntimeError):
        checker.process(5, "b")


def test_first_match_wins_between_stop_strings() -> None:
    # "bc" ends before "abcd"; of "b" and "ab" ending together the longer one wins.
    checker = StopChecker(SamplingParams(stop=["abcd", "bc"], max_tokens=9), [EOS])
    stream(checker, [(5, "xabcd")])
    assert checker.output_text == "xa" and checker.stop_reason == "bc"
    checker = StopChecker(SamplingParams(stop=["b", "ab"], max_tokens=9), [EOS])
    stream(checker, [(5, "x"), (5, "ab")])
    assert checker.output_text == "x" and checker.stop_reason == "ab"


def reference_cut(text: str, stops: list[str]) -> tuple[str, str | None]:
    """What a character-by-character stream would return: cut at the first match."""
    for end in range(1, len(text) + 1):
        hits = [s for s in stops if text[:end].endswith(s)]
        if hits:
            s = max(hits, key=len)
            return text[: end - len(s)], s
    return text, None


def test_random_streams_match_the_character_level_reference() -> None:
    rng = random.Random(0)
    for _ in range(300):
        stops = ["".join(rng.choice("ab<>") for _ in range(rng.randint(1, 4)))
                 for _ in range(rng.randint(1, 3))]
        text = "".join(rng.choice("ab<>xy") for _ in range(rng.randint(0, 30)))
        pieces, i = [], 0
        while i < len(text):
            j = i + rng.randint(0, 5)
            pieces.append(text[i:j])
            i = j
        checker = StopChecker(SamplingParams(stop=stops, max_tokens=None), [EOS])
        emitted = ""
        for piece in pieces:
            result = checker.process(5, piece)
            emitted += result.emit_text
            assert text.startswith(emitted)
            if result.finished:
                break
        if not checker.finished:
            emitted += checker.finish().emit_text
        expected, reason = reference_cut(text, stops)
        assert emitted == checker.output_text == expected, (stops, pieces)
        assert checker.stop_reason == reason


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_sampling_tail_on_a_full_vocabulary() -> None:
    """One token at +20 among 151,936: p = 0.99969, so ~6 of 20,000 draws miss it.

    A noise value that degenerates (an exponential of exactly 0, or a Gumbel of
    +inf) hands its token the win whatever its probability: over 151,936 tokens
    a row, even a 1e-7 chance per value would cost thousands of misses.
    """
    vocab, n, chunk = 151936, 20_000, 2_000
    logits = torch.zeros(vocab, device="cuda")
    logits[777] = 20.0
    misses = 0
    for _ in range(n // chunk):  # fresh metadata per chunk: fresh noise keys
        meta = build([row(SamplingParams(temperature=1.0))] * chunk, vocab, device="cuda")
        misses += int((Sampler()(logits.expand(chunk, -1), meta).sampled_token_ids != 777).sum())
    expected = n * (1 - logits.double().softmax(0)[777].item())
    assert misses <= expected + 6 * expected**0.5 + 1, misses
