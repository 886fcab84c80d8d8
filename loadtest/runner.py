"""Drives one load shape: an open loop that sends on schedule whatever the server is doing, or a
closed loop of workers that each send their next request when the previous one is over."""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass

from loadtest.arrivals import arrival_offsets, num_arrivals
from loadtest.client import OpenAIClient, PreparedRequest, RequestRecord
from loadtest.config import LoadShape
from loadtest.progress import Progress
from loadtest.workload import BaseWorkload


@dataclass
class RunResult:
    shape: LoadShape
    records: list[RequestRecord]  # in index order
    duration: float  # from the first scheduled send to the end of the last request
    max_in_flight: int
    started_at: float  # wall clock (time.time()) at the start of the run


async def run_shape(client: OpenAIClient, workload: BaseWorkload, shape: LoadShape, first_index: int,
                    seed: int, progress: Progress) -> RunResult:
    # The schedule, the deadline and the client's timestamps all read the client's clock: send lag and
    # duration are differences between them.
    clock = client.clock
    records: list[RequestRecord] = []
    in_flight = 0
    max_in_flight = 0

    async def send(request: PreparedRequest, origin: float, scheduled: float | None) -> None:
        nonlocal in_flight, max_in_flight
        in_flight += 1
        max_in_flight = max(max_in_flight, in_flight)
        progress.sent()
        record = await client.send(request, origin, scheduled)
        in_flight -= 1
        progress.done(record.ok)
        records.append(record)

    def prepare(i: int) -> PreparedRequest:
        return client.prepare(workload.request(first_index + i))

    if shape.is_open_loop:
        num_requests = shape.num_requests or num_arrivals(shape.request_rate, shape.duration)
        offsets = arrival_offsets(shape.request_rate, num_requests, shape.burstiness, seed)
        limiter = asyncio.Semaphore(shape.max_concurrency) if shape.max_concurrency else None

        async def send_capped(request: PreparedRequest, origin: float, scheduled: float) -> None:
            # A capped open loop queues here; the wait shows up as send lag, not hidden.
            async with limiter:
                await send(request, origin, scheduled)

        started_at, origin = time.time(), clock.now()
        progress.start()
        tasks = []
        for i, offset in enumerate(offsets):
            # Each request is built in the gap before it is due (memory stays flat over long runs);
            # a build slower than the gap shows up as send lag.
            request = prepare(i)
            delay = origin + offset - clock.now()
            if delay > 0:
                await clock.sleep(delay)
            task = send_capped(request, origin, offset) if limiter else send(request, origin, offset)
            tasks.append(asyncio.create_task(task))
            await asyncio.sleep(0)  # let it start (and stamp its send time) before building the next
        await asyncio.gather(*tasks)
    else:
        indices = itertools.count()

        async def worker(deadline: float | None) -> None:
            for i in indices:
                if shape.num_requests is not None and i >= shape.num_requests:
                    return
                request = prepare(i)
                # Checked after building the request, so nothing is sent once the duration is over.
                if deadline is not None and clock.now() >= deadline:
                    return
                await send(request, origin, None)

        started_at, origin = time.time(), clock.now()
        deadline = origin + shape.duration if shape.duration else None
        progress.start()
        await asyncio.gather(*(worker(deadline) for _ in range(shape.max_concurrency)))
    await progress.stop()
    records.sort(key=lambda r: r.index)
    duration = max((r.finished for r in records), default=0.0)
    return RunResult(shape, records, duration, max_in_flight, started_at)


async def warm_up(client: OpenAIClient, workload: BaseWorkload, num_requests: int,
                  concurrency: int) -> list[RequestRecord]:
    """Requests sent before the measured run and left out of its figures."""
    limiter = asyncio.Semaphore(concurrency)
    origin = client.clock.now()

    async def send(i: int) -> RequestRecord:
        async with limiter:
            return await client.send(client.prepare(workload.request(i)), origin, None)

    return list(await asyncio.gather(*(send(i) for i in range(num_requests))))
