"""A waiting request's inbox (workers/mailbox.py): order, timeout, keep-alive. No broker."""

from __future__ import annotations

import asyncio

import pytest

from workers.mailbox import KEEPALIVE, OVERFLOW, TIMED_OUT, Mailbox


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


def test_records_come_out_in_order_and_a_waiting_reader_wakes():
    async def main():
        box = Mailbox(timeout_s=60)
        box.start()
        reader = asyncio.ensure_future(box.get())
        await asyncio.sleep(0)  # the reader is waiting now
        box.put("a")
        box.put("b")
        got = [await reader, await box.get()]
        box.close()
        return got

    assert run(main()) == ["a", "b"]


def test_a_quiet_request_times_out_after_what_it_received():
    async def main():
        box = Mailbox(timeout_s=0.05)
        box.put("early")  # arrived while the request was being sent
        box.start()
        return [await box.get(), await box.get()]

    assert run(main()) == ["early", TIMED_OUT]


def test_records_keep_the_timeout_away_and_keepalives_do_not():
    async def main():
        loop = asyncio.get_running_loop()
        box = Mailbox(timeout_s=1.0, keepalive_s=0.2)
        box.start()
        started = loop.time()
        got = []

        async def feed():  # a record every 50 ms for 1.5 s: longer than the timeout
            for i in range(30):
                box.put(i)
                await asyncio.sleep(0.05)

        feeder = asyncio.ensure_future(feed())
        while True:
            item = await box.get()
            got.append(item)
            if item is TIMED_OUT:
                break
        await feeder
        return got, loop.time() - started

    got, took = run(main())
    records = [g for g in got if isinstance(g, int)]
    assert records == list(range(30)), "every record, in order, before the timeout"
    assert got[-1] is TIMED_OUT and got.index(TIMED_OUT) == len(got) - 1
    # After the last record: keep-alives every 0.2 s, then the timeout 1 s after that record
    # (keep-alives are not records: they do not push it back).
    tail = got[got.index(29) + 1:-1]
    assert tail and all(t is KEEPALIVE for t in tail)
    assert len(tail) <= 5
    assert took >= 1.5 + 1.0 - 0.05


@pytest.mark.parametrize("keepalive", [None, 0.05])
def test_close_stops_the_timer(keepalive):
    async def main():
        box = Mailbox(timeout_s=0.05, keepalive_s=keepalive)
        box.start()
        box.close()
        await asyncio.sleep(0.2)  # past both periods: nothing may arrive
        box.put("only")
        return await box.get()

    assert run(main()) == "only"


def test_a_bounded_inbox_drops_what_was_unread_and_says_so_once():
    overflows = []

    async def main():
        box = Mailbox(timeout_s=60, max_items=3, on_overflow=lambda: overflows.append(len(box._items)),
                      stalled_after_s=0)  # (behind as soon as full: see the next test)
        box.start()
        for i in range(3):
            box.put(i)
        box.put(3)  # one too many: the reader fell behind
        box.put(4)
        got = [await box.get()]
        box.put(5)
        return got, box.overflowed, len(box._items)

    got, dropped, left = run(main())
    assert got == [OVERFLOW] and dropped == 6 and left == 0
    assert overflows == [0]  # called once, at the overflow, before any get (the reader may never come)


def test_a_burst_past_the_bound_is_not_a_stall_but_a_reader_that_takes_nothing_is():
    """The client's reader hands a whole poll's records to the inboxes before any request's
    reader runs: after a lag of its own (a GC pause, a broker's hiccup) that is thousands
    of one stream's records at once, and a bound of 1,024 gave up every long stream that
    was reading fine. A full inbox is its reader's stall only once its oldest record has
    waited `stalled_after_s`."""
    async def main():
        box = Mailbox(timeout_s=60, max_items=1024)
        box.start()
        for i in range(3000):
            box.put(i)
        burst = [await box.get() for _ in range(3000)]
        stalled = Mailbox(timeout_s=60, max_items=3, stalled_after_s=0.05)
        stalled.start()
        for i in range(5):
            stalled.put(i)  # full, but just put: kept
        kept = len(stalled._items)
        deadline = asyncio.get_running_loop().time() + 0.05
        while asyncio.get_running_loop().time() < deadline:  # the reader takes nothing
            await asyncio.sleep(0.01)
        stalled.put(5)
        return burst, kept, await stalled.get(), stalled.overflowed
    burst, kept, then, dropped = run(main())
    assert burst == list(range(3000)) and kept == 5
    assert then is OVERFLOW and dropped == 6
