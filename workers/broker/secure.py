"""The local broker with TLS, SASL/SCRAM and ACLs on loopback (`genpipe broker up --secure`).

What a production cluster has and a development broker usually lacks, so that the
workers, the client and the deployment's ACLs (README, "Security") are tried for real:

- clients connect with SASL_SSL (SCRAM-SHA-512) on the port; certificates come from a
  CA made here with `openssl` (its certificate is `ca.crt`, for `--ssl-cafile`);
- users are made when the storage is formatted: `admin` (super user) and one per role
  (`generate`, `derender`, `client`, `stranger`), passwords random, kept in
  `<data dir>/secure/users.json` (mode 0600);
- the StandardAuthorizer denies what no ACL allows; `acls_for()` is the deployment's
  ACL set as data, and `grant()` creates it (as admin).

The controller listener stays PLAINTEXT on 127.0.0.1 (KRaft cannot authenticate it with
SCRAM, whose credentials live in the metadata it serves), and the broker talks to itself
over a SASL_PLAINTEXT listener as admin.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import subprocess
from dataclasses import dataclass
from pathlib import Path

from workers.kafka.settings import KafkaSettings

MECHANISM = "SCRAM-SHA-512"
USERS = ("admin", "generate", "derender", "client", "stranger")

# Kafka's wire codes (org.apache.kafka.common.acl / resource).
_RESOURCE = {"topic": 2, "group": 3}
_PATTERN = {"literal": 3, "prefixed": 4}
_OPERATION = {"read": 3, "write": 4, "describe": 8}
_ALLOW = 3


class SecureBrokerError(RuntimeError):
    """A failure the CLI reports as one line."""


@dataclass(frozen=True)
class Acl:
    principal: str  # "User:generate"
    resource: str  # "topic" | "group"
    name: str
    pattern: str  # "literal" | "prefixed"
    operation: str  # "read" | "write" | "describe"


@dataclass(frozen=True)
class SecureFiles:
    directory: Path
    cafile: Path
    keystore: Path
    store_password: str
    passwords: dict[str, str]

    def settings(self, user: str, port: int, topic_prefix: str = "genpipe") -> KafkaSettings:
        """Client settings of one user of this broker."""
        return KafkaSettings(bootstrap_servers=f"127.0.0.1:{port}", topic_prefix=topic_prefix,
                             client_id=f"genpipe-{user}", security_protocol="SASL_SSL",
                             sasl_mechanism=MECHANISM, sasl_plain_username=user,
                             sasl_plain_password=self.passwords[user], ssl_cafile=str(self.cafile))


def acls_for(prefix: str, *, generate: str = "generate", derender: str = "derender",
             clients: dict[str, str] | None = None) -> list[Acl]:
    """The ACLs a deployment with topic prefix `prefix` needs (the README's table):
    each worker reads its input and writes its outputs; a client (user -> tenant) writes
    requests and cancels and reads only its own reply topic `<prefix>.reply.<tenant>`."""
    def allow(user, resource, name, pattern, *operations):
        return [Acl(f"User:{user}", resource, name, pattern, op) for op in operations]

    t = f"{prefix}."
    acls = [
        *allow(generate, "topic", t + "requests", "literal", "read", "describe"),
        *allow(generate, "topic", t + "requests.bulk", "literal", "read", "describe"),
        *allow(generate, "topic", t + "cancel", "literal", "read", "describe"),
        *allow(generate, "topic", t + "chunks", "literal", "write", "describe"),
        *allow(generate, "topic", t + "dlq", "literal", "write", "describe"),
        *allow(generate, "group", f"{prefix}-generate", "literal", "read", "describe"),
        *allow(derender, "topic", t + "chunks", "literal", "read", "describe"),
        *allow(derender, "topic", t + "results", "literal", "write", "describe"),
        *allow(derender, "topic", t + "reply.", "prefixed", "write", "describe"),
        *allow(derender, "topic", t + "cancel", "literal", "write", "describe"),
        *allow(derender, "topic", t + "dlq", "literal", "write", "describe"),
        *allow(derender, "group", f"{prefix}-derender", "literal", "read", "describe"),
    ]
    for user, tenant in (clients or {}).items():
        acls += allow(user, "topic", t + "requests", "literal", "write", "describe")
        acls += allow(user, "topic", t + "requests.bulk", "literal", "write", "describe")
        acls += allow(user, "topic", t + "cancel", "literal", "write", "describe")
        acls += allow(user, "topic", f"{t}reply.{tenant}", "literal", "read", "describe")
    return acls


async def grant(admin_settings: KafkaSettings, acls: list[Acl]) -> None:
    """Create `acls` on the broker, as a user allowed to (admin)."""
    # aiokafka's admin client has no create_acls(); its protocol module has the request,
    # sent here one binding at a time (a handful per deployment).
    from aiokafka.protocol.admin import CreateAclsRequest

    from workers.kafka.clients import make_admin

    admin = make_admin(admin_settings.with_client_id("genpipe-acls"))
    await admin.start()
    try:
        for acl in acls:
            response = await admin._send_request(CreateAclsRequest(
                _RESOURCE[acl.resource], acl.name, _PATTERN[acl.pattern], acl.principal, "*",
                _OPERATION[acl.operation], _ALLOW))
            for code, message in response.creation_responses:
                if code:
                    raise SecureBrokerError(f"creating ACL {acl} failed: error {code} {message or ''}".strip())
    finally:
        await admin.close()


def prepare(data_dir: Path) -> SecureFiles:
    """Certificates, keystore and user passwords under `data_dir/secure` (made once,
    reused after: the formatted storage holds the users' SCRAM credentials)."""
    directory = data_dir / "secure"
    directory.mkdir(parents=True, exist_ok=True)
    os.chmod(directory, 0o700)
    users_file = directory / "users.json"
    if users_file.exists():
        saved = json.loads(users_file.read_text())
    else:
        saved = {"store_password": secrets.token_urlsafe(16),
                 "passwords": {user: secrets.token_urlsafe(16) for user in USERS}}
        users_file.touch(mode=0o600)
        users_file.write_text(json.dumps(saved, indent=1) + "\n")
    files = SecureFiles(directory, directory / "ca.crt", directory / "broker.p12", saved["store_password"],
                        saved["passwords"])
    if not files.keystore.exists():
        _make_certificates(files)
    return files


def _make_certificates(files: SecureFiles) -> None:
    d = files.directory
    san = d / "san.cnf"
    # The extensions strict verification asks for (Python 3.13's default context: a CA
    # without keyUsage failed every handshake, reported as a broker that did not answer)
    san.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\nkeyUsage=critical,digitalSignature,keyEncipherment\n"
                   "extendedKeyUsage=serverAuth\nauthorityKeyIdentifier=keyid\n")
    steps = [
        ["req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt",
         "-days", "3650", "-subj", "/CN=genpipe local CA", "-addext", "basicConstraints=critical,CA:TRUE",
         "-addext", "keyUsage=critical,keyCertSign,cRLSign"],
        ["req", "-newkey", "rsa:2048", "-nodes", "-keyout", "broker.key", "-out", "broker.csr",
         "-subj", "/CN=localhost"],
        ["x509", "-req", "-in", "broker.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
         "-out", "broker.crt", "-days", "3650", "-extfile", str(san)],
        ["pkcs12", "-export", "-in", "broker.crt", "-inkey", "broker.key", "-certfile", "ca.crt",
         "-out", "broker.p12.tmp", "-passout", "env:GENPIPE_KEYSTORE_PASSWORD"],  # (not in the process list)
    ]
    for args in steps:
        try:
            proc = subprocess.run(["openssl", *args], cwd=d, capture_output=True, text=True,
                                  env={**os.environ, "GENPIPE_KEYSTORE_PASSWORD": files.store_password})
        except FileNotFoundError:
            raise SecureBrokerError("openssl not found on PATH: it makes the broker's certificates "
                                    "(apt-get install openssl)") from None
        if proc.returncode != 0:
            raise SecureBrokerError(f"openssl {args[0]} failed: {proc.stderr.strip().splitlines()[-1:]}")
    (d / "broker.p12.tmp").rename(files.keystore)
    for name in ("ca.key", "broker.key"):
        os.chmod(d / name, 0o600)


def server_properties(base: str, files: SecureFiles, port: int, internal_port: int) -> str:
    """`base` (the plain broker's server.properties) with SASL_SSL on the client port."""
    replaced = ("listeners=", "advertised.listeners=", "listener.security.protocol.map=",
                "inter.broker.listener.name=")
    lines = [line for line in base.splitlines() if not line.startswith(replaced)]
    admin_password = files.passwords["admin"]
    cport = next(line for line in base.splitlines() if line.startswith("controller.quorum.voters=")).rsplit(":", 1)[1]
    lines += [
        "# --secure: SASL_SSL (SCRAM) for clients, SASL_PLAINTEXT for the broker itself,",
        "# PLAINTEXT for the KRaft controller (loopback only); ACLs enforced.",
        f"listeners=SASL_SSL://127.0.0.1:{port},INTERNAL://127.0.0.1:{internal_port},"
        f"CONTROLLER://127.0.0.1:{cport}",
        f"advertised.listeners=SASL_SSL://127.0.0.1:{port},INTERNAL://127.0.0.1:{internal_port}",
        "listener.security.protocol.map=CONTROLLER:PLAINTEXT,INTERNAL:SASL_PLAINTEXT,SASL_SSL:SASL_SSL",
        "inter.broker.listener.name=INTERNAL",
        f"sasl.enabled.mechanisms={MECHANISM}",
        f"sasl.mechanism.inter.broker.protocol={MECHANISM}",
        "listener.name.internal.scram-sha-512.sasl.jaas.config=org.apache.kafka.common.security.scram."
        f'ScramLoginModule required username="admin" password="{admin_password}";',
        "listener.name.sasl_ssl.scram-sha-512.sasl.jaas.config=org.apache.kafka.common.security.scram."
        "ScramLoginModule required;",
        "ssl.keystore.type=PKCS12",
        f"ssl.keystore.location={files.keystore}",
        f"ssl.keystore.password={files.store_password}",
        f"ssl.key.password={files.store_password}",
        "authorizer.class.name=org.apache.kafka.metadata.authorizer.StandardAuthorizer",
        # ANONYMOUS is the controller listener's principal (loopback PLAINTEXT only).
        "super.users=User:admin;User:ANONYMOUS",
        "allow.everyone.if.no.acl.found=false",
    ]
    return "\n".join(lines) + "\n"


def format_arguments(files: SecureFiles) -> list[str]:
    """`kafka.tools.StorageTool format` arguments that create the SCRAM users."""
    args = []
    for user, password in files.passwords.items():
        args += ["--add-scram", f"{MECHANISM}=[name={user},password={password}]"]
    return args


def grant_now(admin_settings: KafkaSettings, acls: list[Acl]) -> None:
    asyncio.run(grant(admin_settings, acls))
