"""One settings object for every Kafka client genpipe makes.

Every command takes the same options (and environment variables), so a worker, the CLI
and the tests all reach a broker the same way. SASL/SSL options are passed through to
aiokafka untouched.
"""

from __future__ import annotations

import argparse
import os
import ssl
from dataclasses import dataclass, field, replace

from workers.cli_options import bootstrap_servers, one_of

DEFAULT_BOOTSTRAP_SERVERS = "127.0.0.1:9092"
DEFAULT_TOPIC_PREFIX = "genpipe"
# The six topics of docs/design.md §2, by role; their names are "<prefix>.<role>".
TOPIC_ROLES = ("requests", "requests.bulk", "chunks", "results", "cancel", "dlq")

# The largest record a worker publishes (value, key and headers). Kafka's defaults refuse
# a record batch over ~1 MiB (broker message.max.bytes, producer max.request.size); this
# leaves room for the batch's own framing. A record over it would be refused by the
# broker after the work was done, and its request would never finish: workers check
# `fits()` first and publish something smaller (a cut chunk, an error) instead.
MAX_RECORD_BYTES = 1_000_000


@dataclass(frozen=True)
class KafkaSettings:
    bootstrap_servers: str = DEFAULT_BOOTSTRAP_SERVERS
    topic_prefix: str = DEFAULT_TOPIC_PREFIX
    client_id: str = "genpipe"
    security_protocol: str = "PLAINTEXT"
    sasl_mechanism: str | None = None
    sasl_plain_username: str | None = None
    sasl_plain_password: str | None = field(default=None, repr=False)  # (a traceback's locals, a log's %r)
    ssl_cafile: str | None = None
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    extra: dict = field(default_factory=dict)

    def topic(self, role: str) -> str:
        if role not in TOPIC_ROLES:
            raise ValueError(f"unknown topic role {role!r}; expected one of {TOPIC_ROLES}")
        return f"{self.topic_prefix}.{role}"

    def with_client_id(self, client_id: str) -> "KafkaSettings":
        return replace(self, client_id=client_id)

    def client_kwargs(self) -> dict:
        """Keyword arguments common to aiokafka producers, consumers and admin clients."""
        kwargs: dict = {
            "bootstrap_servers": self.bootstrap_servers,
            "client_id": self.client_id,
            "security_protocol": self.security_protocol,
        }
        if self.sasl_mechanism:
            kwargs["sasl_mechanism"] = self.sasl_mechanism
            kwargs["sasl_plain_username"] = self.sasl_plain_username
            kwargs["sasl_plain_password"] = self.sasl_plain_password
        if self.security_protocol in ("SSL", "SASL_SSL"):
            context = ssl.create_default_context(cafile=self.ssl_cafile)
            if self.ssl_certfile:
                context.load_cert_chain(self.ssl_certfile, self.ssl_keyfile)
            kwargs["ssl_context"] = context
        kwargs.update(self.extra)
        return kwargs

    @classmethod
    def from_env(cls, environ: dict | None = None) -> "KafkaSettings":
        env = os.environ if environ is None else environ
        return cls(
            bootstrap_servers=env.get("GENPIPE_BOOTSTRAP_SERVERS", DEFAULT_BOOTSTRAP_SERVERS),
            topic_prefix=env.get("GENPIPE_TOPIC_PREFIX", DEFAULT_TOPIC_PREFIX),
            security_protocol=env.get("GENPIPE_SECURITY_PROTOCOL", "PLAINTEXT"),
            sasl_mechanism=env.get("GENPIPE_SASL_MECHANISM") or None,
            sasl_plain_username=env.get("GENPIPE_SASL_USERNAME") or None,
            sasl_plain_password=env.get("GENPIPE_SASL_PASSWORD") or None,
            ssl_cafile=env.get("GENPIPE_SSL_CAFILE") or None,
            ssl_certfile=env.get("GENPIPE_SSL_CERTFILE") or None,
            ssl_keyfile=env.get("GENPIPE_SSL_KEYFILE") or None,
        )

    _ENV = (("GENPIPE_BOOTSTRAP_SERVERS", "bootstrap_servers"), ("GENPIPE_TOPIC_PREFIX", "topic_prefix"),
            ("GENPIPE_SECURITY_PROTOCOL", "security_protocol"), ("GENPIPE_SASL_MECHANISM", "sasl_mechanism"),
            ("GENPIPE_SASL_USERNAME", "sasl_plain_username"), ("GENPIPE_SASL_PASSWORD", "sasl_plain_password"),
            ("GENPIPE_SSL_CAFILE", "ssl_cafile"), ("GENPIPE_SSL_CERTFILE", "ssl_certfile"),
            ("GENPIPE_SSL_KEYFILE", "ssl_keyfile"))

    def to_env(self) -> dict[str, str]:
        """These settings as the GENPIPE_* variables `from_env` reads: how a command hands
        its connection to the commands it starts (not on their command lines, where every
        user of the machine could read a password)."""
        return {name: getattr(self, attr) or "" for name, attr in self._ENV}

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser) -> None:
        """Add the Kafka connection options; defaults come from GENPIPE_* variables."""
        env = KafkaSettings.from_env()
        group = parser.add_argument_group("Kafka connection")
        group.add_argument(
            "--bootstrap-servers", default=env.bootstrap_servers, type=bootstrap_servers,
            help="Kafka bootstrap servers (env GENPIPE_BOOTSTRAP_SERVERS; default %(default)s)")
        group.add_argument(
            "--topic-prefix", default=env.topic_prefix,
            help="prefix of the six genpipe topics (env GENPIPE_TOPIC_PREFIX; default %(default)s)")
        protocols = ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL")
        group.add_argument(
            "--security-protocol", default=env.security_protocol,
            type=one_of(*protocols, fold_case=True), metavar="{" + ",".join(protocols) + "}",
            help="in any case, as Kafka's own clients take it (env GENPIPE_SECURITY_PROTOCOL; "
                 "default %(default)s)")
        group.add_argument("--sasl-mechanism", default=env.sasl_mechanism,
                           help="e.g. PLAIN, SCRAM-SHA-256 (env GENPIPE_SASL_MECHANISM)")
        group.add_argument("--sasl-username", default=env.sasl_plain_username,
                           help="env GENPIPE_SASL_USERNAME")
        group.add_argument("--sasl-password", default=env.sasl_plain_password,
                           help="env GENPIPE_SASL_PASSWORD")
        group.add_argument("--ssl-cafile", default=env.ssl_cafile, help="env GENPIPE_SSL_CAFILE")
        group.add_argument("--ssl-certfile", default=env.ssl_certfile, help="env GENPIPE_SSL_CERTFILE")
        group.add_argument("--ssl-keyfile", default=env.ssl_keyfile, help="env GENPIPE_SSL_KEYFILE")

    @classmethod
    def from_args(cls, args: argparse.Namespace, client_id: str = "genpipe") -> "KafkaSettings":
        return cls(
            bootstrap_servers=args.bootstrap_servers,
            topic_prefix=args.topic_prefix,
            client_id=client_id,
            security_protocol=args.security_protocol,
            sasl_mechanism=args.sasl_mechanism,
            sasl_plain_username=args.sasl_username,
            sasl_plain_password=args.sasl_password,
            ssl_cafile=args.ssl_cafile,
            ssl_certfile=args.ssl_certfile,
            ssl_keyfile=args.ssl_keyfile,
        )
