"""The local broker's life cycle and `genpipe topics create` idempotency."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from workers.kafka.settings import TOPIC_ROLES

pytestmark = pytest.mark.kafka

# Not the session fixture's port (19092) nor the default (9092): this test starts and
# stops its own broker and must not disturb a broker other tests are using.
LIFECYCLE_PORT = 29092


def genpipe(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run the real CLI in a child process (as a user would), capturing its output."""
    return subprocess.run([sys.executable, "-m", "workers.cli", *args], capture_output=True,
                          text=True, timeout=timeout, cwd=Path(__file__).resolve().parents[1])


def wait_until(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)


def pid_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.skipif(not (shutil.which("java") and shutil.which("mvn")),
                    reason="the local broker needs java and mvn")
def test_broker_up_reuse_status_down(tmp_path):
    from workers.broker import local

    data_dir = tmp_path / "broker"
    cli_opts = ("--port", str(LIFECYCLE_PORT), "--data-dir", str(data_dir))
    if local.answers(LIFECYCLE_PORT):
        pytest.skip(f"something already answers on port {LIFECYCLE_PORT}")

    first = local.broker_up(port=LIFECYCLE_PORT, data_dir=data_dir, timeout=120, quiet=True)
    try:
        assert not first.reused and first.pid is not None
        assert first.bootstrap_servers == f"127.0.0.1:{LIFECYCLE_PORT}"
        assert (data_dir / "broker.pid").read_text().strip() == str(first.pid)
        assert (data_dir / "kraft" / "meta.properties").exists()  # formatted on first start

        # Second `up`, in-process and through the CLI: reuse, start nothing.
        second = local.broker_up(port=LIFECYCLE_PORT, data_dir=data_dir, quiet=True)
        assert second.reused and second.pid == first.pid
        out = genpipe("broker", "up", *cli_opts)
        assert out.returncode == 0, out.stderr
        assert f"broker already answering on 127.0.0.1:{LIFECYCLE_PORT} — reusing it" in out.stdout
        assert f"pid {first.pid}" in out.stdout

        status = local.broker_status(port=LIFECYCLE_PORT, data_dir=data_dir)
        assert (status.state, status.pid) == ("running", first.pid)
        out = genpipe("broker", "status", *cli_opts)
        assert out.returncode == 0 and f"running on 127.0.0.1:{LIFECYCLE_PORT}" in out.stdout
        assert f"pid {first.pid}" in out.stdout
    finally:
        message = local.broker_down(port=LIFECYCLE_PORT, data_dir=data_dir)

    assert f"(pid {first.pid}) stopped" in message
    wait_until(lambda: not pid_exists(first.pid), 10, f"pid {first.pid} to disappear")
    assert not Path(f"/proc/{first.pid}").exists()
    assert not (data_dir / "broker.pid").exists()
    assert not local.answers(LIFECYCLE_PORT)
    assert local.broker_status(port=LIFECYCLE_PORT, data_dir=data_dir).state == "stopped"

    out = genpipe("broker", "status", *cli_opts)
    assert out.returncode == 1 and "no broker on" in out.stdout
    out = genpipe("broker", "down", *cli_opts)  # nothing to stop is not an error
    assert out.returncode == 0 and "no genpipe broker recorded" in out.stdout


@pytest.mark.skipif(not (shutil.which("java") and shutil.which("mvn")),
                    reason="the local broker needs java and mvn")
def test_two_broker_ups_at_once_start_one_broker_that_down_stops(tmp_path):
    """Two `broker up` on one data dir at once (two test sessions sharing the cache)
    both formatted and launched: the second broker died, its pid file replaced the
    first's, it still said "broker up", and `broker down` found nothing to stop while the
    first broker ran on. One waits for the other now, and reuses its broker."""
    import concurrent.futures

    from workers.broker import local

    data_dir = tmp_path / "broker"
    cli_opts = ("--port", str(LIFECYCLE_PORT), "--data-dir", str(data_dir))
    if local.answers(LIFECYCLE_PORT):
        pytest.skip(f"something already answers on port {LIFECYCLE_PORT}")
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        outs = list(pool.map(lambda _: genpipe("broker", "up", *cli_opts), range(2)))
    pid = None
    try:
        assert [o.returncode for o in outs] == [0, 0], [o.stderr for o in outs]
        pid = int((data_dir / "broker.pid").read_text())
        said = sorted(o.stdout.split(" (pid ")[0] for o in outs)
        assert said == [f"broker already answering on 127.0.0.1:{LIFECYCLE_PORT} — reusing it",
                        f"broker up on 127.0.0.1:{LIFECYCLE_PORT}"], said
        assert all(f"(pid {pid}" in o.stdout for o in outs)
    finally:
        down = genpipe("broker", "down", *cli_opts)
    assert down.returncode == 0 and f"(pid {pid}) stopped" in down.stdout, down.stdout
    wait_until(lambda: not pid_exists(pid), 10, f"pid {pid} to disappear")
    assert not local.answers(LIFECYCLE_PORT)


async def _partition_counts(settings) -> dict[str, int]:
    from aiokafka.admin import AIOKafkaAdminClient

    admin = AIOKafkaAdminClient(**settings.client_kwargs())
    await admin.start()
    try:
        names = [settings.topic(role) for role in TOPIC_ROLES]
        listed = set(await admin.list_topics())
        return {t["topic"]: len(t["partitions"])
                for t in await admin.describe_topics(names) if t["topic"] in listed}
    finally:
        await admin.close()


def _topics_cli(settings, *extra: str) -> subprocess.CompletedProcess:
    # The child takes SASL/SSL settings from the same GENPIPE_* variables as the fixture.
    return genpipe("topics", "create", "--bootstrap-servers", settings.bootstrap_servers,
                   "--topic-prefix", settings.topic_prefix, *extra)


async def test_topics_create_cli_is_idempotent(kafka_settings):
    names = [kafka_settings.topic(role) for role in TOPIC_ROLES]
    reply = f"{kafka_settings.topic_prefix}.reply.team-a"  # given twice: it failed the whole creation
    first = await asyncio.to_thread(_topics_cli, kafka_settings, "--partitions", "3", "--topic", reply,
                                    "--topic", reply)
    assert first.returncode == 0, first.stderr
    assert [f"created {n} (3 partitions)" for n in [*names, reply]] == first.stdout.splitlines()

    # Asking again (even with another count) changes nothing and says so.
    second = await asyncio.to_thread(_topics_cli, kafka_settings, "--partitions", "5")
    assert second.returncode == 0, second.stderr
    assert [f"exists  {n} (3 partitions)" for n in names] == second.stdout.splitlines()

    assert await _partition_counts(kafka_settings) == {n: 3 for n in names}

    # --grow adds partitions (Kafka never shrinks), results first and requests last.
    grown = await asyncio.to_thread(_topics_cli, kafka_settings, "--partitions", "5", "--grow")
    assert grown.returncode == 0, grown.stderr
    assert [f"grown   {n} (3 -> 5 partitions)" for n in names] == sorted(
        grown.stdout.splitlines(), key=lambda line: names.index(line.split()[1]))
    assert await _partition_counts(kafka_settings) == {n: 5 for n in names}
    again = await asyncio.to_thread(_topics_cli, kafka_settings, "--partitions", "4", "--grow")
    assert [f"exists  {n} (5 partitions)" for n in names] == again.stdout.splitlines()


async def test_create_topics_reports_created_then_existed(kafka_settings, make_topics):
    names = [kafka_settings.topic(role) for role in TOPIC_ROLES]
    first = await make_topics(kafka_settings, partitions=2)
    assert (first.created, first.existed) == (names, [])
    assert first.partitions == {n: 2 for n in names}
    second = await make_topics(kafka_settings, partitions=2)
    assert (second.created, second.existed) == ([], names)
    assert await _partition_counts(kafka_settings) == {n: 2 for n in names}


async def test_topics_create_says_when_an_existing_chunks_topic_keeps_the_producers_times(kafka_settings,
                                                                                           make_topics):
    """A chunks topic made before genpipe set LogAppendTime on it (or by hand) keeps the
    producers' times, which the derender's stalled-request check then reads; `topics
    create` leaves existing topics alone, so it says what to set."""
    from tests.kafka_helpers import set_topic_config

    chunks = kafka_settings.topic("chunks")
    await make_topics(kafka_settings, partitions=1)
    ours = await asyncio.to_thread(_topics_cli, kafka_settings, "--partitions", "1")
    assert ours.returncode == 0 and "warning" not in ours.stderr, ours.stderr
    await set_topic_config(kafka_settings, chunks, {"message.timestamp.type": "CreateTime"})
    older = await asyncio.to_thread(_topics_cli, kafka_settings, "--partitions", "1")
    assert older.returncode == 0, older.stderr
    assert f"warning: {chunks} exists with message.timestamp.type=CreateTime" in older.stderr
    assert (f"kafka-configs.sh --bootstrap-server {kafka_settings.bootstrap_servers} --alter --entity-type topics "
            f"--entity-name {chunks} --add-config message.timestamp.type=LogAppendTime") in older.stderr


def test_broker_commands_answer_bad_input_with_one_line(tmp_path):
    """A data dir that is a file was a traceback; a port past 65535 was probed modulo
    65536 (`status --port 84628` looked at someone's 19092); a pid file of garbage was
    reported removed and stayed, so every later command said so again."""
    a_file = tmp_path / "file"
    a_file.write_text("x")
    out = genpipe("broker", "status", "--data-dir", str(a_file), "--port", "39999")
    assert out.returncode == 1 and out.stderr.startswith("error: ") and len(out.stderr.splitlines()) == 1
    out = genpipe("broker", "status", "--port", "84628")
    assert out.returncode == 2 and "argument --port: must be a port number, at most 65535, got 84628" in out.stderr
    data_dir = tmp_path / "broker"
    data_dir.mkdir()
    (data_dir / "broker.pid").write_text("garbage")
    out = genpipe("broker", "down", "--data-dir", str(data_dir), "--port", "39999")
    assert out.returncode == 0 and "removed stale pid file" in out.stdout
    assert not (data_dir / "broker.pid").exists()


def test_a_cluster_whose_last_node_s_port_is_taken_starts_no_node(tmp_path):
    """`broker up --brokers 3` found node 3's port taken only after nodes 1 and 2 were
    launched, and left them running (two JVMs nobody had asked for). Every port is
    checked first now: nothing starts."""
    import socket

    port = 39400
    taken = socket.socket()
    taken.bind(("127.0.0.1", port + 4))  # node 3's client port
    taken.listen()
    try:
        out = genpipe("broker", "up", "--brokers", "3", "--port", str(port), "--data-dir", str(tmp_path))
    finally:
        taken.close()
    assert out.returncode == 1 and out.stderr == f"error: 127.0.0.1:{port + 4} (node 3) is in use by something else\n"
    assert not list(tmp_path.glob("node-*/broker.pid"))


def test_topics_create_reports_unreachable_broker():
    out = genpipe("topics", "create", "--bootstrap-servers", "127.0.0.1:1", "--timeout", "5")
    assert out.returncode == 1
    assert out.stderr.startswith("error: cannot create topics on 127.0.0.1:1")
    assert "Traceback" not in out.stderr
