"""The continuous-batching inference engine: `LLM` (offline API), `LLMEngine` (the step loop)
and `EngineThread` (the loop in its own thread, as the server drives it). Import the modules
directly; this package imports nothing heavy on its own."""
