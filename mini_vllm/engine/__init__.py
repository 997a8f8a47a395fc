"""Phase 6: the step loop (`LLMEngine`) and the engine thread (`AsyncLLM`)."""
