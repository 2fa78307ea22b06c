"""What a bench reads from a generate worker's Prometheus endpoint (`--metrics-port`): how
many requests it ended, and the histogram of how long a chunk's oldest token was held.
Used by ops/bench/throughput.py."""

from __future__ import annotations


def scrape(port: int) -> list | None:
    """The metric families the generate worker on `port` serves; None when it serves none."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
            return list(text_string_to_metric_families(response.read().decode()))
    except OSError:
        return None


def hold_buckets(port: int) -> dict[float, float] | None:
    """genpipe_chunk_hold_seconds of the generate worker on `port`: cumulative count by
    bucket bound; None when it is not served (code from before the metric)."""
    for family in scrape(port) or ():
        if family.name == "genpipe_chunk_hold_seconds":
            return {float(sample.labels["le"]): sample.value for sample in family.samples
                    if sample.name.endswith("_bucket")}
    return None


def bucket_quantile(q: float, before: dict[float, float], after: dict[float, float]) -> float | None:
    """The q-quantile of the observations between two scrapes of one histogram, linear in
    the bucket that holds it (histogram_quantile's rule); None without observations."""
    bounds = sorted(after)
    counts = [after[b] - before.get(b, 0.0) for b in bounds]
    if not counts or counts[-1] <= 0:
        return None
    rank, lower, below = q * counts[-1], 0.0, 0.0
    for bound, count in zip(bounds, counts):
        if count >= rank:
            if bound == float("inf"):
                return lower  # past the last finite bound: its value, as Prometheus does
            return lower + (bound - lower) * (rank - below) / max(count - below, 1e-12)
        lower, below = bound, count
    return lower


def finished_requests(port: int) -> int:
    """Requests the generate worker on `port` has ended (its genpipe_requests_total, every
    outcome but taken in)."""
    families = scrape(port)
    if families is None:
        raise RuntimeError(f"the generate worker serves no metrics on port {port}")
    return int(sum(sample.value for family in families for sample in family.samples
                   if sample.name == "genpipe_requests_total"
                   and sample.labels.get("outcome") not in ("accepted", "skipped")))
