"""Phase 6: the step loop (`LLMEngine`) and the engine thread (`AsyncLLM`); phase 9 moves
the loop into an engine-core process of its own (`core_process`)."""
