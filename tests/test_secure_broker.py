"""genpipe against a secured broker: TLS, SASL/SCRAM users and ACLs on loopback
(`genpipe broker up --secure`). Each worker and the client use their own user; the ACLs
are the deployment's (README, Security), so a missing grant fails here first."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time
import uuid

import pytest
from aiokafka.admin import NewTopic
from aiokafka.errors import ClusterAuthorizationFailedError, TopicAuthorizationFailedError

from workers.broker.secure import acls_for, grant
from workers.broker.topics import create_topics
from workers.cli import main
from workers.client import GenpipeClient, make_request
from workers.kafka.clients import make_admin

pytestmark = [pytest.mark.kafka, pytest.mark.slow]
PORT = int(os.environ.get("GENPIPE_TEST_SECURE_PORT", "19392"))  # and PORT+1, PORT+2


@pytest.fixture(scope="module")
def secure_broker(tmp_path_factory):
    from workers.broker.local import BrokerError, broker_down, broker_up

    data_dir = tmp_path_factory.mktemp("secure-broker")
    try:
        info = broker_up(port=PORT, data_dir=data_dir, timeout=120, quiet=True, secure=True)
    except BrokerError as exc:
        pytest.fail(f"the secure test broker did not start: {exc}", pytrace=False)
    try:
        yield info
    finally:
        broker_down(port=PORT, data_dir=data_dir)


@pytest.fixture
async def deployment(secure_broker):
    """A fresh topic prefix on the secure broker: topics, the tenant's reply topic, ACLs.
    Returns settings(user) -> KafkaSettings."""
    prefix = f"sec-{uuid.uuid4().hex[:8]}"
    files = secure_broker.secure

    def settings(user: str):
        return files.settings(user, secure_broker.port, prefix)

    admin_settings = settings("admin")
    await create_topics(admin_settings, partitions=2)
    admin = make_admin(admin_settings)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(f"{prefix}.reply.client", 2, 1), NewTopic(f"{prefix}.reply.other", 2, 1)])
    finally:
        await admin.close()
    await grant(admin_settings, acls_for(prefix, clients={"client": "client"}))
    return settings


async def test_workers_and_client_work_over_sasl_ssl_with_their_own_users(deployment, tiny_model_dir):
    from workers.derender.service import DerenderWorkerConfig, run_derender_worker
    from workers.generate.engine import Engine
    from workers.generate.service import GenerateWorkerConfig, run_generate_worker

    gen_settings, der_settings, client_settings = (deployment(u) for u in ("generate", "derender", "client"))
    prefix = gen_settings.topic_prefix
    stop = asyncio.Event()
    ready = [asyncio.Event(), asyncio.Event()]
    gen = asyncio.ensure_future(run_generate_worker(
        gen_settings, GenerateWorkerConfig(group_id=f"{prefix}-generate", max_batch=4),
        engine=Engine(str(tiny_model_dir), max_batch=4), stop=stop, on_ready=ready[0].set))
    der = asyncio.ensure_future(run_derender_worker(
        der_settings, DerenderWorkerConfig(tokenizer=str(tiny_model_dir), group_id=f"{prefix}-derender"),
        stop=stop, on_ready=ready[1].set))
    try:
        await asyncio.wait_for(asyncio.gather(ready[0].wait(), ready[1].wait()), 90)
        async with GenpipeClient(settings=client_settings, reply_topic=f"{prefix}.reply.client", timeout_s=60) as client:
            streamed = [item async for item in client.stream(make_request(
                [1, 5, 6, 7], kind="completion", max_tokens=5, temperature=0, ignore_eos=True, stream=True))]
            final = await client.complete(make_request([1, 8, 9], kind="chat", max_tokens=3, temperature=0,
                                                       ignore_eos=True))
    finally:
        stop.set()
    assert await asyncio.wait_for(gen, 60) == 0 and await asyncio.wait_for(der, 60) == 0
    assert streamed[-1].choices[0].finish_reason == "length"
    assert final.choices[0].finish_reason == "length" and final.usage.completion_tokens == 3


async def test_a_client_cannot_read_another_tenants_reply_topic(deployment):
    client_settings = deployment("client")
    started = time.monotonic()
    with pytest.raises(TopicAuthorizationFailedError):
        async with GenpipeClient(settings=client_settings, reply_topic=f"{client_settings.topic_prefix}.reply.other"):
            pass
    assert time.monotonic() - started < 20  # refused, not a 30 s "does not exist"
    # A user without any grant cannot even start a producer (no write anywhere: no
    # idempotent producer id), let alone read.
    stranger = deployment("stranger")
    with pytest.raises((TopicAuthorizationFailedError, ClusterAuthorizationFailedError)):
        async with GenpipeClient(settings=stranger, reply_topic=f"{stranger.topic_prefix}.reply.client"):
            pass


async def test_wrong_credentials_are_one_clear_line_not_a_hang(deployment, tiny_model_dir, capsys):
    settings = dataclasses.replace(deployment("client"), sasl_plain_password="wrong")
    args = ["--bootstrap-servers", settings.bootstrap_servers, "--topic-prefix", settings.topic_prefix,
            "--security-protocol", "SASL_SSL", "--sasl-mechanism", settings.sasl_mechanism,
            "--sasl-username", "client", "--sasl-password", "wrong", "--ssl-cafile", settings.ssl_cafile]
    started = time.monotonic()
    rc = await asyncio.to_thread(main, ["submit", *args, "--token-ids", "1,2,3", "--timeout", "30"])
    err = capsys.readouterr().err
    assert rc == 1 and time.monotonic() - started < 20
    lines = [line for line in err.splitlines() if line.startswith("genpipe submit:")]
    assert len(lines) == 1 and "refused the login of user 'client'" in lines[0], err
    rc = await asyncio.to_thread(main, ["derender-worker", *args, "--tokenizer", str(tiny_model_dir)])
    err = capsys.readouterr().err
    assert rc == 1
    assert [line for line in err.splitlines() if "error:" in line] == [
        f"genpipe derender-worker: error: Kafka at {settings.bootstrap_servers} refused the login of user "
        f"'client' (SCRAM-SHA-512): check --sasl-username / --sasl-password"], err


async def test_a_client_that_may_not_describe_the_worker_groups_does_not_call_them_missing(deployment):
    """Describing a group needs a grant the clients and the gateway do not have by
    default (README, Security): the broker answers GROUP_AUTHORIZATION_FAILED for the
    group, which read as "no members". The gateway's /health then said 503 for good (a
    load balancer sent it nothing) and `genpipe submit` said no worker was running. Now
    such a group cannot be told: not missing, -1 members."""
    from workers.kafka.groups import group_members, missing_workers

    client = deployment("client")
    prefix = client.topic_prefix
    groups = [f"{prefix}-generate", f"{prefix}-derender"]
    assert await group_members(client, groups) == dict.fromkeys(groups, -1)
    assert await missing_workers(client, raise_errors=True) == []
    # the workers' own users may describe their groups: none runs, and that is said
    assert await missing_workers(deployment("generate"), {groups[0]: "generate"}, raise_errors=True) == [
        f"no generate worker (consumer group {groups[0]} has no members)"]


def test_the_broker_s_certificates_pass_strict_verification(secure_broker):
    """Python 3.13's default TLS context verifies strictly (VERIFY_X509_STRICT): the
    local CA had no keyUsage, every handshake failed, and `broker up --secure` waited 60 s
    for a broker that "did not answer". openssl's strict check is the same one."""
    import subprocess

    files = secure_broker.secure
    out = subprocess.run(["openssl", "verify", "-x509_strict", "-CAfile", str(files.cafile),
                          str(files.directory / "broker.crt")], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def test_the_secure_broker_s_config_is_readable_by_its_user_alone(secure_broker):
    """Its server.properties holds the admin user's and the keystore's passwords, and was
    written readable by every user of the machine (0644), beside a users.json kept 0600."""
    mode = (secure_broker.data_dir / "server.properties").stat().st_mode & 0o777
    assert mode == 0o600, oct(mode)
