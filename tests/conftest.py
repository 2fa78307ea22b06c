"""Shared fixtures: one Kafka broker per test session, fresh topic names per test.

Kafka comes from, in order (docs/design.md §7):
1. ``GENPIPE_BOOTSTRAP_SERVERS`` if set (any broker; GENPIPE_* SASL/SSL settings apply);
2. testcontainers when a Docker engine answers *and* it has the image
   ``GENPIPE_TEST_KAFKA_IMAGE`` (default ``genpipe/kafka:<pom version>``, built by
   ``ops/docker/build-images.sh`` from ops/kafka/Dockerfile) locally: no registry is
   needed, and a machine without it falls back (saying so once) instead of failing every
   Kafka test on a pull. The container's EXTERNAL listener is mapped to a free host port
   and advertised as 127.0.0.1:<that port>;
3. the local broker from ``ops/kafka`` (``genpipe broker up``) on port 19092, started
   once and stopped at session end only if this session started it.
``GENPIPE_TEST_KAFKA=docker`` or ``=local`` forces 2 or 3 (``auto``, the default, chooses).

Tests that need Kafka say ``pytestmark = pytest.mark.kafka`` and use ``kafka_settings``
(its own topic prefix per test, so tests never see each other's records) and
``make_topics``. Async tests and fixtures share one session event loop (pyproject:
asyncio_mode=auto, asyncio_default_{fixture,test}_loop_scope=session), so async
fixtures here must not ask for a narrower loop scope.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import socket
import sys
import threading
import time
import uuid

import pytest
from hypothesis import HealthCheck, settings

from tests.process_helpers import free_port
from workers.broker.local import kafka_version
from workers.kafka.settings import KafkaSettings

# Property tests keep their random examples, but a slow or busy machine (2 shared cores
# in CI, a broker and workers running beside them) must not fail them for slowness.
settings.register_profile("genpipe", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("genpipe")

TEST_BROKER_PORT = int(os.environ.get("GENPIPE_TEST_BROKER_PORT", "19092"))
# Our Kafka image (ops/kafka/Dockerfile; configured like apache/kafka, see below).
TEST_KAFKA_IMAGE = os.environ.get("GENPIPE_TEST_KAFKA_IMAGE", f"genpipe/kafka:{kafka_version()}")
# The container's broker: clients in the container use PLAINTEXT (:9092), the tests reach
# EXTERNAL (:9094) through a host port; settings as the local broker's (broker/local.py).
TEST_KAFKA_ENV = {
    "CLUSTER_ID": "Z2VucGlwZS10ZXN0LWthZmthMQ",
    "KAFKA_NODE_ID": "1",
    "KAFKA_PROCESS_ROLES": "broker,controller",
    "KAFKA_CONTROLLER_QUORUM_VOTERS": "1@localhost:9093",
    "KAFKA_LISTENERS": "PLAINTEXT://:9092,CONTROLLER://:9093,EXTERNAL://:9094",
    "KAFKA_LISTENER_SECURITY_PROTOCOL_MAP": "CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT,EXTERNAL:PLAINTEXT",
    "KAFKA_CONTROLLER_LISTENER_NAMES": "CONTROLLER",
    "KAFKA_INTER_BROKER_LISTENER_NAME": "PLAINTEXT",
    "KAFKA_OFFSETS_TOPIC_REPLICATION_FACTOR": "1",
    "KAFKA_OFFSETS_TOPIC_NUM_PARTITIONS": "4",
    "KAFKA_TRANSACTION_STATE_LOG_REPLICATION_FACTOR": "1",
    "KAFKA_TRANSACTION_STATE_LOG_MIN_ISR": "1",
    "KAFKA_SHARE_COORDINATOR_STATE_TOPIC_REPLICATION_FACTOR": "1",
    "KAFKA_SHARE_COORDINATOR_STATE_TOPIC_MIN_ISR": "1",
    "KAFKA_GROUP_INITIAL_REBALANCE_DELAY_MS": "0",
    "KAFKA_AUTO_CREATE_TOPICS_ENABLE": "false",
    "KAFKA_HEAP_OPTS": "-Xms256m -Xmx512m",
}


def _docker_socket_connects() -> bool:
    # docker-py leaks its socket when the engine is absent (an unraisable ResourceWarning
    # later, in whichever test runs then), so test the endpoint with a plain socket first.
    host = os.environ.get("DOCKER_HOST") or "unix:///var/run/docker.sock"
    try:
        if host.startswith("unix://"):
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.settimeout(1)
                sock.connect(host[len("unix://"):])
            return True
        if host.startswith("tcp://"):
            address, _, port = host[len("tcp://"):].rstrip("/").rpartition(":")
            with socket.create_connection((address, int(port)), timeout=1):
                return True
    except (OSError, ValueError):
        return False
    return True  # ssh:// and friends: let docker-py judge


def _docker_kafka_image() -> str | None:
    """Why the testcontainers path cannot be used here, or None when it can: a Docker
    engine answers within ~2 s and has the Kafka image (pulling it needs a registry)."""
    if not _docker_socket_connects():
        return "no Docker engine answers"
    try:
        import docker
        from docker.errors import DockerException, ImageNotFound

        client = docker.from_env(timeout=2)
        try:
            client.ping()
            client.images.get(TEST_KAFKA_IMAGE)
            return None
        except ImageNotFound:
            return f"the Docker engine has no image {TEST_KAFKA_IMAGE} (GENPIPE_TEST_KAFKA_IMAGE)"
        finally:
            client.close()
    except (DockerException, OSError) as exc:
        return f"Docker did not answer: {exc}"



def _docker_kafka():
    """Run TEST_KAFKA_IMAGE with testcontainers; yield its bootstrap servers, then stop it."""
    # Read by testcontainers at import: no Ryuk reaper (its image needs a pull); we stop
    # the container ourselves. Clients use 127.0.0.1 and the mapped port, never the
    # address get_container_host_ip() gives (the Docker bridge's).
    os.environ.setdefault("TESTCONTAINERS_RYUK_DISABLED", "true")
    from testcontainers.core.container import DockerContainer
    from testcontainers.core.wait_strategies import LogMessageWaitStrategy

    from workers.broker.local import answers

    port = free_port()
    env = dict(TEST_KAFKA_ENV, KAFKA_ADVERTISED_LISTENERS=f"PLAINTEXT://localhost:9092,EXTERNAL://127.0.0.1:{port}")
    container = (DockerContainer(TEST_KAFKA_IMAGE, env=env)
                 .with_bind_ports(9094, port)
                 .waiting_for(LogMessageWaitStrategy("Kafka Server started").with_startup_timeout(120)))
    container.ports["9094"] = ("127.0.0.1", port)  # docker-py's form: publish on loopback only
    with container:
        deadline = time.monotonic() + 30  # the log line comes just before it answers
        while not answers(port, timeout=2):
            if time.monotonic() > deadline:
                pytest.fail(f"{TEST_KAFKA_IMAGE} logged that it started but 127.0.0.1:{port} does "
                            f"not answer as Kafka; its log:\n{container.get_logs()[0].decode()[-3000:]}",
                            pytrace=False)
            time.sleep(0.25)
        print(f"\nKafka for the tests: {TEST_KAFKA_IMAGE} in Docker on 127.0.0.1:{port}", file=sys.stderr)
        yield f"127.0.0.1:{port}"


@pytest.fixture(scope="session")
def kafka_bootstrap():
    """Bootstrap servers (str) of the session's Kafka broker."""
    env = os.environ.get("GENPIPE_BOOTSTRAP_SERVERS")
    if env:
        yield env
        _delete_test_topics(_base_settings(env))
        return
    choice = os.environ.get("GENPIPE_TEST_KAFKA", "auto")
    if choice not in ("auto", "docker", "local"):
        pytest.fail(f"GENPIPE_TEST_KAFKA={choice!r}: expected auto, docker or local", pytrace=False)
    why_not = _docker_kafka_image() if choice != "local" else "GENPIPE_TEST_KAFKA=local"
    if why_not is None:
        yield from _docker_kafka()
        return
    if choice == "docker":
        pytest.fail(f"GENPIPE_TEST_KAFKA=docker, but {why_not}", pytrace=False)
    if why_not != "no Docker engine answers" and choice == "auto":
        print(f"\nKafka for the tests: the local broker, because {why_not}", file=sys.stderr)

    from workers.broker.local import BrokerError, broker_down, broker_up

    try:
        info = broker_up(port=TEST_BROKER_PORT, timeout=120, quiet=True)
    except BrokerError as exc:
        pytest.fail(f"no Kafka for the tests (set GENPIPE_BOOTSTRAP_SERVERS, run a Docker "
                    f"engine, or fix the local broker): {exc}", pytrace=False)
    try:
        yield info.bootstrap_servers
        _delete_test_topics(_base_settings(info.bootstrap_servers))
    finally:
        if not info.reused:  # leave a broker someone else started alone
            broker_down(port=TEST_BROKER_PORT)


# The topic prefixes this session's tests were given: their topics go at the session's end.
_TEST_PREFIXES: list[str] = []


def _delete_test_topics(settings: KafkaSettings) -> None:
    """Delete the topics this session's tests made (each under its test's prefix). The
    local test broker keeps its data in the genpipe cache across sessions: a developer's
    had ~5,000 topics after a few weeks, and its whole-cluster metadata answers took
    0.1-0.8 s (BENCHMARKS.md, "Lone records in lanes, a topic looked up once"). Topics of
    other sessions, and any made without a test prefix, are left alone; a failure is said,
    never a test's."""
    prefixes = tuple(_TEST_PREFIXES)
    if not prefixes:
        return
    from workers.kafka.clients import make_admin

    async def delete() -> int:
        admin = make_admin(settings)
        await admin.start()
        try:
            names = [t for t in await admin.list_topics() if t.startswith(prefixes)]
            failed = []
            for i in range(0, len(names), 500):
                response = await admin.delete_topics(names[i:i + 500], timeout_ms=30000)
                failed += [(topic, code) for topic, code, *_ in response.topic_error_codes if code]
            if failed:
                raise RuntimeError(f"{len(failed)} of {len(names)} not deleted, e.g. {failed[0][0]} "
                                   f"(error code {failed[0][1]})")
            return len(names)
        finally:
            await admin.close()

    try:
        asyncio.run(asyncio.wait_for(delete(), 120))
    except Exception as exc:  # (the tests are over: their verdicts stand)
        print(f"\nthe tests' topics were left on {settings.bootstrap_servers}: {exc!r}", file=sys.stderr)


@pytest.fixture
def kafka_settings(kafka_bootstrap) -> KafkaSettings:
    """Settings for the session broker with a topic prefix unique to this test."""
    prefix = f"test-{uuid.uuid4().hex[:10]}"
    _TEST_PREFIXES.append(prefix)
    return dataclasses.replace(_base_settings(kafka_bootstrap), topic_prefix=prefix)


def _base_settings(bootstrap_servers: str) -> KafkaSettings:
    # SASL/SSL settings only make sense for the broker GENPIPE_BOOTSTRAP_SERVERS names.
    base = KafkaSettings.from_env() if os.environ.get("GENPIPE_BOOTSTRAP_SERVERS") else KafkaSettings()
    return dataclasses.replace(base, bootstrap_servers=bootstrap_servers)


async def create_test_topics(settings: KafkaSettings, partitions: int = 8):
    """Create the six topics for ``settings``; returns the TopicsReport."""
    from workers.broker.topics import create_topics

    return await create_topics(settings, partitions=partitions)


@pytest.fixture
def make_topics():
    """``await make_topics(settings, partitions=8)`` creates the six topics."""
    return create_test_topics


@pytest.fixture(scope="session")
def tiny_model_dir():
    """The built-in tiny spm model (built once into the genpipe cache)."""
    from workers.models.tinymodel import default_model_dir

    return default_model_dir("spm")


@pytest.fixture
def loop():
    """An event loop running on a thread of its own, as a worker's is beside its engine
    threads; a test may stop and close it itself."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield loop
    if not loop.is_closed():
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()
