"""The GPU's fast path, apart from the reference it extends (chapter 9).

- `GPUModelRunner` (`gpu.model_runner`): the reference runner's step with the
  CUDA kernels, the fused decoder layers, CUDA graphs and no host sync.
- `FusedSampler` (`gpu.sampler`): the reference sampler with the temperature
  and the draw in one kernel.
- `gpu.attention`, `gpu.cuda_graphs`, `gpu.fused_layers`: what the runner is
  made of.

The engine picks these on a CUDA device (`engine.llm_engine.make_model_runner`,
`make_sampler`); nothing here is imported on the CPU path.
"""
