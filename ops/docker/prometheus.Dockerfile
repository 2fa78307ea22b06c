# Prometheus from Debian's `prometheus` package, for machines with no image registry
# (docker-compose.yml uses it when GENPIPE_PROMETHEUS_IMAGE=genpipe/prometheus:local).
# Debian bookworm ships Prometheus 2.42: the scrape config, the HTTP API and the flags
# docker-compose.yml passes all work; with a registry, prom/prometheus is the default.
ARG BASE=debian:bookworm-slim
FROM ${BASE}
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends prometheus \
 && rm -rf /var/lib/apt/lists/* \
 && mkdir -p /prometheus /etc/prometheus
EXPOSE 9090
# Same interface as prom/prometheus: arguments come from the compose `command:`.
ENTRYPOINT ["/usr/bin/prometheus"]
CMD ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus"]
