"""kvstream inside a web service (Starlette, any ASGI server).

The app's lifespan starts a [`Scheduler`][kvstream.scheduler.Scheduler]; a background task
steps a simulated engine and ticks once per step; a small custom sink keeps the
last batches and wakes the server-sent-events listeners. Endpoints:

* `GET /batches?limit=N` -- the last N batches, as JSON lines;
* `GET /events` -- server-sent events, one `batch` event per batch
  (`id` is `origin/epoch/seq`; `data` is the batch's JSON line);
* `GET /stats` -- the scheduler's and sinks' statistics, as JSON;
* `GET /metrics` -- the same as Prometheus metrics.

Run it:

    pip install 'kvstream-events[examples]'      # from a checkout: pip install '.[examples]'
    uvicorn asgi_app:app --app-dir examples --timeout-graceful-shutdown 1
    curl -N http://127.0.0.1:8000/events
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from contextlib import aclosing, asynccontextmanager
from typing import Any

import anyio
from prometheus_client import CollectorRegistry, make_asgi_app
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Mount, Route

from kvstream import EventBatch, JsonCodec, Scheduler, Sink, every
from kvstream.metrics import StatisticsCollector
from kvstream.sim import SimulatedEngine


# --8<-- [start:sink]
class RecentBatches(Sink):
    """Keeps the last `keep` batches (as JSON lines) and wakes whoever waits for more."""

    def __init__(self, keep: int = 256, **options: Any) -> None:
        options.setdefault("codec", JsonCodec())
        options.setdefault("policy", "drop_oldest")  # a web page never slows the engine
        super().__init__(**options)
        self.lines: deque[tuple[str, bytes]] = deque(maxlen=keep)  # (origin/epoch/seq, line)
        self.count = 0  # batches received so far
        self._more = anyio.Event()

    async def write(self, data: bytes, batch: EventBatch) -> None:
        self.lines.append((f"{batch.origin}/{batch.epoch}/{batch.seq}", data))
        self.count += 1
        self._more.set()
        self._more = anyio.Event()

    async def follow(self) -> AsyncGenerator[tuple[str, bytes]]:
        """Every batch from now on; a listener that falls `keep` behind skips ahead."""
        seen = self.count
        while True:
            while seen == self.count:
                await self._more.wait()
            missed = min(self.count - seen, len(self.lines))
            lines = list(self.lines)[-missed:]
            seen = self.count
            for line in lines:
                yield line


# --8<-- [end:sink]


# --8<-- [start:engine]
async def run_engine(engine: SimulatedEngine, kv: Scheduler, steps_per_second: float) -> None:
    """The engine's step loop: one step, then one tick (one batch)."""
    async for _ in every(1.0 / steps_per_second):
        kv.emit(engine.run_step())  # the cache manager's own events
        await engine.handed_over()  # the CPU offload connector has handed over its own
        await kv.tick()


# --8<-- [end:engine]


def create_app(
    *, sinks: Sequence[Sink] = (), steps_per_second: float = 20.0, seed: int = 0
) -> Starlette:
    """The app; `sinks` are added to the scheduler beside the built-in one."""
    registry = CollectorRegistry(auto_describe=False)
    collector = StatisticsCollector()
    registry.register(collector)

    # --8<-- [start:lifespan]
    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[dict[str, Any]]:
        recent = RecentBatches()
        engine = SimulatedEngine(seed=seed, origin="sim-0")
        async with Scheduler(sinks=[recent, *sinks], origin="sim-0") as kv:
            for source, name in engine.inputs():  # the engine's connectors
                kv.add_source(source, name=name)
            collector.add(kv)
            async with anyio.create_task_group() as tg:
                tg.start_soon(run_engine, engine, kv, steps_per_second)
                yield {"kv": kv, "recent": recent}  # the app serves requests now
                tg.cancel_scope.cancel()  # shutting down: stop stepping
            engine.close()
            collector.remove(kv)
        # Leaving the scheduler sealed the last events and delivered them to every sink.

    # --8<-- [end:lifespan]

    async def batches(request: Request) -> Response:
        recent: RecentBatches = request.state.recent
        limit = int(request.query_params.get("limit", "20"))
        lines = list(recent.lines)[-limit:] if limit > 0 else []
        return Response(b"".join(line for _, line in lines), media_type="application/x-ndjson")

    async def events(request: Request) -> StreamingResponse:
        recent: RecentBatches = request.state.recent

        async def stream() -> AsyncIterator[bytes]:
            async with aclosing(recent.follow()) as batches:
                async for key, line in batches:
                    yield b"id: %s\nevent: batch\ndata: %s\n\n" % (key.encode(), line.rstrip())

        return StreamingResponse(stream(), media_type="text/event-stream")

    async def stats(request: Request) -> Response:
        st = request.state.kv.statistics()
        body = {
            "origin": st.origin,
            "epoch": st.epoch,
            "ticks": st.ticks,
            "batches_sealed": st.batches_sealed,
            "events_sealed": st.events_sealed,
            "sinks": [dataclasses.asdict(s) for s in st.sinks],
            "sources": [s._asdict() for s in st.sources],
        }
        return JSONResponse(body)

    return Starlette(
        routes=[
            Route("/batches", batches),
            Route("/events", events),
            Route("/stats", stats),
            Mount("/metrics", make_asgi_app(registry)),
        ],
        lifespan=lifespan,
    )


app = create_app()
