"""Lanes (workers/kafka/lanes.py): a partition the producer cannot take batches for waits
on its own, in order, bounded. The sends here stand in for the producer (pure asyncio);
tests/test_cluster.py runs lanes on a real cluster with a partition without a leader."""

from __future__ import annotations

import asyncio

import pytest
from aiokafka import TopicPartition

from workers.kafka.lanes import Lanes

TP = TopicPartition("t", 0)


class Producer:
    """Takes a batch when `open` is set; a future per batch, answered by the test."""

    def __init__(self):
        self.open = asyncio.Event()
        self.taken: list[tuple[TopicPartition, str]] = []
        self.futures: list[asyncio.Future] = []

    async def send(self, tp: TopicPartition, batch: str) -> asyncio.Future:
        await self.open.wait()
        self.taken.append((tp, batch))
        future = asyncio.get_running_loop().create_future()
        self.futures.append(future)
        return future


async def _until(condition, what: str, timeout: float = 5.0) -> None:
    async def poll():
        while not condition():
            await asyncio.sleep(0.001)
    try:
        await asyncio.wait_for(poll(), timeout)
    except asyncio.TimeoutError:
        raise AssertionError(f"timed out waiting for {what}") from None


async def test_a_lane_hands_its_batches_over_in_order_and_each_future_ends_as_the_producers():
    producer = Producer()
    lanes = Lanes(producer.send)
    futures = [await lanes.add(TP, f"b{i}", 2) for i in range(3)]
    assert TP in lanes and lanes.bytes == 6 and producer.taken == []
    producer.open.set()
    await _until(lambda: len(producer.taken) == 3, "the lane to hand its batches over")
    assert producer.taken == [(TP, "b0"), (TP, "b1"), (TP, "b2")]
    await _until(lambda: TP not in lanes, "the empty lane to close")
    assert lanes.bytes == 0 and not lanes.tasks()
    producer.futures[0].set_result("ack")
    producer.futures[1].set_exception(ValueError("refused"))
    producer.futures[2].cancel()
    await asyncio.sleep(0)
    assert futures[0].result() == "ack"
    assert isinstance(futures[1].exception(), ValueError) and futures[2].cancelled()


async def test_what_joins_a_lane_goes_after_what_waits_there():
    producer = Producer()
    lanes = Lanes(producer.send)
    await lanes.add(TP, "first", 1)
    other = TopicPartition("t", 1)
    await lanes.add(other, "elsewhere", 1)
    await lanes.add(TP, "second", 1)
    producer.open.set()
    await _until(lambda: not lanes, "both lanes to empty")
    assert [b for tp, b in producer.taken if tp == TP] == ["first", "second"]


async def test_lanes_hold_at_most_max_bytes_then_a_send_waits_for_room():
    producer = Producer()
    lanes = Lanes(producer.send, max_bytes=4)
    await lanes.add(TP, "a", 2)
    await lanes.add(TP, "b", 2)
    third = asyncio.ensure_future(lanes.add(TP, "c", 1))
    await asyncio.sleep(0.01)
    assert not third.done() and lanes.bytes == 4  # full: the caller is held, as a send was before lanes
    producer.open.set()
    await asyncio.wait_for(third, 5)
    await _until(lambda: not lanes, "the lane to empty")
    assert [b for _, b in producer.taken] == ["a", "b", "c"] and lanes.bytes == 0


@pytest.mark.parametrize("started", [False, True])
async def test_a_lane_cancelled_at_shutdown_cancels_what_it_had_not_handed_over(started):
    producer = Producer()
    lanes = Lanes(producer.send)
    futures = [await lanes.add(TP, f"b{i}", 3) for i in range(2)]
    (task,) = lanes.tasks()
    if started:  # waiting in the producer's send
        await asyncio.sleep(0.01)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert all(f.cancelled() for f in futures)
    assert lanes.bytes == 0 and TP not in lanes and producer.taken == []


async def test_a_send_that_fails_fails_everything_waiting_in_its_lane():
    async def gone(tp, batch):
        raise LookupError("topic 't' is gone")

    lanes = Lanes(gone)
    futures = [await lanes.add(TP, f"b{i}", 1) for i in range(3)]
    await _until(lambda: TP not in lanes, "the lane to close")
    for future in futures:
        with pytest.raises(LookupError, match="is gone"):
            future.result()
    assert lanes.bytes == 0


async def test_a_publishers_flush_waits_for_the_records_in_its_lanes():
    """`Publisher.flush` (genpipe replay's last step) returns once the records waiting in a
    lane are handed to the producer and the producer's flush covered them; before, it
    flushed only what the producer held, and a lane's records were still on their way."""
    from workers.kafka.publisher import Publisher

    events = []
    open_ = asyncio.Event()

    class Stub:  # what Publisher calls on its producer here, nothing else
        async def send_batch(self, batch, topic, partition):
            await open_.wait()
            events.append(("sent", batch))
            future = asyncio.get_running_loop().create_future()
            future.set_result(None)
            return future

        async def flush(self):
            events.append("flushed")

    publisher = Publisher(Stub(), "dlq")
    await publisher.lanes.add(TP, "batch", 10)
    flushing = asyncio.ensure_future(publisher.flush())
    await asyncio.sleep(0.05)  # (time for a flush that does not wait to end)
    assert not flushing.done() and events == []
    open_.set()
    await asyncio.wait_for(flushing, 5)
    assert events == [("sent", "batch"), "flushed"]
