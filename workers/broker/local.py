"""A local single-node Apache Kafka broker (KRaft, combined broker+controller).

No Docker, no tarball: Maven resolves the jars from ``ops/kafka/pom.xml`` into
``${GENPIPE_CACHE_DIR:-~/.cache/genpipe}/kafka/<version>/libs``, and the broker runs
detached as ``java -cp libs/* kafka.Kafka server.properties`` with its config, pid
file, log (broker.log) and KRaft log dir (kraft/) under ``.../broker-<port>/``.
We stop a broker only through its pid file, never by process name, and check
/proc/<pid>/cmdline before signalling so a recycled pid is safe.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import contextlib
import hashlib
import os
import re
import shutil
import signal
import socket
import subprocess
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from workers.cache import cache_root

if TYPE_CHECKING:
    from workers.broker.secure import SecureFiles

HOST = "127.0.0.1"
DEFAULT_PORT = 9092
POM = Path(__file__).resolve().parents[2] / "ops" / "kafka" / "pom.xml"
# A small heap: plenty for tests and the demo. SerialGC and C1-only JIT
# cut the broker's start-up (measured ~5-6 s -> ~4 s to answering on 2 cores) and its
# footprint; GENPIPE_BROKER_JAVA_OPTS replaces these for throughput runs.
DEFAULT_JAVA_OPTS = "-Xms256m -Xmx512m -XX:+UseSerialGC -XX:TieredStopAtLevel=1"
# Brokers this process started, so they can be reaped (no zombies, no ResourceWarning).
_CHILDREN: dict[int, subprocess.Popen] = {}


class BrokerError(RuntimeError):
    """A failure the CLI reports as one line (plus an optional log tail)."""


@dataclass(frozen=True)
class BrokerInfo:
    bootstrap_servers: str
    port: int
    controller_port: int
    data_dir: Path
    pid: int | None  # None when the broker answering is not one we started
    reused: bool  # True when something already answered and we started nothing
    log_file: Path
    secure: "SecureFiles | None" = None  # --secure: certificates and users (broker/secure.py)


@dataclass(frozen=True)
class BrokerStatus:
    state: str  # "running" | "starting" | "foreign" | "stopped"
    port: int
    pid: int | None
    data_dir: Path


def kafka_version() -> str:
    """The Kafka version pinned in ops/kafka/pom.xml (the single source of truth)."""
    if not POM.exists():
        raise BrokerError(f"{POM} not found: the local broker needs a genpipe source "
                          "checkout (or use --bootstrap-servers with any other Kafka)")
    match = re.search(r"<kafka\.version>\s*([^<\s]+)\s*</kafka\.version>", POM.read_text())
    if not match:
        raise BrokerError(f"no <kafka.version> property in {POM}")
    return match.group(1)


def libs_dir() -> Path:
    return cache_root() / "kafka" / kafka_version() / "libs"


def default_data_dir(port: int, data_dir: str | Path | None = None, secure: bool = False) -> Path:
    # Absolute, because the pid check compares it with the broker's command line.
    if data_dir:
        return Path(data_dir).expanduser().resolve()
    return cache_root() / (f"broker-{port}-secure" if secure else f"broker-{port}")


def ensure_jars(quiet: bool = False) -> Path:
    """Resolve the broker's runtime classpath with Maven, once; return the libs dir.

    The marker holds the pom's hash, so editing the pom re-resolves; Maven writes into
    a temporary directory renamed into place on success, so a half copy never counts.
    """
    libs = libs_dir()
    pom_hash = hashlib.sha256(POM.read_bytes()).hexdigest()
    marker = libs / ".genpipe-resolved"
    if marker.exists() and marker.read_text().strip() == pom_hash:
        return libs
    mvn = shutil.which("mvn")
    if mvn is None:
        raise BrokerError("Maven ('mvn') not found on PATH: it resolves the Kafka jars "
                          "(install maven, e.g. apt-get install maven)")
    _require_java()
    if not quiet:
        print(f"resolving Kafka {kafka_version()} jars with Maven into {libs} ...", flush=True)
    tmp = libs.with_name(f"libs.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    cmd = [mvn, "-q", "-B", "-Dstyle.color=never", "-f", str(POM),
           "dependency:copy-dependencies", "-DincludeScope=runtime",
           f"-DoutputDirectory={tmp}"]
    proc = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True)
    if proc.returncode != 0 or not any(tmp.glob("kafka_*.jar")):
        shutil.rmtree(tmp, ignore_errors=True)
        tail = _tail(proc.stdout + proc.stderr, 15)
        raise BrokerError(f"Maven could not resolve the Kafka jars (exit {proc.returncode})"
                          + (f":\n{tail}" if tail else ""))
    return _place(tmp, pom_hash)


def adopt_jars(source: str | Path) -> Path:
    """Take a directory of jars resolved elsewhere as this pom's classpath (a machine with
    no Maven or no network: ops/device/kafka_kit.py); `source` is moved, not copied."""
    source = Path(source)
    if not any(source.glob("kafka_*.jar")):
        raise BrokerError(f"{source} holds no kafka_*.jar: not a Kafka {kafka_version()} classpath")
    libs_dir().parent.mkdir(parents=True, exist_ok=True)
    return _place(source, hashlib.sha256(POM.read_bytes()).hexdigest())


def _place(resolved: Path, pom_hash: str) -> Path:
    libs = libs_dir()
    (resolved / ".genpipe-resolved").write_text(pom_hash + "\n")
    shutil.rmtree(libs, ignore_errors=True)
    shutil.move(str(resolved), str(libs))  # (a rename when both are on one file system)
    return libs


def _require_java() -> str:
    java = shutil.which("java")
    if java is None:
        raise BrokerError("Java ('java') not found on PATH: Kafka 4.x needs Java 17 or "
                          "newer (e.g. apt-get install openjdk-17-jre-headless)")
    return java


def _port_open(port: int, timeout: float = 0.5) -> bool:
    try:
        with socket.create_connection((HOST, port), timeout=timeout):
            return True
    except OSError:
        return False


def _run_coro(coro):
    # A fresh thread with its own loop: works whether or not the caller already runs
    # an event loop (pytest-asyncio's session loop, say), and never replaces it.
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


async def _list_topics(port: int, timeout_s: float, settings=None) -> list[str]:
    from aiokafka.admin import AIOKafkaAdminClient

    from workers.kafka.settings import KafkaSettings

    settings = settings or KafkaSettings(bootstrap_servers=f"{HOST}:{port}", client_id="genpipe-broker-probe")
    admin = AIOKafkaAdminClient(**settings.client_kwargs(),
                                request_timeout_ms=int(timeout_s * 1000))
    try:
        await asyncio.wait_for(admin.start(), timeout_s)
        return await asyncio.wait_for(admin.list_topics(), timeout_s)
    finally:
        await admin.close()


def answers(port: int, timeout: float = 3.0, settings=None) -> bool:
    """True when a Kafka broker on 127.0.0.1:port answers a metadata request (made with
    `settings` when given: a secured broker answers only its users)."""
    if not _port_open(port):
        return False  # fast path: nothing listening, skip the Kafka client entirely
    try:
        _run_coro(_list_topics(port, timeout, settings))
        return True
    except ImportError as exc:  # not the broker's doing: say so, rather than wait out a start-up
        raise BrokerError(f"the Kafka client cannot be imported here ({exc}): install genpipe's "
                          "dependencies (pip install genpipe, or its wheels)") from exc
    except Exception:  # any other failure means "not usable as Kafka right now"
        return False


def _pid_alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    if stat.rsplit(")", 1)[1].split()[0] != "Z":
        return True
    # A zombie has exited; if it is our own child, reap it so the pid really goes away.
    child = _CHILDREN.pop(pid, None)
    try:
        child.wait() if child else os.waitpid(pid, 0)
    except ChildProcessError:
        pass  # not ours (started by an earlier `genpipe broker up`): init reaps it
    return False


def _is_our_broker(pid: int, data_dir: Path) -> bool:
    """Is pid a java kafka.Kafka process running our server.properties?"""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    args = [a.decode(errors="replace") for a in argv if a]
    return (bool(args) and os.path.basename(args[0]).startswith("java")
            and "kafka.Kafka" in args and str(data_dir / "server.properties") in args)


def _read_pid(data_dir: Path) -> int | None:
    """The recorded pid if it is still our live broker; a stale pid file is removed."""
    pid_file = data_dir / "broker.pid"
    try:
        pid = int(pid_file.read_text().strip())
    except FileNotFoundError:
        return None
    except ValueError:  # (garbage: removed too, or every later command said it was)
        pid_file.unlink(missing_ok=True)
        return None
    if _pid_alive(pid) and _is_our_broker(pid, data_dir):
        return pid
    pid_file.unlink(missing_ok=True)
    return None


# Comments land in the generated file, where whoever reads it needs them.
SERVER_PROPERTIES = """\
# Written by `genpipe broker up`; rewritten on every start.
process.roles=broker,controller
node.id=1
# A static quorum: `format` then needs no --standalone / dynamic voter setup.
controller.quorum.voters=1@{host}:{cport}
listeners=PLAINTEXT://{host}:{port},CONTROLLER://{host}:{cport}
advertised.listeners=PLAINTEXT://{host}:{port}
controller.listener.names=CONTROLLER
listener.security.protocol.map=CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT
inter.broker.listener.name=PLAINTEXT
log.dirs={log_dir}
# One node: every internal topic lives with a single replica.
offsets.topic.replication.factor=1
transaction.state.log.replication.factor=1
transaction.state.log.min.isr=1
share.coordinator.state.topic.replication.factor=1
share.coordinator.state.topic.min.isr=1
# Few internal partitions: the first group join / transaction creates all of them.
offsets.topic.num.partitions=4
transaction.state.log.num.partitions=4
share.coordinator.state.topic.num.partitions=4
# Tests and the demo join new groups constantly; don't wait 3 s on each.
group.initial.rebalance.delay.ms=0
# Topics come from `genpipe topics create` only, so a typo'd name fails loudly.
auto.create.topics.enable=false
num.partitions=1
"""


def _cluster_id() -> str:
    """A Kafka cluster id: a random UUID as unpadded URL-safe base64, like
    `kafka.tools.StorageTool random-uuid` prints (saves a ~3 s JVM start).
    Kafka rejects ids that start with '-' (they look like options)."""
    while True:
        cid = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        if not cid.startswith("-"):
            return cid


def _java_cmd(libs: Path, main: str, *args: str, log_level: str = "ERROR") -> list[str]:
    opts = os.environ.get("GENPIPE_BROKER_JAVA_OPTS", DEFAULT_JAVA_OPTS).split()
    # No log4j2 config file: its built-in default (console, level from this property)
    # is all a development broker needs.
    return [_require_java(), *opts, f"-Dorg.apache.logging.log4j.level={log_level}",
            "-cp", f"{libs}/*", main, *args]


def _format_storage(libs: Path, data_dir: Path, extra: list[str] = (), cluster_id: str | None = None) -> None:
    """Format the KRaft log dir on first start (meta.properties absent)."""
    if (data_dir / "kraft" / "meta.properties").exists():
        return
    props = data_dir / "server.properties"
    # Log level ERROR: at INFO the format step dumps the whole KafkaConfig.
    cmd = _java_cmd(libs, "kafka.tools.StorageTool", "format",
                    "-t", cluster_id or _cluster_id(), "-c", str(props), "--ignore-formatted", *extra)
    proc = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True)
    if proc.returncode != 0:
        raise BrokerError(f"formatting Kafka storage in {data_dir / 'kraft'} failed:\n"
                          + _tail(proc.stdout + proc.stderr, 15))


@contextlib.contextmanager
def _one_at_a_time(data_dir: Path):
    """Holds the data dir's lock: one `up` or `down` at a time on it. Two `up`s at once
    (two test sessions sharing the cache) both formatted and launched; the second broker
    died, its pid file replaced the first's, and `down` then found no broker to stop."""
    import fcntl

    data_dir.mkdir(parents=True, exist_ok=True)
    with open(data_dir / "broker.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def broker_up(port: int = DEFAULT_PORT, controller_port: int | None = None,
              data_dir: str | Path | None = None, timeout: float = 60,
              quiet: bool = False, secure: bool = False) -> BrokerInfo:
    """Start a broker on 127.0.0.1:port, or reuse whatever Kafka already answers there.
    `secure`: SASL_SSL with SCRAM users and ACLs (workers/broker/secure.py); it also
    takes PORT+2 for the broker's own SASL_PLAINTEXT listener."""
    data_dir = default_data_dir(port, data_dir, secure)
    with _one_at_a_time(data_dir):
        return _broker_up(port, controller_port, data_dir, timeout, quiet, secure)


def _broker_up(port: int, controller_port: int | None, data_dir: Path, timeout: float, quiet: bool,
               secure: bool) -> BrokerInfo:
    controller_port = controller_port or port + 1
    for what, number in (("controller port", controller_port), ("internal SASL port (PORT+2)", port + 2)):
        if number > 65535 and (secure or what == "controller port"):
            raise BrokerError(f"the {what} would be {number}, past 65535: choose a lower --port")
    log_file = data_dir / "broker.log"
    bootstrap = f"{HOST}:{port}"
    files = probe = None
    if secure:
        from workers.broker import secure as sec

        files = sec.prepare(data_dir)
        probe = files.settings("admin", port)

    pid = _read_pid(data_dir) if data_dir.exists() else None
    if pid is None and _port_open(port):
        if answers(port, timeout=5, settings=probe):
            return BrokerInfo(bootstrap, port, controller_port, data_dir, None, True, log_file, files)
        raise BrokerError(f"{bootstrap} is in use by something that does not answer as Kafka"
                          + (" to this data dir's admin user" if secure else ""))
    if pid is not None:
        # Our broker (maybe still starting, e.g. a concurrent `up`): wait, don't duplicate.
        _wait_ready(port, pid, data_dir, timeout, probe)
        return BrokerInfo(bootstrap, port, controller_port, data_dir, pid, True, log_file, files)
    if _port_open(controller_port):
        raise BrokerError(f"controller port {HOST}:{controller_port} is already in use "
                          "(choose another with --controller-port)")

    libs = ensure_jars(quiet=quiet)
    data_dir.mkdir(parents=True, exist_ok=True)
    properties = SERVER_PROPERTIES.format(host=HOST, port=port, cport=controller_port, log_dir=data_dir / "kraft")
    if secure:
        properties = sec.server_properties(properties, files, port, port + 2)
    # A secure broker's holds the admin's and the keystore's passwords: its user's alone
    mode = 0o600 if secure else 0o644
    fd = os.open(data_dir / "server.properties", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    os.fchmod(fd, mode)
    with os.fdopen(fd, "w") as config:
        config.write(properties)
    _format_storage(libs, data_dir, sec.format_arguments(files) if secure else [])

    proc = launch(libs, data_dir)
    try:
        _wait_ready(port, proc.pid, data_dir, timeout, probe)
    except BrokerError:
        _stop_pid(proc.pid, grace=10)
        (data_dir / "broker.pid").unlink(missing_ok=True)
        raise
    return BrokerInfo(bootstrap, port, controller_port, data_dir, proc.pid, False, log_file, files)


def launch(libs: Path, data_dir: Path) -> subprocess.Popen:
    """Start `kafka.Kafka data_dir/server.properties` detached; record its pid."""
    log_file = data_dir / "broker.log"
    if log_file.exists():  # keep the previous run's log for post-mortems
        log_file.replace(log_file.with_suffix(".log.1"))
    with open(log_file, "wb") as log:
        proc = subprocess.Popen(
            _java_cmd(libs, "kafka.Kafka", str(data_dir / "server.properties"), log_level="INFO"),
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            cwd=data_dir,
            # Own session: Ctrl-C in the terminal or the CLI exiting leaves it running.
            start_new_session=True)
    _CHILDREN[proc.pid] = proc
    # Whole or not at all: a reader finding it empty mid-write took it for garbage
    (data_dir / "broker.pid.tmp").write_text(f"{proc.pid}\n")
    (data_dir / "broker.pid.tmp").replace(data_dir / "broker.pid")
    return proc


def _wait_ready(port: int, pid: int, data_dir: Path, timeout: float, probe=None) -> None:
    deadline = time.monotonic() + timeout
    while not answers(port, timeout=2 if probe is None else 5, settings=probe):
        if not _pid_alive(pid) or time.monotonic() > deadline:
            why = ("the broker process exited during start-up" if not _pid_alive(pid) else
                   f"the broker did not answer on {HOST}:{port} within {timeout:.0f} s")
            log = data_dir / "broker.log"
            raise BrokerError(f"{why}; last lines of {log}:\n{_tail_file(log)}")
        time.sleep(0.25)


def _wait_gone(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while _pid_alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def _stop_pid(pid: int, grace: float) -> bool:
    """SIGTERM (Kafka's controlled shutdown), SIGKILL after `grace` s. True if killed."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            break
        if _wait_gone(pid, wait):
            return sig == signal.SIGKILL
    if _pid_alive(pid):
        raise BrokerError(f"broker pid {pid} survived SIGKILL")
    return False


def broker_down(port: int = DEFAULT_PORT, data_dir: str | Path | None = None,
                grace: float = 30, secure: bool = False) -> str:
    """Stop the broker recorded in the data dir's pid file; return a message."""
    data_dir = default_data_dir(port, data_dir, secure)
    if not data_dir.is_dir():
        return _broker_down(port, data_dir, grace)
    with _one_at_a_time(data_dir):
        return _broker_down(port, data_dir, grace)


def _broker_down(port: int, data_dir: Path, grace: float) -> str:
    pid_file = data_dir / "broker.pid"
    if not pid_file.exists():
        note = (" (a Kafka broker does answer there, but genpipe did not start it)"
                if answers(port) else "")
        return f"no genpipe broker recorded for port {port} in {data_dir}{note}"
    pid = _read_pid(data_dir)  # also drops a stale pid file
    if pid is None:
        return f"broker for port {port} was not running (removed stale pid file)"
    killed = _stop_pid(pid, grace)
    pid_file.unlink(missing_ok=True)
    how = f"killed after {grace:.0f} s without exiting" if killed else "stopped"
    return f"broker on {HOST}:{port} (pid {pid}) {how}"


def broker_status(port: int = DEFAULT_PORT, data_dir: str | Path | None = None,
                  secure: bool = False) -> BrokerStatus:
    data_dir = default_data_dir(port, data_dir, secure)
    pid = _read_pid(data_dir) if data_dir.exists() else None
    probe = None
    if secure and (data_dir / "secure" / "users.json").exists():
        from workers.broker.secure import prepare

        probe = prepare(data_dir).settings("admin", port)
    answering = answers(port, settings=probe)
    ours = pid is not None
    state = ("running" if ours else "foreign") if answering else ("starting" if ours else "stopped")
    return BrokerStatus(state, port, pid, data_dir)


def _tail(text: str, lines: int = 20) -> str:
    """The end of a log; from its last ERROR on (stack frames dropped) if it has one."""
    rows = text.strip().splitlines()
    errors = [i for i, row in enumerate(rows) if " ERROR " in row]
    if errors:
        rows = [r for r in rows[errors[-1]:] if not r.lstrip().startswith("at ")][:lines]
    return "\n".join(rows[-lines:])


def _tail_file(path: Path) -> str:
    try:
        return _tail(path.read_bytes()[-65536:].decode(errors="replace"))
    except OSError:
        return "(no log)"
