"""What the derender's producer answers settle (workers/derender/delivery.py): pure asyncio."""

from __future__ import annotations

import asyncio

from workers.derender.delivery import all_answered
from workers.kafka.offsets import release_when_settled


def test_records_sent_together_are_answered_once_all_are_and_never_when_one_was_dropped():
    """An error sent in place of a refused result goes with a cancel; the request's hold
    goes once both are answered. With asyncio.gather(return_exceptions=True) the hold
    went even when one was dropped at shutdown (cancelled): the final commit could pass a
    request whose answer never left. And a plain gather failed at the first failure,
    while the other record still waited."""
    async def main():
        loop = asyncio.get_running_loop()
        outcomes = {}
        for case in ("acked", "one dropped", "one refused"):
            futures = [loop.create_future(), loop.create_future()]
            released = []
            answered = all_answered(futures)
            release_when_settled(answered, lambda released=released: released.append(True))
            futures[0].set_result(None)
            await asyncio.sleep(0)
            early = answered.done()
            if case == "acked":
                futures[1].set_result(None)
            elif case == "one dropped":
                futures[1].cancel()
            else:
                futures[1].set_exception(ValueError("refused"))
            for _ in range(3):  # (each future's callbacks run a loop turn after it is done)
                await asyncio.sleep(0)
            outcomes[case] = (early, answered.cancelled() or (answered.exception() and "failed") or "ok",
                              bool(released))
        return outcomes
    assert asyncio.run(main()) == {"acked": (False, "ok", True), "one dropped": (False, True, False),
                                   "one refused": (False, "failed", True)}
