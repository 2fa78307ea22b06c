"""The streams part of ops/bench/gateway.py: ramp to N concurrent streamed completions held
by one gateway; all held at once and complete exactly; the gateway's RSS, CPU, descriptors."""

from __future__ import annotations

import asyncio
import resource
import time

import msgspec

from ops.bench.gateway_procs import LOG_DIR, pct, proc_stats
from ops.bench.sse import sse_post

_decode = msgspec.json.decode


class Stream:
    __slots__ = ("opened", "first", "closed", "tokens", "finishes", "done", "usage", "error")

    def __init__(self):
        self.opened = self.first = self.closed = None
        self.tokens, self.finishes, self.done, self.usage, self.error = 0, 0, 0, None, None

    def on_event(self, event: bytes, now: int) -> None:
        if event == b"data: [DONE]":
            self.done += 1
            return
        if not event.startswith(b"data: "):
            return  # a keep-alive comment
        item = _decode(event[6:])
        if "error" in item:
            self.error = item["error"]
            return
        if item.get("usage"):
            self.usage = item["usage"]["completion_tokens"]
        for choice in item["choices"]:
            self.first = self.first or now
            self.tokens += len(choice["logprobs"]["tokens"])
            self.finishes += choice["finish_reason"] is not None


async def part_streams(args, port: int, gw_pid: int) -> float:
    n, tokens = args.streams, args.stream_tokens
    streams = [Stream() for _ in range(n)]
    body = msgspec.json.encode({"prompt": [1, 5, 6, 7], "max_tokens": tokens, "temperature": 0, "logprobs": 0,
                                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}})
    samples = []  # (time, rss, cpu, fds, open streams)

    def open_now() -> int:
        return sum(1 for s in streams if s.opened is not None and s.closed is None)

    async def sample() -> None:
        while True:
            samples.append((time.monotonic(), *proc_stats(gw_pid), open_now()))
            await asyncio.sleep(0.25)

    async def one(s: Stream) -> None:
        try:
            await sse_post("127.0.0.1", port, "/v1/completions", body, s.on_event,
                           on_headers=lambda now: setattr(s, "opened", now))
        except Exception as exc:
            s.error = repr(exc)
        except asyncio.CancelledError:
            s.error = "not finished in time"
        s.closed = time.time_ns()

    rss0, cpu0, fds0 = proc_stats(gw_pid)
    me0 = resource.getrusage(resource.RUSAGE_SELF)
    sampler = asyncio.ensure_future(sample())
    started = time.monotonic()
    tasks = []
    for i in range(n):  # the ramp: --ramp streams/s
        tasks.append(asyncio.ensure_future(one(streams[i])))
        delay = started + (i + 1) / args.ramp - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
    _, pending = await asyncio.wait(tasks, timeout=args.stream_tokens * args.stream_step_ms / 1000 + 60)
    for task in pending:  # e.g. a connection the gateway never accepted (out of file descriptors)
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    wall = time.monotonic() - started
    sampler.cancel()
    rss1, cpu1, fds1 = proc_stats(gw_pid)
    me1 = resource.getrusage(resource.RUSAGE_SELF)
    # the most streams open at once: a sweep over (open, close) of every stream
    edges = sorted([(s.opened, 1) for s in streams if s.opened] + [(s.closed, -1) for s in streams if s.opened])
    peak = running = 0
    for _, step in edges:
        running += step
        peak = max(peak, running)
    at_peak = max(samples, key=lambda x: (x[4], x[1]))
    peak_rss = max(x[1] for x in samples)
    held = [x for x in samples if x[4] >= 0.95 * n]
    held_cpu = (held[-1][2] - held[0][2]) / (held[-1][0] - held[0][0]) if len(held) > 1 else float("nan")
    complete = sum(1 for s in streams if s.error is None and s.done == 1 and s.finishes == 1 and s.tokens == tokens
                   and s.usage == tokens)
    lost = sum(1 for s in streams if s.tokens < tokens or s.done == 0)
    dup = sum(1 for s in streams if s.tokens > tokens or s.done > 1 or s.finishes > 1)
    errors = [s.error for s in streams if s.error is not None]
    events = sum(s.tokens for s in streams)  # one token per event unless the worker coalesced
    me_cpu = (me1.ru_utime + me1.ru_stime) - (me0.ru_utime + me0.ru_stime)
    print(f"\n== streams: {n} streamed completions of {tokens} tokens (logprobs 0), ramp {args.ramp:g}/s, "
          f"synthetic step {args.stream_step_ms:g} ms, batch {n} ==")
    print(f"held open at once: {peak} of {n} (sampled peak {at_peak[4]}); complete {complete}, lost {lost}, "
          f"duplicated {dup}, errors {len(errors)}" + (f" (first: {errors[0]})" if errors else ""))
    print(f"gateway RSS: before {rss0 / 2**20:.1f} MiB, peak {peak_rss / 2**20:.1f} MiB (at {at_peak[4]} open: "
          f"{at_peak[1] / 2**20:.1f} MiB), after {rss1 / 2**20:.1f} MiB; per stream "
          f"{(at_peak[1] - rss0) / max(1, at_peak[4]) / 1024:.1f} KiB")
    print(f"gateway CPU: {(cpu1 - cpu0) / wall:.0%} of a core over the part ({wall:.1f} s), {held_cpu:.0%} while "
          f"≥95% held; {(cpu1 - cpu0) / max(1, events) * 1e6:.0f} µs per token; open fds {fds0} → peak "
          f"{max(x[3] for x in samples)} → {fds1}")
    print(f"this process (client, bare asyncio): {me_cpu:.1f} CPU s, {me_cpu / max(1, events) * 1e6:.0f} µs per "
          f"token received; time to first token p50 {pct([(s.first - s.opened) / 1e9 for s in streams if s.first], .5) * 1e3:.0f} ms")
    if complete != n:
        raise SystemExit(f"{n - complete} streams did not complete exactly (logs in {LOG_DIR})")
    return (cpu1 - cpu0) / max(1, events)
