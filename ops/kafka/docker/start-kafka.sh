#!/bin/bash
# Entry point of the genpipe Kafka image (ops/kafka/Dockerfile): write server.properties
# from the environment, format the KRaft log dir on first start, run the broker.
set -euo pipefail
LIBS=/opt/kafka/libs
CONF=/opt/kafka/config/server.properties
JAVA=(java ${KAFKA_HEAP_OPTS:--Xms256m -Xmx1g} ${KAFKA_JVM_OPTS:-} -cp "$LIBS/*")
mkdir -p "$(dirname "$CONF")"

# Variables that tune the JVM or this script, not the broker.
not_a_property() {
  case "$1" in KAFKA_*_OPTS|KAFKA_LOG_LEVEL|KAFKA_VERSION) return 0 ;; *) return 1 ;; esac
}
{
  echo "# Written by start-kafka.sh from the container's KAFKA_* variables."
  found=0
  while IFS='=' read -r name value; do
    not_a_property "$name" && continue
    key="${name#KAFKA_}"; key="${key,,}"
    key="${key//___/-}"; key="${key//__/@}"; key="${key//_/.}"; key="${key//@/_}"
    echo "$key=$value"; found=1
  done < <(env | grep -E '^KAFKA_[A-Z0-9_]+=' | sort)
  if [ "$found" = 0 ]; then  # no configuration given: one node, default ports
    cat <<'PROPS'
process.roles=broker,controller
node.id=1
controller.quorum.voters=1@localhost:9093
listeners=PLAINTEXT://:9092,CONTROLLER://:9093
advertised.listeners=PLAINTEXT://localhost:9092
controller.listener.names=CONTROLLER
listener.security.protocol.map=CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT
offsets.topic.replication.factor=1
transaction.state.log.replication.factor=1
transaction.state.log.min.isr=1
share.coordinator.state.topic.replication.factor=1
share.coordinator.state.topic.min.isr=1
PROPS
  fi
} >"$CONF"
grep -q '^log\.dirs=' "$CONF" || echo "log.dirs=/var/lib/kafka/data" >>"$CONF"

if [ -z "${CLUSTER_ID:-}" ]; then  # 16 random bytes, base64url, as StorageTool prints
  CLUSTER_ID=-
  while [ "${CLUSTER_ID:0:1}" = - ]; do
    CLUSTER_ID="$(head -c 16 /dev/urandom | base64 | tr '+/' '-_' | tr -d '=')"
  done
fi
# --ignore-formatted: a data volume from an earlier start keeps its cluster id and data.
"${JAVA[@]}" -Dorg.apache.logging.log4j.level=ERROR kafka.tools.StorageTool format \
  -t "$CLUSTER_ID" -c "$CONF" --ignore-formatted
exec "${JAVA[@]}" -Dorg.apache.logging.log4j.level="${KAFKA_LOG_LEVEL:-INFO}" kafka.Kafka "$CONF"
