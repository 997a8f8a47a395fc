"""The rejection sampler: keep the proposed tokens the target model would have drawn.

A sequence that proposed `k` tokens `d1 .. dk` was verified in one forward:
the target's logits at its last known token and at each proposal give `k + 1`
distributions `p1 .. p(k+1)` (each conditioned on the tokens before it,
proposals included). Token by token, proposal `dj`, drawn by the proposer from
`qj`, is accepted with probability `min(1, pj(dj) / qj(dj))`; at the first
rejection the sequence takes one token from the residual `max(pj - qj, 0)`
(renormalised) and stops; when all `k` are accepted it takes a bonus token
from `p(k+1)`. Each token emitted this way is distributed exactly as `pj`:

    P(emit x) = q(x) min(1, p(x)/q(x))  +  P(reject) * (p(x) - q(x))+ / sum (p - q)+
              = min(q(x), p(x))        +  (p(x) - min(q(x), p(x)))             = p(x)

(`P(reject) = 1 - sum min(p, q) = sum (p - q)+`). An n-gram proposal is a
point mass (`q(d) = 1`): accepted with probability `p(d)`, the residual is
`p` without `d`. A greedy request accepts `dj` iff it is the argmax of `pj`,
and the token after the last accepted one is that argmax: the same tokens as
decoding one at a time.

`pj` is the distribution the plain sampler (phase 5) would draw from at that
position: its `process_logits` stages (token constraints, min_tokens,
penalties), computed with the proposals before it counted as outputs, then the
temperature and the min-p / top-k / top-p filters.

Everything is batched over the step's rows (`sum(k + 1)` of them) and stays
on the device; the engine's read of `output_token_ids` is the step's one sync.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from mini_vllm.sampler import Sampler
from mini_vllm.sampling_metadata import SamplingMetadata, _to_device

# Past a sequence's last emitted token, `output_token_ids` holds this.
PLACEHOLDER_TOKEN_ID = -1


# --8<-- [start:probs]
def sampling_probs(
    sampler: Sampler, logits: torch.Tensor, metadata: SamplingMetadata
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The plain sampler's pipeline up to its draw, for rows that may be verified.

    Returns:
        `(processed, scaled, probs)`: the logits after `process_logits` (a
        greedy row's argmax), the same over the temperature (logprobs come
        from these), and the probabilities after min-p, top-k and top-p
        (None when every row is greedy). All `[N, V]` float32.
    """
    processed = sampler.process_logits(logits.float(), metadata)
    if metadata.all_greedy:
        return processed, processed, None
    scaled = processed / metadata.temperature.unsqueeze(1)  # greedy rows: / 1
    filtered = scaled
    if metadata.min_p is not None:
        filtered = Sampler.apply_min_p(filtered, metadata.min_p)
    if metadata.top_k is not None or metadata.top_p is not None:
        filtered = Sampler.apply_top_k_top_p(filtered, metadata)
    return processed, scaled, filtered.softmax(dim=1)
# --8<-- [end:probs]


def exponential_noise(shape: tuple[int, int], device: torch.device,
                      generators: dict[int, torch.Generator]) -> torch.Tensor:
    """`[N, V]` Exponential(1) noise: a seeded row's from its own generator, the
    others from one draw of the default generator (as `Sampler.sample` draws it)."""
    noise = torch.empty(shape, device=device)
    if len(generators) < shape[0]:
        noise.exponential_()
    for row, generator in sorted(generators.items()):
        noise[row] = torch.empty(shape[1], device=device).exponential_(generator=generator)
    # A noise value of exactly 0 would turn a filtered-out token (p = 0) into 0/0 = NaN.
    return noise.clamp_(min=torch.finfo(noise.dtype).tiny)


@dataclass
class RejectionSamplerOutput:
    """A verification's result (all tensors on the logits' device).

    Attributes:
        output_token_ids: `[S, max_k + 1]` int64, each sequence's emitted
            tokens (its accepted proposals, then one recovered or bonus
            token), then `PLACEHOLDER_TOKEN_ID`.
        logprobs_token_ids / logprobs / ranks: as `SamplerOutput`'s, one row
            per verified row (`sum(k + 1)`): row `j` of a sequence describes
            its `j`-th emitted token (rows past its last are meaningless), or
            None when no request asked for logprobs.
    """

    output_token_ids: torch.Tensor
    logprobs_token_ids: torch.Tensor | None = None
    logprobs: torch.Tensor | None = None
    ranks: torch.Tensor | None = None


class RejectionSampler:
    """Verifies proposals against the target's distributions (see the module docstring).

    Args:
        sampler: the engine's sampler, whose `process_logits` stages (token
            constraints, min_tokens, penalties) make the target's distribution.
    """

    def __init__(self, sampler: Sampler) -> None:
        self.sampler = sampler

    # --8<-- [start:forward]
    def __call__(
        self,
        logits: torch.Tensor,
        metadata: SamplingMetadata,
        num_draft_tokens: list[int],
        draft_token_ids: list[int],
        draft_probs: torch.Tensor | None = None,
    ) -> RejectionSamplerOutput:
        """Accept or reject every proposal of a step; draw the token after the last accepted.

        Args:
            logits: `[T, V]`, `T = sum(k + 1)`: for each sequence in order, the
                target's logits at its last known token and at each proposal.
            metadata: `T` rows of sampling parameters; row `j` of a sequence
                counts its first `j` proposals as outputs (penalties, min_tokens,
                bad words).
            num_draft_tokens: `k` of each sequence (0: sample one token, as
                the plain sampler does).
            draft_token_ids: the proposals, sequence after sequence (`sum(k)`).
            draft_probs: `[sum(k), V]` the distribution each proposal was drawn
                from, or None: each is a point mass on its token (n-gram).

        Returns:
            The emitted tokens and, if asked for, their logprobs.
        """
        Sampler.check_logits(logits, metadata)
        device, num_rows = logits.device, logits.shape[0]
        rows = _RowLayout(num_draft_tokens, draft_token_ids, num_rows)
        draft, pos, seq, has_draft = rows.to_device(device)  # [T] each
        processed, scaled, probs = sampling_probs(self.sampler, logits, metadata)

        # Greedy rows: a proposal is accepted iff it is the argmax; then the argmax follows.
        greedy = None if metadata.all_random else processed.argmax(dim=1)  # [T]
        accept = torch.zeros(num_rows, dtype=torch.bool, device=device)
        recovered = greedy
        if greedy is not None:
            accept = has_draft & (draft == greedy)
        if probs is not None:  # random rows: the rejection test, then the residual's draw
            accept_r, recovered_r = self._verify_random(
                probs, draft, has_draft, rows, draft_probs, metadata.generators)
            if greedy is None:
                accept, recovered = accept_r, recovered_r
            else:
                accept = torch.where(metadata.is_greedy, accept, accept_r)
                recovered = torch.where(metadata.is_greedy, recovered, recovered_r)

        # Accepted proposals of each sequence: the position of its first rejection
        # (its bonus row, which has no proposal, never accepts).
        first_reject = torch.where(accept, torch.full_like(pos, 1 << 30), pos)  # [T]
        num_accepted = torch.full((rows.num_seqs,), 1 << 30, dtype=pos.dtype, device=device)
        num_accepted.scatter_reduce_(0, seq, first_reject, reduce="amin")  # [S]
        accepted_here = num_accepted[seq]  # [T]
        # Row j emits its proposal (j < accepted), the token after them (j == accepted), or nothing.
        tokens = torch.where(pos < accepted_here, draft, recovered)  # [T]
        out = torch.full((rows.num_seqs, rows.max_k + 1), PLACEHOLDER_TOKEN_ID,
                         dtype=torch.int64, device=device)
        out[seq, pos] = torch.where(pos <= accepted_here, tokens, PLACEHOLDER_TOKEN_ID)
        if metadata.max_num_logprobs is None:
            return RejectionSamplerOutput(out)
        lp = Sampler.gather_logprobs(scaled, tokens, metadata.max_num_logprobs)
        return RejectionSamplerOutput(out, lp.logprobs_token_ids, lp.logprobs, lp.ranks)
    # --8<-- [end:forward]

    # --8<-- [start:verify_random]
    @staticmethod
    def _verify_random(
        probs: torch.Tensor, draft: torch.Tensor, has_draft: torch.Tensor, rows: _RowLayout,
        draft_probs: torch.Tensor | None, generators: dict[int, torch.Generator],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The rejection test of every row with a proposal, and every row's draw from
        its residual (a bonus row's residual is `p` itself).

        Returns:
            `[T]` bool accepted, `[T]` int64 the token drawn from the residual.
        """
        num_rows, vocab = probs.shape
        p_draft = probs.gather(1, draft.unsqueeze(1)).squeeze(1)  # [T] p(d)
        if draft_probs is None:  # point masses: q(d) = 1, the residual is p without d
            q_draft = torch.ones_like(p_draft)
            residual = probs.scatter(1, draft.unsqueeze(1), 0.0)
        else:
            q = torch.zeros_like(probs)
            q[_to_device(rows.draft_rows, torch.int64, probs.device)] = draft_probs.float()
            q_draft = q.gather(1, draft.unsqueeze(1)).squeeze(1)
            residual = (probs - q).clamp_(min=0.0)
        residual = torch.where(has_draft.unsqueeze(1), residual, probs)  # bonus rows: p
        # Rounding can leave a rejected row with no residual mass: draw from p then.
        empty = residual.sum(dim=1, keepdim=True) <= 0
        residual = torch.where(empty, probs, residual)

        # Each seeded row draws its V exponentials, then (with a proposal) its uniform,
        # from its own generator: a row without proposals draws what Sampler.sample does.
        noise = exponential_noise((num_rows, vocab), probs.device, generators)
        uniform = torch.rand(num_rows, device=probs.device)
        for row, generator in sorted(generators.items()):
            if rows.has_draft_host[row]:
                uniform[row] = torch.rand((), device=probs.device, generator=generator)
        # Accept with probability min(1, p(d) / q(d)): u q(d) < p(d), u ~ U[0, 1).
        accept = has_draft & (uniform * q_draft < p_draft)
        recovered = (residual / noise).argmax(dim=1)  # exponential race: P(x) = r(x) / sum r
        return accept, recovered
    # --8<-- [end:verify_random]


class _RowLayout:
    """Where each sequence's rows are in the flat `[T, V]` verification batch.

        num_draft_tokens  [2, 0, 1]       drafts  [a b | - | c]
        row                0  1  2 | 3 | 4  5
        seq                0  0  0 | 1 | 2  2
        pos (j)            0  1  2 | 0 | 0  1
        draft at row       a  b  - | - | c  -      (- : no proposal, token 0)
    """

    def __init__(self, num_draft_tokens: list[int], draft_token_ids: list[int],
                 num_rows: int) -> None:
        ks = np.asarray(num_draft_tokens, dtype=np.int64)
        if (ks < 0).any() or int((ks + 1).sum()) != num_rows:
            raise ValueError(f"rejection sampler: {num_rows} logits rows for proposals "
                             f"{num_draft_tokens} (each sequence needs k + 1 rows)")
        if len(draft_token_ids) != int(ks.sum()):
            raise ValueError(f"rejection sampler: {len(draft_token_ids)} proposed tokens, "
                             f"num_draft_tokens says {int(ks.sum())}")
        self.num_seqs = len(ks)
        self.max_k = int(ks.max()) if len(ks) else 0
        n = ks + 1
        self.seq = np.repeat(np.arange(self.num_seqs), n)  # [T]
        self.pos = np.arange(num_rows) - np.repeat(np.cumsum(n) - n, n)  # [T]
        self.has_draft_host = self.pos < ks[self.seq]  # [T]
        self.draft = np.zeros(num_rows, dtype=np.int64)
        self.draft[self.has_draft_host] = draft_token_ids
        self.draft_rows = np.flatnonzero(self.has_draft_host)  # [sum k]

    def to_device(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        """draft, pos, seq (int64) and has_draft (bool), `[T]` each, in one copy."""
        host = np.stack([self.draft, self.pos, self.seq, self.has_draft_host.astype(np.int64)])
        dev = _to_device(host, torch.int64, device)  # [4, T]
        return dev[0], dev[1], dev[2], dev[3].bool()


__all__ = ["PLACEHOLDER_TOKEN_ID", "RejectionSampler", "RejectionSamplerOutput",
           "exponential_noise", "sampling_probs"]
