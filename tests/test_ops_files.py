"""The deployment files agree with the code: docker-compose.yml, ops/prometheus,
ops/grafana and ops/k8s.

Fast and offline (no Docker engine, Prometheus or Kubernetes needed): every file is
parsed; every genpipe command line in compose and in the Kubernetes manifests goes
through the real CLI parser (`workers.cli.build_parser`), so a typo'd subcommand or flag
fails here; every metric and label a query names is looked up in `workers/metrics.py`.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import re
import shlex
from pathlib import Path

import pytest
import yaml

from workers.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = ROOT / "docker-compose.yml"
PROMETHEUS = ROOT / "ops" / "prometheus" / "prometheus.yml"
GRAFANA = ROOT / "ops" / "grafana"
DASHBOARD = GRAFANA / "dashboards" / "genpipe.json"
K8S = ROOT / "ops" / "k8s"

WORKER_LABEL_VALUES = {"generate", "derender"}  # the `worker` label (docs/design.md §7)
# The dashboard must chart at least these (the metrics of workers/metrics.py at the time
# it was written); a new metric should get a panel too.
DASHBOARD_METRICS = {
    "genpipe_requests", "genpipe_tokens", "genpipe_chunks", "genpipe_results", "genpipe_errors",
    "genpipe_dlq_records", "genpipe_in_flight_requests", "genpipe_batch_size",
    "genpipe_consumer_lag_records", "genpipe_time_to_first_token_seconds",
    "genpipe_inter_token_latency_seconds", "genpipe_step_time_seconds",
    "genpipe_derender_latency_seconds", "genpipe_chunk_stretch", "genpipe_chunk_hold_seconds",
    "genpipe_gc_pause_seconds",
}
# Series names a metric family exposes, by type (what a query may name).
SUFFIXES = {
    "counter": ("_total", "_created"),
    "gauge": ("",),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "summary": ("", "_sum", "_count", "_created"),
}
AGGREGATIONS = r"\b(?:sum|avg|min|max|count|topk|bottomk|quantile|stddev|stdvar|group)\b"


# ---- helpers -------------------------------------------------------------------------

def load_yaml(path: Path):
    with path.open() as f:
        return yaml.safe_load(f)


def load_yaml_all(path: Path) -> list:
    with path.open() as f:
        return [doc for doc in yaml.safe_load_all(f) if doc is not None]


def _strict(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """No abbreviated options in deployment files: `--bootstrap-server` would parse today
    and break when another option shares the prefix."""
    parser.allow_abbrev = False
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                _strict(sub)
    return parser


def parse_cli(argv: list[str], where: str):
    """Parse a genpipe command line with the real parser; fail with argparse's message."""
    assert isinstance(argv, list) and all(isinstance(a, str) for a in argv), \
        f"{where}: command must be a list of strings, got {argv!r}"
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            args = _strict(build_parser()).parse_args(argv)
    except SystemExit:
        pytest.fail(f"{where}: `genpipe {shlex.join(argv)}` does not parse:\n{err.getvalue()}")
    assert getattr(args, "func", None) is not None, f"{where}: `genpipe {shlex.join(argv)}` runs nothing"
    return args


def seconds(value) -> float:
    """Compose durations ('45s', '1m30s', '1.5s') and plain numbers, in seconds."""
    if isinstance(value, (int, float)):
        return float(value)
    parts = re.findall(r"(\d+(?:\.\d+)?)(h|ms|m|s|us)", value)
    assert parts and "".join(n + u for n, u in parts) == value, f"bad duration {value!r}"
    scale = {"h": 3600, "m": 60, "s": 1, "ms": 1e-3, "us": 1e-6}
    return sum(float(n) * scale[u] for n, u in parts)


def metric_catalogue() -> dict[str, tuple[str, str, tuple[str, ...]]]:
    """Exposed series name -> (family name, type, label names), from workers/metrics.py."""
    from prometheus_client.metrics import MetricWrapperBase

    import workers.metrics as metrics

    catalogue = {}
    for obj in vars(metrics).values():
        if not isinstance(obj, MetricWrapperBase):
            continue
        family = obj.describe()[0]
        labels = tuple(getattr(obj, "_labelnames", ()))
        for suffix in SUFFIXES[family.type]:
            catalogue[family.name + suffix] = (family.name, family.type, labels)
    for family in metrics.watch_gc_pauses().describe():  # a custom collector's families
        for suffix in SUFFIXES[family.type]:
            catalogue[family.name + suffix] = (family.name, family.type, tuple(family.samples[0].labels))
    assert catalogue, "workers/metrics.py defines no metrics"
    return catalogue


def compose() -> dict:
    return load_yaml(COMPOSE)


def compose_default(value: str) -> str:
    """A compose value with every `${VAR:-default}` replaced by its default (what a plain
    `docker compose up` uses); a `${VAR}` without a default fails the test."""
    assert not re.search(r"\$\{[A-Za-z_][A-Za-z0-9_]*\}", value), f"{value!r}: a variable without a default"
    return re.sub(r"\$\{[A-Za-z_][A-Za-z0-9_]*:-([^}]*)\}", r"\1", value)


def genpipe_image(services: dict) -> str:
    built = {svc["image"] for svc in services.values() if "build" in svc and "image" in svc}
    assert len(built) == 1, f"expected one service that builds the genpipe image, got {built}"
    return built.pop()


def genpipe_services(services: dict) -> dict:
    image = genpipe_image(services)
    return {name: svc for name, svc in services.items() if svc.get("image") == image}


def worker_services(services: dict) -> dict:
    return {name: svc for name, svc in genpipe_services(services).items()
            if svc["command"][0] in ("generate-worker", "derender-worker")}


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def panels(dash: dict) -> list[dict]:
    out = []
    for panel in dash["panels"]:
        out.append(panel)
        out.extend(panel.get("panels", []))  # collapsed rows keep theirs inside
    return out


def dashboard_exprs() -> list[tuple[str, dict]]:
    return [(f"panel {p['title']!r} target {t.get('refId')}", t)
            for p in panels(dashboard()) for t in p.get("targets", [])]


def prometheus_target_labels() -> set[str]:
    labels = {"instance", "job"}
    for job in load_yaml(PROMETHEUS)["scrape_configs"]:
        for rule in job.get("relabel_configs", []):
            if "target_label" in rule:
                labels.add(rule["target_label"])
    return labels


def k8s_docs() -> dict[str, list[dict]]:
    files = sorted(p for p in K8S.glob("*.y*ml") if p.name != "kustomization.yaml")
    assert files, "no manifests in ops/k8s"
    return {p.name: load_yaml_all(p) for p in files}


def k8s_objects() -> list[dict]:
    return [doc for docs in k8s_docs().values() for doc in docs]


def pod_spec(obj: dict) -> dict:
    return obj["spec"]["template"]["spec"]


def genpipe_containers(obj: dict) -> list[dict]:
    return [c for c in pod_spec(obj)["containers"] if c["image"].split(":")[0].endswith("genpipe")]


def flag(args: list[str], name: str) -> str | None:
    for i, arg in enumerate(args):
        if arg == name:
            return args[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


# ---- the image -------------------------------------------------------------------------

def test_image_entrypoint_is_genpipe():
    """Compose `command:` and Kubernetes `args:` are genpipe arguments, so the image's
    ENTRYPOINT must be the genpipe CLI."""
    text = (ROOT / "Dockerfile").read_text()
    entry = [line for line in text.splitlines() if line.startswith("ENTRYPOINT")]
    assert entry and json.loads(entry[-1].split(None, 1)[1]) == ["genpipe"]


# ---- docker-compose.yml ----------------------------------------------------------------

def test_compose_parses_and_references_resolve():
    doc = compose()
    services = doc["services"]
    assert {"kafka", "topics", "generate", "generate-cpu", "derender", "prometheus", "grafana"} <= set(services)
    volumes = set(doc.get("volumes") or {})
    for name, svc in services.items():
        assert re.fullmatch(r"[a-z0-9][a-z0-9_-]*", name)
        deps = svc.get("depends_on") or {}
        for dep in deps:
            assert dep in services, f"{name} depends on unknown service {dep}"
        for mount in svc.get("volumes", []):
            source = mount.split(":")[0]
            if source.startswith((".", "/")):
                assert (ROOT / source).exists(), f"{name}: bind mount source {source} missing"
            else:
                assert source in volumes, f"{name}: named volume {source} not declared"


@pytest.mark.parametrize("service", ["topics", "generate", "generate-cpu", "derender"])
def test_compose_genpipe_commands_parse(service):
    services = compose()["services"]
    assert service in genpipe_services(services), f"{service} does not run the genpipe image"
    command = services[service]["command"]
    args = parse_cli(command, f"docker-compose.yml service {service}")
    assert args.bootstrap_servers == "kafka:9092"  # the in-network listener


def test_every_compose_genpipe_service_parses():
    services = compose()["services"]
    for name, svc in genpipe_services(services).items():
        parse_cli(svc["command"], f"docker-compose.yml service {name}")


def test_compose_workers():
    services = compose()["services"]
    workers = worker_services(services)
    assert set(workers) == {"generate", "generate-cpu", "derender"}
    for name, svc in workers.items():
        args = parse_cli(svc["command"], name)
        assert args.metrics_port == 9400, name
        assert svc["depends_on"]["topics"]["condition"] == "service_completed_successfully", name
        assert svc["restart"] == "unless-stopped", name
        # Docker's SIGKILL must come after the worker's own drain deadline.
        assert seconds(svc["stop_grace_period"]) > args.grace_period, name
        # One shared cache volume, and GENPIPE_CACHE_DIR points into it.
        cache = svc["environment"]["GENPIPE_CACHE_DIR"]
        mounts = {m.split(":")[1]: m.split(":")[0] for m in svc["volumes"]}
        assert mounts.get(cache) == "genpipe-cache", name


def test_compose_generate_has_a_gpu():
    services = compose()["services"]
    gen = services["generate"]
    assert parse_cli(gen["command"], "generate").device == "cuda"
    devices = gen["deploy"]["resources"]["reservations"]["devices"]
    assert {"driver": "nvidia", "count": 1, "capabilities": ["gpu"]} in devices
    assert "profiles" not in gen  # started by a plain `docker compose up`

    cpu = services["generate-cpu"]
    assert cpu["profiles"] == ["cpu"]
    assert parse_cli(cpu["command"], "generate-cpu").device == "cpu"
    assert "deploy" not in cpu

    assert services["derender"]["deploy"]["replicas"] == 2


def test_compose_kafka_runs_either_image():
    """apache/kafka by default, genpipe/kafka (ops/kafka/Dockerfile) with
    GENPIPE_KAFKA_IMAGE: same Kafka version, and the healthcheck's tool exists in both."""
    from workers.broker.local import kafka_version

    kafka = compose()["services"]["kafka"]
    assert compose_default(kafka["image"]) == f"apache/kafka:{kafka_version()}"
    assert "${GENPIPE_KAFKA_IMAGE:-" in kafka["image"]
    tool = Path(kafka["healthcheck"]["test"][1])
    assert tool.parent == Path("/opt/kafka/bin")
    assert (ROOT / "ops" / "kafka" / "docker" / tool.name).exists(), f"genpipe/kafka has no {tool}"
    # The host port and the address advertised to host clients move together.
    (port,) = kafka["ports"]
    assert compose_default(port) == "127.0.0.1:9092:9094"
    host_port = port[len("127.0.0.1:"):port.rindex(":")]  # "${GENPIPE_KAFKA_PORT:-9092}"
    assert f"EXTERNAL://127.0.0.1:{host_port}" in kafka["environment"]["KAFKA_ADVERTISED_LISTENERS"]


def test_compose_monitoring_services():
    services = compose()["services"]
    prom = services["prometheus"]
    assert compose_default(prom["image"]).startswith("prom/prometheus")
    assert "./ops/prometheus/prometheus.yml:/etc/prometheus/prometheus.yml:ro" in prom["volumes"]
    assert "--config.file=/etc/prometheus/prometheus.yml" in prom["command"]
    assert any(compose_default(p) == "127.0.0.1:9090:9090" for p in prom["ports"])

    graf = services["grafana"]
    assert compose_default(graf["image"]).startswith("grafana/grafana")
    env = graf["environment"]
    assert env["GF_AUTH_ANONYMOUS_ENABLED"] == "true" and env["GF_AUTH_ANONYMOUS_ORG_ROLE"] == "Viewer"
    mounts = {m.split(":")[0]: m.split(":")[1] for m in graf["volumes"]}
    assert mounts["./ops/grafana/provisioning"] == "/etc/grafana/provisioning"
    home = env["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    dash_dir = mounts["./ops/grafana/dashboards"]
    assert home.startswith(dash_dir + "/") and (GRAFANA / "dashboards" / Path(home).name).exists()
    assert any(compose_default(p) == "127.0.0.1:3000:3000" for p in graf["ports"])


# ---- Prometheus --------------------------------------------------------------------------

def test_prometheus_scrapes_every_compose_worker():
    config = load_yaml(PROMETHEUS)
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert len(jobs) == len(config["scrape_configs"]), "duplicate job_name"
    dns = [sd for job in jobs.values() for sd in job.get("dns_sd_configs", [])]
    assert dns, "no dns_sd_configs job for the compose workers"

    services = compose()["services"]
    workers = worker_services(services)
    # DNS name -> metrics ports of the services answering to it (name or network alias).
    answers: dict[str, set[int]] = {}
    for name, svc in workers.items():
        port = parse_cli(svc["command"], name).metrics_port
        aliases = [name]
        for net in (svc.get("networks") or {}).values():
            aliases += (net or {}).get("aliases", [])
        for alias in aliases:
            answers.setdefault(alias, set()).add(port)

    scraped = set()
    for sd in dns:
        assert sd.get("type", "SRV") == "A" and isinstance(sd["port"], int)
        for name in sd["names"]:
            assert answers.get(name) == {sd["port"]}, \
                f"dns_sd name {name}:{sd['port']} is no compose worker serving metrics on that port"
            scraped.add(name)
    for name in workers:
        svc = workers[name]
        names = {name, *[a for n in (svc.get("networks") or {}).values() for a in (n or {}).get("aliases", [])]}
        assert names & scraped, f"compose worker {name} is not scraped"
    assert {"generate", "derender"} <= scraped
    assert jobs["genpipe"]["dns_sd_configs"]


def test_prometheus_static_example_is_commented():
    text = PROMETHEUS.read_text()
    assert re.search(r"^\s*#.*static_configs", text, re.M)
    assert re.search(r"^\s*#.*targets: \[\"localhost:9400\"", text, re.M)


# ---- Grafana -------------------------------------------------------------------------------

def test_grafana_provisioning():
    ds = load_yaml(GRAFANA / "provisioning" / "datasources" / "prometheus.yml")
    assert ds["apiVersion"] == 1
    (prom,) = [d for d in ds["datasources"] if d["type"] == "prometheus"]
    assert prom["url"] == "http://prometheus:9090" and "prometheus" in compose()["services"]

    prov = load_yaml(GRAFANA / "provisioning" / "dashboards" / "genpipe.yml")
    assert prov["apiVersion"] == 1
    (provider,) = prov["providers"]
    graf = compose()["services"]["grafana"]
    mounts = {m.split(":")[1]: m.split(":")[0] for m in graf["volumes"]}
    assert mounts[provider["options"]["path"]] == "./ops/grafana/dashboards"


def test_dashboard_structure():
    dash = dashboard()
    assert dash["uid"] and dash["title"] and isinstance(dash["schemaVersion"], int)
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    all_panels = panels(dash)
    ids = [p["id"] for p in all_panels]
    assert len(ids) == len(set(ids)), "duplicate panel ids"
    boxes = []
    for p in all_panels:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24, p["title"]
        for other, og in boxes:
            overlap = (g["x"] < og["x"] + og["w"] and og["x"] < g["x"] + g["w"]
                       and g["y"] < og["y"] + og["h"] and og["y"] < g["y"] + g["h"])
            assert not overlap, f"panels {p['title']!r} and {other!r} overlap"
        boxes.append((p["title"], g))
        if p["type"] == "row":
            continue
        assert p["datasource"]["uid"] == "${datasource}", p["title"]
        assert p["targets"], f"panel {p['title']!r} has no queries"
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)), p["title"]
        for t in p["targets"]:
            assert t["expr"].strip() and t["datasource"]["uid"] == "${datasource}"


def test_dashboard_metrics_exist():
    catalogue = metric_catalogue()
    used = set()
    for where, target in dashboard_exprs():
        for name in re.findall(r"\bgenpipe_[A-Za-z0-9_]*", target["expr"]):
            assert name in catalogue, f"{where}: {name} is not exposed by workers/metrics.py"
            used.add(catalogue[name][0])
    missing = DASHBOARD_METRICS - used
    assert not missing, f"dashboard has no panel for {sorted(missing)}"


def test_dashboard_queries_use_real_labels():
    catalogue = metric_catalogue()
    known = {label for _, _, labels in catalogue.values() for label in labels}
    known |= {"le"} | prometheus_target_labels()
    for where, target in dashboard_exprs():
        expr = target["expr"]
        grouped = set()
        for clause in re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", expr):
            labels = {x.strip() for x in clause.split(",") if x.strip()}
            assert labels <= known, f"{where}: unknown label(s) {labels - known} in {expr}"
            grouped |= labels
        for label, op, value in re.findall(r'(\w+)\s*(=~|!~|!=|=)\s*"([^"]*)"', expr):
            assert label in known, f"{where}: unknown label {label} in {expr}"
            if label == "worker" and op == "=":
                assert value in WORKER_LABEL_VALUES, f"{where}: worker={value!r}"
        # A histogram quantile needs the buckets of a histogram, aggregated keeping `le`.
        if "histogram_quantile" in expr:
            names = re.findall(r"\bgenpipe_[A-Za-z0-9_]*", expr)
            assert names and all(n.endswith("_bucket") and catalogue[n][1] == "histogram" for n in names), where
            assert re.search(r"by \((?:[^)]*,\s*)?le\b", expr), f"{where}: quantile without `by (le, ...)`"
        # The legend can only show labels the query keeps.
        legend = set(re.findall(r"\{\{\s*(\w+)\s*\}\}", target.get("legendFormat", "")))
        if re.search(AGGREGATIONS, expr):
            assert legend <= grouped - {"le"}, f"{where}: legend uses {legend - grouped} dropped by {expr}"


def test_dashboard_instance_variable_matches_scrape_jobs():
    variables = {v["name"]: v for v in dashboard()["templating"]["list"]}
    query = variables["instance"]["query"]
    query = query["query"] if isinstance(query, dict) else query
    (pattern,) = re.findall(r'job=~"([^"]+)"', query)
    jobs = [job["job_name"] for job in load_yaml(PROMETHEUS)["scrape_configs"]]
    assert any(re.fullmatch(pattern, j) for j in jobs if j.startswith("genpipe"))
    assert not re.fullmatch(pattern, "prometheus")


# ---- Kubernetes ------------------------------------------------------------------------------

def test_k8s_manifests_parse_and_kustomization_lists_them():
    docs = k8s_docs()
    for name, objs in docs.items():
        assert objs, f"{name} is empty"
        for obj in objs:
            assert {"apiVersion", "kind", "metadata"} <= set(obj), name
            assert "namespace" not in obj["metadata"], f"{name}: manifests are namespace-less"
    kustomization = load_yaml(K8S / "kustomization.yaml")
    assert sorted(kustomization["resources"]) == sorted(docs)


def test_k8s_configmap():
    (cm,) = [o for o in k8s_objects() if o["kind"] == "ConfigMap"]
    data = cm["data"]
    assert "GENPIPE_BOOTSTRAP_SERVERS" in data
    assert all(isinstance(v, str) for v in data.values()), "ConfigMap values must be strings"
    source = "\n".join(p.read_text() for p in (ROOT / "workers").rglob("*.py"))
    for key in data:
        assert f'"{key}"' in source, f"ConfigMap key {key} is read nowhere in workers/"
    for obj in k8s_objects():
        if obj["kind"] in ("Deployment", "Job"):
            for c in genpipe_containers(obj):
                refs = [e["configMapRef"]["name"] for e in c.get("envFrom", []) if "configMapRef" in e]
                assert refs == [cm["metadata"]["name"]], obj["metadata"]["name"]


def test_k8s_container_args_parse():
    found = 0
    for obj in k8s_objects():
        if obj["kind"] not in ("Deployment", "Job"):
            continue
        for c in genpipe_containers(obj):
            assert "command" not in c, "keep the image's genpipe ENTRYPOINT; put the CLI in args"
            parse_cli(c["args"], f"ops/k8s {obj['kind']} {obj['metadata']['name']}")
            found += 1
    assert found >= 3


def _deployments() -> dict[str, dict]:
    out = {}
    for obj in k8s_objects():
        if obj["kind"] == "Deployment":
            (c,) = genpipe_containers(obj)
            out[c["args"][0]] = obj
    return out


def test_k8s_worker_deployments():
    deployments = _deployments()
    assert set(deployments) == {"generate-worker", "derender-worker"}
    for command, dep in deployments.items():
        spec = pod_spec(dep)
        template = dep["spec"]["template"]
        selector = dep["spec"]["selector"]["matchLabels"]
        assert selector.items() <= template["metadata"]["labels"].items(), command
        (c,) = genpipe_containers(dep)
        args = parse_cli(c["args"], command)
        # SIGTERM drains within --grace-period, before the kubelet's SIGKILL.
        assert spec["terminationGracePeriodSeconds"] == 60
        assert args.grace_period is not None and args.grace_period < 60, command
        # Scrape annotations name the metrics port, which the readiness probe checks.
        ann = template["metadata"]["annotations"]
        assert all(isinstance(v, str) for v in ann.values()), "annotation values must be strings"
        assert ann["prometheus.io/scrape"] == "true"
        assert int(ann["prometheus.io/port"]) == args.metrics_port
        ports = {p.get("name"): p["containerPort"] for p in c["ports"]}
        probe_port = c["readinessProbe"]["tcpSocket"]["port"]
        assert ports.get(probe_port, probe_port) == args.metrics_port, command

    gen = deployments["generate-worker"]
    (c,) = genpipe_containers(gen)
    assert parse_cli(c["args"], "generate").device == "cuda"
    assert str(c["resources"]["limits"]["nvidia.com/gpu"]) == "1"
    assert deployments["derender-worker"]["spec"]["replicas"] == 2


def test_k8s_topics_job():
    (job,) = [o for o in k8s_objects() if o["kind"] == "Job"]
    (c,) = genpipe_containers(job)
    assert c["args"][:2] == ["topics", "create"]
    assert pod_spec(job)["restartPolicy"] in ("OnFailure", "Never")


def test_keda_scaledobject_scales_the_generate_deployment_on_metrics_the_workers_export():
    (obj,) = load_yaml_all(K8S / "autoscaling" / "scaledobject.yaml")
    assert obj["kind"] == "ScaledObject"
    generate = _deployments()["generate-worker"]
    assert obj["spec"]["scaleTargetRef"]["name"] == generate["metadata"]["name"]
    from workers.broker.topics import DEFAULT_PARTITIONS

    assert obj["spec"]["minReplicaCount"] >= 1  # Prometheus sees no load with no worker
    assert obj["spec"]["maxReplicaCount"] <= DEFAULT_PARTITIONS  # more would sit idle
    triggers = {t["type"]: t["metadata"] for t in obj["spec"]["triggers"]}
    exported = set(re.findall(r'"(genpipe_[a-z_]+)"', (ROOT / "workers" / "metrics.py").read_text()))
    used = set(re.findall(r"genpipe_[a-z_]+", triggers["prometheus"]["query"]))
    assert used == {"genpipe_consumer_lag_records", "genpipe_waiting_requests", "genpipe_in_flight_requests"}
    assert used <= exported
    assert triggers["kafka"]["consumerGroup"] == "genpipe-generate"
    assert triggers["kafka"]["topic"] == "genpipe.requests"
