"""Producer, consumer and admin construction from one KafkaSettings.

The defaults are the ones token streaming needs (see NOTES.md): idempotent producer
with acks=all and no linger (a token waits for nothing; the generate worker batches a
whole step's chunks itself, and records queue up anyway while a request is in flight);
consumers without auto-commit (workers commit only what is safe, SPEC §4/§5.5).

Fetch wait: the broker answers a waiting fetch as soon as a record lands on any of its
partitions, so a long wait costs no latency (measured: 5 and 500 ms give the same token
latency, BENCHMARKS.md); it only bounds how often an idle consumer asks again. At 20 ms
a generate worker's request consumer and cancel follower together asked 100 times a
second, which on a shared box cost the engine ~10% of its tokens/s (engine (c)).
"""

from __future__ import annotations

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient

from workers.kafka.settings import KafkaSettings


def make_producer(settings: KafkaSettings, **overrides) -> AIOKafkaProducer:
    options = dict(
        enable_idempotence=True,  # retries never duplicate or reorder a partition's records
        acks="all",
        linger_ms=0,
        max_batch_size=256 * 1024,
        request_timeout_ms=30000,
    )
    options.update(overrides)
    return AIOKafkaProducer(**settings.client_kwargs(), **options)


def make_consumer(settings: KafkaSettings, *topics: str, group_id: str | None, **overrides) -> AIOKafkaConsumer:
    options = dict(
        group_id=group_id,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        fetch_max_wait_ms=500,
        max_poll_records=1000,
        session_timeout_ms=30000,
        heartbeat_interval_ms=3000,
        # The model step runs in a thread, so the loop stays responsive; 5 minutes gives
        # a long SIGTERM grace period room before the group evicts us.
        max_poll_interval_ms=300000,
    )
    options.update(overrides)
    return AIOKafkaConsumer(*topics, **settings.client_kwargs(), **options)


def make_admin(settings: KafkaSettings) -> AIOKafkaAdminClient:
    kwargs = settings.client_kwargs()
    return AIOKafkaAdminClient(**kwargs)
