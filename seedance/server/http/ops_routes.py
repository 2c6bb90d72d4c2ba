"""Operations endpoints: `GET /healthz` (the process is alive), `GET /readyz` (model loaded,
engine stepping, not draining; 503 otherwise) and `GET /metrics` (Prometheus text)."""

from __future__ import annotations

from seedance.server.http.h11_server import HttpExchange, Routes
from seedance.server.ops.metrics import CONTENT_TYPE
from seedance.server.server_context import ServerContext


def routes() -> Routes:
    return {
        "/healthz": {"GET": healthz},
        "/readyz": {"GET": readyz},
        "/metrics": {"GET": metrics},
    }


async def healthz(ctx: ServerContext, exchange: HttpExchange) -> None:
    await exchange.respond_json(200, {"status": "alive"})


async def readyz(ctx: ServerContext, exchange: HttpExchange) -> None:
    if ctx.drain.draining:
        await exchange.respond_json(503, {"status": "draining"})
    elif not ctx.engine.is_ready():
        await exchange.respond_json(503, {"status": "loading"})
    else:
        await exchange.respond_json(200, {"status": "ready", "model": ctx.model_name})


async def metrics(ctx: ServerContext, exchange: HttpExchange) -> None:
    await exchange.respond(200, ctx.metrics.render(), content_type=CONTENT_TYPE)
