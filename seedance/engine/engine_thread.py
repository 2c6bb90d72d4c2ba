"""The engine as the server drives it: the shared command loop (`engine_loop.EngineLoop`)
over an `LLMEngine`, stepping in one thread named `seedance-engine`."""

from __future__ import annotations

from seedance.engine.config import EngineConfig
from seedance.engine.engine_loop import EngineLoop
from seedance.engine.llm_engine import LLMEngine


class EngineThread(EngineLoop):
    """`EngineInterface` over the real engine; `engine` is its step core."""

    def __init__(
        self, config: EngineConfig | None = None, *, engine: LLMEngine | None = None
    ) -> None:
        if engine is None:
            engine = LLMEngine(config or EngineConfig())
        self.engine = engine
        super().__init__(engine, thread_name="seedance-engine")
