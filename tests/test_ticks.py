"""The shared ticks (kvcore/ticks.py): one timer per tick for every
loop of an interval, released in batches, at multiples of the interval on the loop's clock."""
from __future__ import annotations

import asyncio
import contextlib

from kvcore import ticks as pc
from kvcore.ticks import Ticks, ticks


@contextlib.contextmanager
def time_stands_still(loop: asyncio.AbstractEventLoop):
    """``loop.time()`` returns one value meanwhile, so every loop that starts waiting computes the
    same tick: on a loaded machine the passes that start them may straddle a multiple of the
    interval, and the loops then rightly wait for two ticks (asyncio's own loop; no timer is due
    while it lasts)."""
    now = loop.time()
    loop.time = lambda: now
    try:
        yield
    finally:
        del loop.time


def test_loops_of_one_interval_share_one_timer_and_wake_at_its_multiple():
    async def main():
        loop = asyncio.get_running_loop()
        clock = ticks()
        assert ticks() is clock  # one per loop
        woke: list[float] = []

        async def one():
            await clock.wait(0.05)
            woke.append(loop.time())

        scheduled = []
        real_call_at = loop.call_at

        def counting_call_at(when, cb, *args):
            scheduled.append(when)
            return real_call_at(when, cb, *args)

        loop.call_at = counting_call_at
        try:
            with time_stands_still(loop):
                tasks = [asyncio.create_task(one()) for _ in range(10)]
                while clock.waiting() < 10:
                    await asyncio.sleep(0)
            assert len(scheduled) == 1  # ten loops, one timer
            due = scheduled[0]
            assert abs(due / 0.05 - round(due / 0.05)) < 1e-9  # a multiple of the interval
            await asyncio.gather(*tasks)
        finally:
            del loop.call_at
        assert len(woke) == 10 and min(woke) >= due
        assert clock.waiting() == 0

    asyncio.run(main())


def test_a_large_tick_is_released_one_batch_per_pass():
    async def main():
        loop = asyncio.get_running_loop()
        clock = Ticks(loop)
        n = pc.BATCH * 2 + 5
        passes: list[int] = []
        current = [0]

        async def one():
            await clock.wait(0.02)
            passes.append(current[0])

        with time_stands_still(loop):
            tasks = [asyncio.create_task(one()) for _ in range(n)]
            cancelled = tasks[3]
            while clock.waiting() < n:
                await asyncio.sleep(0)
        cancelled.cancel()

        async def count_passes():  # one increment per pass of the event loop
            while len(passes) < n - 1:
                current[0] += 1
                await asyncio.sleep(0)

        await asyncio.gather(count_passes(), *[t for t in tasks if t is not cancelled])
        sizes: dict[int, int] = {}
        for p in passes:
            sizes[p] = sizes.get(p, 0) + 1
        # the first batch less the cancelled loop, then a full batch, then the rest: three passes
        assert sorted(sizes.values(), reverse=True) == [pc.BATCH, pc.BATCH - 1, 5]
        assert len(sizes) == 3 and max(sizes) - min(sizes) == 2

    asyncio.run(main())


def test_a_loop_waiting_again_at_once_gets_the_next_tick_under_uvloop():
    """uvloop runs a timer up to a millisecond early (it counts whole milliseconds), so a loop
    that waits again as soon as it wakes is still before the tick that woke it: it must get the
    next tick, not the same one again (one wake-up per tick)."""
    import uvloop

    woke: list[float] = []

    async def main():
        loop = asyncio.get_running_loop()
        clock = ticks()
        t0 = loop.time()
        while loop.time() - t0 < 0.5:
            await clock.wait(0.02)
            woke.append(loop.time())

    uvloop.run(main())
    nearest = [round(t / 0.02) for t in woke]
    assert len(woke) >= 10
    assert nearest == sorted(set(nearest))  # one wake-up per tick, each tick once
