"""A local Kafka cluster of N brokers on loopback (`genpipe broker up --brokers 3`).

What every production deployment has and the single development broker lacks: replicas,
leader elections, a controller quorum. Each node is a combined broker+controller with
its own data dir `<cluster dir>/node-<i>` and two ports: clients on PORT + 2(i-1), its
controller on the next one. Internal topics get N replicas; topics made with
`genpipe topics create` take their replication from the cluster size (`topics.py`).
Failure detection is tuned for a laptop-sized cluster (a dead broker is noticed in ~3 s,
not 9), so failover tests finish in seconds.
"""

from __future__ import annotations

import os
import re
import signal
from dataclasses import dataclass
from pathlib import Path

from workers.broker import local
from workers.cache import cache_root

HOST = local.HOST


@dataclass(frozen=True)
class Node:
    node_id: int
    port: int
    controller_port: int
    data_dir: Path

    def pid(self) -> int | None:
        """The live broker process of this node, if any."""
        return local._read_pid(self.data_dir)


@dataclass(frozen=True)
class Cluster:
    nodes: list[Node]

    @property
    def bootstrap_servers(self) -> str:
        return ",".join(f"{HOST}:{node.port}" for node in self.nodes)

    def node(self, node_id: int) -> Node:
        return next(n for n in self.nodes if n.node_id == node_id)


def cluster_nodes(brokers: int, port: int, data_dir: str | Path | None = None) -> Cluster:
    root = Path(data_dir).expanduser().resolve() if data_dir else cache_root() / f"cluster-{port}"
    return Cluster([Node(i, port + 2 * (i - 1), port + 2 * (i - 1) + 1, root / f"node-{i}")
                    for i in range(1, brokers + 1)])


def node_properties(base: str, cluster: Cluster, node: Node) -> str:
    """The single broker's server.properties, made one node of `cluster`."""
    n = len(cluster.nodes)
    voters = ",".join(f"{m.node_id}@{HOST}:{m.controller_port}" for m in cluster.nodes)
    text = re.sub(r"(?m)^node\.id=.*$", f"node.id={node.node_id}", base)
    text = re.sub(r"(?m)^controller\.quorum\.voters=.*$", f"controller.quorum.voters={voters}", text)
    replicas = min(3, n)
    for name in ("offsets.topic.replication.factor", "transaction.state.log.replication.factor",
                 "share.coordinator.state.topic.replication.factor"):
        text = re.sub(rf"(?m)^{re.escape(name)}=.*$", f"{name}={replicas}", text)
    for name in ("transaction.state.log.min.isr", "share.coordinator.state.topic.min.isr"):
        text = re.sub(rf"(?m)^{re.escape(name)}=.*$", f"{name}={min(2, replicas)}", text)
    text = text.replace("# One node: every internal topic lives with a single replica.",
                        f"# Node {node.node_id} of {n}: internal topics have {replicas} replicas.")
    return text + (
        "# A dead broker is fenced after 3 s (default 9 s): leaders move quickly on loopback.\n"
        "broker.session.timeout.ms=3000\n"
        "broker.heartbeat.interval.ms=500\n"
        f"default.replication.factor={replicas}\n"
        f"min.insync.replicas={min(2, replicas)}\n"
        "unclean.leader.election.enable=false\n")


def cluster_up(brokers: int = 3, port: int = local.DEFAULT_PORT, data_dir: str | Path | None = None,
               timeout: float = 120, quiet: bool = False) -> Cluster:
    """Start every node that is not running (formatting storage once, with one cluster
    id) and wait until each answers."""
    if brokers < 1:
        raise local.BrokerError("--brokers must be at least 1")
    if port + 2 * brokers - 1 > 65535:
        raise local.BrokerError(f"{brokers} brokers take ports {port}..{port + 2 * brokers - 1}, past 65535: "
                                "choose a lower --port")
    cluster = cluster_nodes(brokers, port, data_dir)
    id_file = cluster.nodes[0].data_dir.parent / "cluster.id"
    id_file.parent.mkdir(parents=True, exist_ok=True)
    if not id_file.exists():
        id_file.write_text(local._cluster_id() + "\n")  # (an id cut of its leading "-" was refused)
    cluster_id = id_file.read_text().strip()
    pids = {node.node_id: node.pid() for node in cluster.nodes}
    for node in cluster.nodes:  # every port checked before any node starts
        if pids[node.node_id] is None:
            for p in (node.port, node.controller_port):
                if local._port_open(p):
                    raise local.BrokerError(f"{HOST}:{p} (node {node.node_id}) is in use by something else")
    libs = local.ensure_jars(quiet=quiet)  # (after the ports: a port taken says so at once)
    started = []
    try:
        for node in cluster.nodes:
            if pids[node.node_id] is not None:
                continue
            node.data_dir.mkdir(parents=True, exist_ok=True)
            base = local.SERVER_PROPERTIES.format(host=HOST, port=node.port, cport=node.controller_port,
                                                  log_dir=node.data_dir / "kraft")
            (node.data_dir / "server.properties").write_text(node_properties(base, cluster, node))
            local._format_storage(libs, node.data_dir, cluster_id=cluster_id)
            # The Popen's pid: read back from /proc this early, the child may not be java yet.
            pids[node.node_id] = local.launch(libs, node.data_dir).pid
            started.append(node.node_id)
        for node in cluster.nodes:  # a quorum needs a majority up before any node answers
            local._wait_ready(node.port, pids[node.node_id], node.data_dir, timeout)
    except BaseException:
        # A node that failed stops the ones this call started: they were left running.
        for node_id in started:
            node_down(cluster, node_id, grace=10)
        raise
    return cluster


def node_up(cluster: Cluster, node_id: int, timeout: float = 120) -> None:
    """Start one stopped node again (a restart after a kill or a rolling restart)."""
    node = cluster.node(node_id)
    pid = node.pid() or local.launch(local.libs_dir(), node.data_dir).pid
    local._wait_ready(node.port, pid, node.data_dir, timeout)


def node_down(cluster: Cluster, node_id: int, grace: float = 30, kill: bool = False) -> None:
    """Stop one node: SIGTERM (controlled shutdown) or, with `kill`, SIGKILL at once."""
    node = cluster.node(node_id)
    pid = node.pid()
    if pid is None:
        return
    if kill:
        os.kill(pid, signal.SIGKILL)
        local._wait_gone(pid, 30)
    else:
        local._stop_pid(pid, grace)
    (node.data_dir / "broker.pid").unlink(missing_ok=True)


def cluster_down(brokers: int = 3, port: int = local.DEFAULT_PORT, data_dir: str | Path | None = None) -> str:
    """Stop every node of the cluster: those its data dir has, too, past `brokers` (with
    a smaller --brokers than `up` had, the last nodes were left running)."""
    root = cluster_nodes(1, port, data_dir).nodes[0].data_dir.parent
    made = [int(d.name.split("-", 1)[1]) for d in root.glob("node-*") if d.name.split("-", 1)[1].isdigit()]
    cluster = cluster_nodes(max([brokers, *made]), port, data_dir)
    stopped = []
    for node in cluster.nodes:
        if node.pid() is not None:
            node_down(cluster, node.node_id)
            stopped.append(node.node_id)
    return f"stopped nodes {stopped} of the cluster on {cluster.bootstrap_servers}" if stopped else \
        f"no node of the cluster on {cluster.bootstrap_servers} was running"
