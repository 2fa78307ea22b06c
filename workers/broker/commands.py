"""`genpipe broker up|down|status` and `genpipe topics create`."""

from __future__ import annotations

import argparse
import os
import sys

from workers.broker.topics import DEFAULT_PARTITIONS
from workers.cli_options import at_least, port_number, topic_arg
from workers.kafka.settings import TOPIC_ROLES, KafkaSettings


def register(subparsers) -> None:
    broker = subparsers.add_parser(
        "broker", help="run a local single-node Apache Kafka broker (KRaft)",
        description=(
            "Run a real Apache Kafka 4.x broker on 127.0.0.1 in single-node KRaft mode. "
            "Its jars are resolved once by Maven from ops/kafka/pom.xml into "
            "${GENPIPE_CACHE_DIR:-~/.cache/genpipe}/kafka/<version>/libs (needs java 17+ "
            "and mvn); its data, pid file and log live in .../broker-<port>/ unless "
            "--data-dir says otherwise. Any other Kafka works too: skip this and pass "
            "--bootstrap-servers (or GENPIPE_BOOTSTRAP_SERVERS) to the other commands."))
    actions = broker.add_subparsers(dest="broker_action", metavar="ACTION", required=True)
    helps = {
        "up": ("start the broker (storage is formatted on first start) and wait until it "
               "answers; if a Kafka broker already answers on the port, reuse it", _broker_up),
        "down": ("stop the broker started by `genpipe broker up` (SIGTERM to its recorded "
                 "pid)", _broker_down),
        "status": ("say whether a broker answers on the port and whether genpipe started "
                   "it (exit 0 if one answers)", _broker_status),
    }
    for action, (text, func) in helps.items():
        p = actions.add_parser(action, help=text, description=text[0].upper() + text[1:] + ".")
        p.add_argument("--port", type=port_number(), default=9092,
                       help="client (PLAINTEXT) port on 127.0.0.1 (default %(default)s)")
        p.add_argument("--data-dir", default=None,
                       help="broker directory: config, pid file, log and KRaft data "
                            "(default ${GENPIPE_CACHE_DIR:-~/.cache/genpipe}/broker-PORT, "
                            "or broker-PORT-secure with --secure)")
        p.add_argument("--brokers", type=at_least(1), default=1, metavar="N",
                       help="N > 1: a cluster of N combined broker+controller nodes on PORT, PORT+2, ... "
                            "(controllers on the odd ports), data in ${GENPIPE_CACHE_DIR}/cluster-PORT; "
                            "internal topics and `topics create` get min(3, N) replicas "
                            "(min.insync.replicas=2 from 3)")
        p.add_argument("--secure", action="store_true",
                       help="a broker with TLS (SASL_SSL on PORT, certificates made locally), SASL/SCRAM "
                            "users (admin, generate, derender, client, stranger) and ACLs enforced; "
                            "also uses PORT+2. `up` prints each user's settings and grants the "
                            "deployment's ACLs for --topic-prefix (README, Security)")
        if action == "up":
            p.add_argument("--controller-port", type=port_number(), default=None,
                           help="KRaft controller port on 127.0.0.1 (default PORT+1)")
            p.add_argument("--timeout", type=at_least(1.0, float), default=60,
                           help="seconds to wait for the broker to answer (default %(default)s)")
            p.add_argument("--topic-prefix", default=os.environ.get("GENPIPE_TOPIC_PREFIX", "genpipe"),
                           help="with --secure: the deployment whose ACLs to grant (env GENPIPE_TOPIC_PREFIX; "
                                "default %(default)s)")
        p.set_defaults(func=func)

    topics = subparsers.add_parser(
        "topics", help="manage genpipe's Kafka topics",
        description="Manage the six genpipe topics: " + ", ".join(
            f"<prefix>.{r}" for r in TOPIC_ROLES) + ".")
    topic_actions = topics.add_subparsers(dest="topics_action", metavar="ACTION", required=True)
    create = topic_actions.add_parser(
        "create", help="create the six topics (idempotent: existing topics are kept)",
        description=(
            "Create <prefix>.requests, .requests.bulk, .chunks, .results, .cancel and .dlq if "
            "missing. Existing topics are left as they are (unless --grow); the command reports "
            "which were created and which existed. requests, requests.bulk, chunks and results "
            "must share one partition count, so a request's records stay on one partition "
            "number end to end. The chunks topic keeps the broker's time "
            "(message.timestamp.type=LogAppendTime), which the derender's stalled-request check "
            "reads; an existing one that does not is named, with the line that changes it "
            "(where the broker describes its configs to this user)."))
    create.add_argument("--partitions", type=at_least(1), default=DEFAULT_PARTITIONS,
                        help="partitions per topic (default %(default)s). A fleet can use at most this "
                             "many generate workers; more partitions cost the brokers memory and make "
                             "rebalances longer (README, \"Running a fleet\")")
    create.add_argument("--grow", action="store_true",
                        help="give existing topics with fewer partitions --partitions: results and "
                             "--topic ones first, then chunks, then the request topics, so no request "
                             "lands on a partition number whose chunks/results do not exist yet. "
                             "Running requests keep their partitions; workers and clients see the new "
                             "ones at their next metadata refresh (at most 30 s). Never shrinks")
    create.add_argument("--replication-factor", type=at_least(1), default=None,
                        help="replicas per partition (default: 3, or the number of brokers when fewer; "
                             "with 3 replicas the topics get min.insync.replicas=2)")
    create.add_argument("--timeout", type=at_least(1.0, float), default=30,
                        help="seconds to wait for the broker to answer and the topics to have leaders "
                             "(default %(default)s)")
    create.add_argument("--topic", dest="extra_topics", type=topic_arg, action="append", default=[], metavar="NAME",
                        help="also create this topic with the same partitions (repeatable): a tenant's "
                             "reply topic such as genpipe.reply.team-a, or a `genpipe replay --to-topic` target")
    KafkaSettings.add_arguments(create)
    create.set_defaults(func=_topics_create)


def _fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 1


def _failures():
    """What a broker command reports as one line: its own errors, a data dir it cannot
    use (a file, no permission: OSError), a secure broker's setup (openssl missing, a
    damaged users file: SecureBrokerError, ValueError, KeyError). They were tracebacks."""
    from workers.broker.local import BrokerError
    from workers.broker.secure import SecureBrokerError

    return BrokerError, SecureBrokerError, OSError, ValueError, KeyError


def _broker_up(args: argparse.Namespace) -> int:
    from workers.broker.local import broker_up

    if args.brokers > 1:
        return _cluster_action(args, "up")
    try:
        info = broker_up(port=args.port, controller_port=args.controller_port,
                         data_dir=args.data_dir, timeout=args.timeout, secure=args.secure)
    except _failures() as exc:
        return _fail(str(exc))
    if args.secure:
        return _secure_up(args, info)
    if info.reused and info.pid is None:
        print(f"broker already answering on {info.bootstrap_servers} — reusing it "
              "(not started by genpipe here; `genpipe broker down` will not stop it)")
    elif info.reused:
        print(f"broker already answering on {info.bootstrap_servers} — reusing it "
              f"(pid {info.pid})")
    else:
        print(f"broker up on {info.bootstrap_servers} (pid {info.pid}, KRaft controller "
              f"127.0.0.1:{info.controller_port}, data {info.data_dir}, log {info.log_file})")
    return 0


def _secure_up(args: argparse.Namespace, info) -> int:
    from aiokafka.errors import KafkaError

    from workers.broker.secure import MECHANISM, acls_for, grant_now

    files, prefix = info.secure, args.topic_prefix
    try:
        grant_now(files.settings("admin", info.port), acls_for(prefix, clients={"client": "client"}))
    except (*_failures(), KafkaError) as exc:
        return _fail(f"granting the ACLs of {prefix!r} failed: {exc}")
    state = "reused" if info.reused else f"pid {info.pid}"
    print(f"secure broker up on {info.bootstrap_servers} ({state}; SASL_SSL, {MECHANISM}, ACLs enforced; "
          f"data {info.data_dir})")
    print(f"CA certificate: {files.cafile}; passwords: {files.directory / 'users.json'}")
    print(f"ACLs granted for topic prefix {prefix!r}: generate, derender, and client (tenant 'client', "
          f"reply topic {prefix}.reply.client); 'stranger' has none. Each user's settings:")
    for user in files.passwords:
        print(f"  {user}: GENPIPE_BOOTSTRAP_SERVERS={info.bootstrap_servers} GENPIPE_SECURITY_PROTOCOL=SASL_SSL "
              f"GENPIPE_SASL_MECHANISM={MECHANISM} GENPIPE_SASL_USERNAME={user} "
              f"GENPIPE_SASL_PASSWORD={files.passwords[user]} GENPIPE_SSL_CAFILE={files.cafile}")
    print(f"create the topics as admin: <admin's settings> genpipe topics create --topic-prefix {prefix}, "
          f"and each tenant's reply topic (e.g. {prefix}.reply.client) the same way")
    return 0


def _broker_down(args: argparse.Namespace) -> int:
    from workers.broker.cluster import cluster_nodes
    from workers.broker.local import broker_down, default_data_dir

    cluster_root = cluster_nodes(1, args.port, args.data_dir).nodes[0].data_dir.parent
    if args.brokers > 1 or (not args.secure and not (default_data_dir(args.port, args.data_dir) / "broker.pid").exists()
                            and any(cluster_root.glob("node-*/broker.pid"))):
        # (a cluster `up --brokers N` started: a plain `down` looked for a single broker and
        # said there was none, the cluster left running)
        return _cluster_action(args, "down")
    try:
        print(broker_down(port=args.port, data_dir=args.data_dir, secure=args.secure))
    except _failures() as exc:
        return _fail(str(exc))
    return 0


def _cluster_action(args: argparse.Namespace, action: str) -> int:
    from workers.broker.cluster import cluster_down, cluster_nodes, cluster_up
    from workers.broker.local import answers

    if args.secure:
        return _fail("--secure and --brokers are not combined (yet): use one of them")
    try:
        if action == "up":
            cluster = cluster_up(args.brokers, args.port, args.data_dir, timeout=args.timeout)
            print(f"cluster up: {args.brokers} brokers, bootstrap {cluster.bootstrap_servers} "
                  f"(pids {[n.pid() for n in cluster.nodes]}, data {cluster.nodes[0].data_dir.parent})")
        elif action == "down":
            print(cluster_down(args.brokers, args.port, args.data_dir))
        else:
            cluster = cluster_nodes(args.brokers, args.port, args.data_dir)
            up = [n.node_id for n in cluster.nodes if answers(n.port)]
            print(f"cluster on {cluster.bootstrap_servers}: nodes answering {up} of {args.brokers}")
            return 0 if up else 1
    except _failures() as exc:
        return _fail(str(exc))
    return 0


def _broker_status(args: argparse.Namespace) -> int:
    """Exit 0 when a broker answers (ours or not), 1 otherwise, so scripts can test it."""
    from workers.broker.local import HOST, broker_status

    if args.brokers > 1:
        return _cluster_action(args, "status")

    try:
        st = broker_status(port=args.port, data_dir=args.data_dir, secure=args.secure)
    except _failures() as exc:
        return _fail(str(exc))
    where = f"{HOST}:{st.port}"
    print({
        "running": f"broker running on {where} (pid {st.pid}, data {st.data_dir})",
        "starting": f"broker process {st.pid} exists but {where} does not answer (yet)",
        "foreign": f"a Kafka broker answers on {where}, not started by genpipe here",
        "stopped": f"no broker on {where}",
    }[st.state])
    return 0 if st.state in ("running", "foreign") else 1


def _topics_create(args: argparse.Namespace) -> int:
    import asyncio
    import logging

    from workers.broker.topics import CHUNKS_TOPIC_CONFIGS, TopicsError, create_topics

    # aiokafka logs each failed connect; with no logging configured Python's last-resort
    # handler would print those too, doubling the one-line error below.
    logging.getLogger("aiokafka").addHandler(logging.NullHandler())
    settings = KafkaSettings.from_args(args, client_id="genpipe-topics")
    try:
        report = asyncio.run(create_topics(settings, partitions=args.partitions,
                                           replication_factor=args.replication_factor,
                                           timeout=args.timeout, extra=args.extra_topics, grow=args.grow))
    except (TopicsError, ValueError) as exc:
        return _fail(str(exc))
    except Exception as exc:  # aiokafka errors: connection refused, auth, timeouts
        detail = str(exc) if str(exc).startswith(type(exc).__name__) else (
            f"{type(exc).__name__}: {exc}")
        return _fail(f"cannot create topics on {settings.bootstrap_servers}: {detail}")
    for name in report.created:
        print(f"created {name} ({report.partitions[name]} partitions)")
    for name in report.existed:
        if name in report.grown:
            before, after = report.grown[name]
            print(f"grown   {name} ({before} -> {after} partitions)")
        else:
            print(f"exists  {name} ({report.partitions[name]} partitions)")
    differ = [name for name in report.existed if report.partitions[name] != args.partitions]
    if differ:
        print(f"warning: {', '.join(differ)} already exist with another partition count than "
              f"--partitions {args.partitions}; existing topics are not changed"
              + ("" if args.grow else " (--grow adds partitions)"), file=sys.stderr)
    for name, configs in report.unlike.items():
        wanted = ",".join(f"{key}={CHUNKS_TOPIC_CONFIGS[key]}" for key in configs)
        print(f"warning: {name} exists with {', '.join(f'{k}={v}' for k, v in configs.items())}: the derender's "
              f"stalled-request check reads time from its timestamps, which then are the producers' "
              f"(docs/design.md §5.5); existing topics are not changed: kafka-configs.sh --bootstrap-server "
              f"{settings.bootstrap_servers} --alter --entity-type topics --entity-name {name} --add-config "
              f"{wanted} (with --command-config for a secured cluster)", file=sys.stderr)
    if report.mismatched(settings):
        print("warning: requests, chunks and results have different partition counts; "
              "a request's records may then change partition number", file=sys.stderr)
    return 0
