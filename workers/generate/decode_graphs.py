"""Pure-decode steps replayed as CUDA graphs, one per (batch bucket, key-length bucket).

Why: a decode step of a Llama-family model launches about 15 kernels per layer, and
below a few billion parameters the GPU finishes each one before Python has launched
the next, so the step takes the host's time, not the weights' read time (measured on
an H200: BENCHMARKS.md, "The engine on a GPU"). A graph launches the whole forward at
once. Its shapes are fixed at capture, so a step's n decoding rows are padded up to a
batch bucket and its keys (the largest position + 1) up to a length bucket:

- padded rows read token 0 at position 0, write their K/V to a cache row no request
  owns (`pad_row`) and attend one key; their logits are dropped;
- a row's own keys past its position are masked (-inf), as in the eager step, so the
  padding changes which keys are summed by no value: only the kernels' summation
  order, by rounding.

Steps with a prefill chunk run eagerly (their shapes vary with every prompt). The
padded step itself (`PaddedDecode.run` with capture off) is plain tensor code that
runs on the CPU too: that is how the tests pin it. Only capture and replay need CUDA.
"""

from __future__ import annotations

import logging
from typing import Callable

import torch

log = logging.getLogger(__name__)

MODES = ("auto", "off", "padded")  # auto: graphs on CUDA, off elsewhere; padded: no capture (tests)


class CaptureFailed(RuntimeError):
    """Capture failed. Its warm-up may have written some of the step's K/V: running the step
    eagerly writes the same values again, so the caller may do that."""


def batch_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, ... below max_batch, then max_batch: at most 2x the rows of padding."""
    out, b = [], 1
    while b < max_batch:
        out.append(b)
        b *= 2
    return out + [max_batch]


def batch_bucket(n: int, buckets: list[int]) -> int:
    return next(b for b in buckets if b >= n)


def length_bucket(n: int, max_len: int) -> int:
    """Keys to read, rounded up by at most a quarter (and to 64): 4 buckets per doubling,
    so a long context has few graphs and reads at most ~25% more K/V than it needs."""
    granule = max(64, 1 << max(0, n.bit_length() - 3))
    return min(max_len, -(-n // granule) * granule)


class PaddedDecode:
    """Runs pure-decode steps at bucketed shapes; captures each shape once on CUDA.

    `body(tokens, positions, rows, length)` is the forward over those [B] tensors with
    `length` keys; it must write K/V into the cache and return logits [B, vocab].
    Inputs live in one static buffer, so a replay reads the step's tokens from the
    same addresses the capture saw. The logits returned are a view of a buffer the
    next step overwrites: the caller consumes them before its next call.
    """

    def __init__(self, body: Callable, device: torch.device, max_batch: int, max_len: int, pad_row: int,
                 capture: bool, vocab: int, dtype: torch.dtype):
        self.body = body
        self.device = device
        self.buckets = batch_buckets(max_batch)
        self.max_len = max_len
        self.pad_row = pad_row
        self.capture = capture
        self.inputs = torch.zeros((3, self.buckets[-1]), dtype=torch.long, device=device)
        # Every graph writes its logits here (allocated before any capture, on the stream
        # that reads it), so captures share one output instead of holding one each.
        self.out = torch.empty((self.buckets[-1], vocab), dtype=dtype, device=device) if capture else None
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.pool = None
        self.steps = 0  # decode steps run at padded shapes (replayed, captured or eager)

    def shape(self, positions: list[int]) -> tuple[int, int]:
        return batch_bucket(len(positions), self.buckets), length_bucket(max(positions) + 1, self.max_len)

    def run(self, tokens: list[int], positions: list[int]) -> torch.Tensor:
        n = len(tokens)
        rows, length = self.shape(positions)
        pad = rows - n
        host = torch.tensor([tokens + [0] * pad, positions + [0] * pad, list(range(n)) + [self.pad_row] * pad],
                            dtype=torch.long)
        self.inputs[:, :rows].copy_(host)
        if not self.capture:
            logits = self._forward(rows, length)
        elif (graph := self.graphs.get((rows, length))) is not None:
            graph.replay()
            logits = self.out
        else:
            try:
                self._capture(rows, length)  # its warm-up ran this step
            except Exception as exc:  # an op that cannot be captured (a torch/driver version's)
                raise CaptureFailed(f"capturing a decode step of {rows} rows x {length} keys failed: "
                                    f"{exc}") from exc
            logits = self.out
        self.steps += 1
        return logits[:n]

    def _forward(self, rows: int, length: int) -> torch.Tensor:
        tokens, positions, row_ids = self.inputs[:, :rows]
        return self.body(tokens, positions, row_ids, length)

    def _capture(self, rows: int, length: int) -> torch.cuda.CUDAGraph:
        # Warm up on a side stream first (PyTorch's rule for capture: lazy init such as
        # cuBLAS workspaces must not happen inside it). The warm-up is this step's real
        # forward; the capture records without running, so its K/V writes happen once.
        current = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            self.out[:rows].copy_(self._forward(rows, length))
        current.wait_stream(side)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()  # one pool: graphs never run at once
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            self.out[:rows].copy_(self._forward(rows, length))
        self.graphs[rows, length] = graph
        log.info("captured a CUDA graph for decode steps of %d rows x %d keys (%d graphs)", rows, length,
                 len(self.graphs))
        return graph
