"""Speculative decoding: propose several tokens, verify them in one target forward.

- `config.SpeculativeConfig`: the `speculative_config` engine argument;
- `ngram_proposer.NgramProposer` and `draft_model.DraftModelProposer`: the proposers;
- `rejection_sampler.RejectionSampler`: keeps the proposals the target would
  have drawn, so that the output's distribution is the target's;
- `policy.SpeculationPolicy`: how many tokens each sequence proposes;
- `metrics.SpecDecodingStats`: acceptance and cost, in the engine's statistics.

The engine's speculative step is `engine/speculative.py`.
"""
