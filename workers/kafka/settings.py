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
    ssl_password: str | None = field(default=None, repr=False)  # the key file's passphrase
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
            kwargs["ssl_context"] = self.ssl_context()
        kwargs.update(self.extra)
        return kwargs

    def ssl_context(self) -> ssl.SSLContext:
        """The TLS context of `--security-protocol SSL / SASL_SSL`. A file it cannot use is
        a `TlsFileError` (a ValueError) naming the option and the file: it was a bare
        "[Errno 2] No such file or directory" or "[SSL] PEM lib". An encrypted key without
        `ssl_password` is one too: OpenSSL's own fallback prompted for the passphrase on
        the terminal, once per Kafka client a command makes, and without a terminal failed
        with "Invalid argument"."""
        try:
            context = ssl.create_default_context(cafile=self.ssl_cafile)
        except (OSError, ssl.SSLError) as exc:
            raise TlsFileError(f"--ssl-cafile {self.ssl_cafile}: not a readable PEM file of CA certificates "
                               f"({_reason(exc)})") from exc
        if self.ssl_keyfile and not self.ssl_certfile:
            raise TlsFileError(f"--ssl-keyfile {self.ssl_keyfile} is given without --ssl-certfile, its certificate")
        if self.ssl_certfile:
            files = f"--ssl-certfile {self.ssl_certfile}" + (f" --ssl-keyfile {self.ssl_keyfile}"
                                                              if self.ssl_keyfile else "")
            try:
                context.load_cert_chain(self.ssl_certfile, self.ssl_keyfile,
                                        password=self.ssl_password if self.ssl_password else _no_passphrase)
            except _KeyEncrypted:
                raise TlsFileError(f"{files}: the private key is encrypted: give its passphrase with "
                                   f"--ssl-password (env GENPIPE_SSL_PASSWORD)") from None
            except (OSError, ssl.SSLError) as exc:
                raise TlsFileError(f"{files}: cannot load the client certificate and its key ({_reason(exc)}: a "
                                   f"missing file, not PEM, a key that is not the certificate's"
                                   f"{', or a wrong --ssl-password' if self.ssl_password else ''})") from exc
        return context

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
            ssl_password=env.get("GENPIPE_SSL_PASSWORD") or None,
        )

    _ENV = (("GENPIPE_BOOTSTRAP_SERVERS", "bootstrap_servers"), ("GENPIPE_TOPIC_PREFIX", "topic_prefix"),
            ("GENPIPE_SECURITY_PROTOCOL", "security_protocol"), ("GENPIPE_SASL_MECHANISM", "sasl_mechanism"),
            ("GENPIPE_SASL_USERNAME", "sasl_plain_username"), ("GENPIPE_SASL_PASSWORD", "sasl_plain_password"),
            ("GENPIPE_SSL_CAFILE", "ssl_cafile"), ("GENPIPE_SSL_CERTFILE", "ssl_certfile"),
            ("GENPIPE_SSL_KEYFILE", "ssl_keyfile"), ("GENPIPE_SSL_PASSWORD", "ssl_password"))

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
        group.add_argument("--ssl-keyfile", default=env.ssl_keyfile,
                           help="the --ssl-certfile's private key, if not in that file (env GENPIPE_SSL_KEYFILE)")
        group.add_argument("--ssl-password", default=env.ssl_password,
                           help="passphrase of an encrypted private key (env GENPIPE_SSL_PASSWORD, which "
                                "keeps it off the command line)")

    @classmethod
    def from_args(cls, args: argparse.Namespace, client_id: str = "genpipe") -> "KafkaSettings":
        """The command's settings; with TLS, its files are checked now (`ssl_context`'s
        UsageError), so a command fails at its start in one line: `serve` failed inside
        uvicorn's start-up with a traceback, the workers in their first Kafka client."""
        settings = cls(
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
            ssl_password=args.ssl_password,
        )
        if settings.security_protocol in ("SSL", "SASL_SSL"):
            from workers.startup import UsageError

            try:
                settings.ssl_context()
            except TlsFileError as exc:
                raise UsageError(str(exc)) from None
        return settings


class TlsFileError(ValueError):
    """A TLS file (CA, certificate, key) that cannot be used, or a key's passphrase missing
    or wrong; the message names the option and the file."""


class _KeyEncrypted(Exception):
    pass


def _no_passphrase():
    """OpenSSL asks for a passphrase (the key is encrypted) and none was given: raised
    through `load_cert_chain` instead of OpenSSL prompting on the terminal."""
    raise _KeyEncrypted


def _reason(exc: BaseException) -> str:
    return exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
