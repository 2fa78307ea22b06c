#!/usr/bin/env bash
# Smoke test of docker-compose.yml with the images ops/docker/build-images.sh builds:
# Kafka, the topics job, the CPU generate worker, the derender workers and Prometheus
# come up under their own compose project on free host ports (so no other broker on
# 9092 is disturbed); requests go in from the host (`genpipe submit`, and kcat when
# installed), answers come back, Prometheus must scrape both workers; then everything,
# volumes included, is torn down. Exit 0 only if every check passed.
#
#   ops/docker/smoke.sh           # env: GENPIPE_SMOKE_PROJECT, GENPIPE_SMOKE_TIMEOUT (s)
set -euo pipefail
cd "$(dirname "$0")/../.."

PROJECT="${GENPIPE_SMOKE_PROJECT:-genpipe-smoke}"
TIMEOUT="${GENPIPE_SMOKE_TIMEOUT:-300}"
KAFKA_VERSION="$(sed -n 's:.*<kafka.version>\(.*\)</kafka.version>.*:\1:p' ops/kafka/pom.xml)"
free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
export GENPIPE_KAFKA_IMAGE="${GENPIPE_KAFKA_IMAGE:-genpipe/kafka:$KAFKA_VERSION}"
export GENPIPE_PROMETHEUS_IMAGE="${GENPIPE_PROMETHEUS_IMAGE:-genpipe/prometheus:local}"
export GENPIPE_KAFKA_PORT="${GENPIPE_KAFKA_PORT:-$(free_port)}"
export GENPIPE_PROMETHEUS_PORT="${GENPIPE_PROMETHEUS_PORT:-$(free_port)}"
BOOTSTRAP="127.0.0.1:$GENPIPE_KAFKA_PORT"
SERVICES=(kafka topics generate-cpu derender prometheus)

log() { printf '[smoke %s] %s\n' "$(date +%H:%M:%S)" "$*"; }
fail() { log "FAILED: $*"; exit 1; }
if command -v docker-compose >/dev/null; then DC=(docker-compose); else DC=(docker compose); fi
dc() { "${DC[@]}" -p "$PROJECT" --profile cpu "$@"; }

for image in "$GENPIPE_KAFKA_IMAGE" "$GENPIPE_PROMETHEUS_IMAGE" genpipe:latest; do
  docker image inspect "$image" >/dev/null 2>&1 \
    || fail "no image $image: run ops/docker/build-images.sh first"
done

finish() {
  rc=$?
  if [ "$rc" != 0 ]; then
    log "logs (last 40 lines per service):"
    dc logs --no-color --tail 40 "${SERVICES[@]}" || true
  fi
  log "tearing down project $PROJECT"
  dc down -v --remove-orphans >/dev/null 2>&1 || log "WARNING: compose down failed"
  exit "$rc"
}
trap finish EXIT

# until SECONDS_LEFT WHAT COMMAND...: rerun COMMAND every second until it succeeds.
until_ok() {
  local limit="$1" what="$2"; shift 2
  local deadline=$((SECONDS + limit))
  until "$@" >/dev/null 2>&1; do
    [ "$SECONDS" -lt "$deadline" ] || fail "$what: not within $limit s"
    sleep 1
  done
}

start=$SECONDS
log "compose up (project $PROJECT, Kafka on $BOOTSTRAP, Prometheus on 127.0.0.1:$GENPIPE_PROMETHEUS_PORT)"
# Waits for Kafka's healthcheck and for the topics job to exit 0 before the workers start.
dc up -d --no-build "${SERVICES[@]}"

workers_healthy() {
  local ids; ids="$(dc ps -q generate-cpu derender)"
  [ -n "$ids" ] || return 1
  ! docker inspect -f '{{.State.Health.Status}}' $ids | grep -qv '^healthy$'
}
until_ok "$TIMEOUT" "workers healthy (metrics ports answering)" workers_healthy
log "workers healthy after $((SECONDS - start)) s: $(dc ps -q generate-cpu derender | wc -l) containers"

submit() { timeout 180 python3 -m workers.cli submit --bootstrap-servers "$BOOTSTRAP" --timeout 120 "$@"; }
out="$(submit --prompt "Once upon a time" --max-tokens 12 --temperature 0 --no-stream --json)" \
  || fail "genpipe submit --prompt"
grep -q '"text_completion"' <<<"$out" || fail "no text_completion in: $out"
log "genpipe submit --prompt: ok"
out="$(submit --chat "user: Hello!" --max-tokens 12)" || fail "genpipe submit --chat"
log "genpipe submit --chat: ok (answer: ${out:0:60}...)"

if command -v kcat >/dev/null; then
  rid="kcat-smoke-$$"
  printf '{"request_id": "%s", "prompt_token_ids": [1, 528, 444, 323], "sampling": {"max_tokens": 8, "temperature": 0}, "output": {"stream": true}}\n' "$rid" \
    | kcat -P -b "$BOOTSTRAP" -t genpipe.requests -k "$rid" -H content-type=application/json
  kcat_final() {
    kcat -C -b "$BOOTSTRAP" -t genpipe.results -o beginning -e -q -f '%k %h\n' | grep -q "^$rid .*genpipe-final=1"
  }
  until_ok 120 "kcat request $rid answered" kcat_final
  log "kcat request/result: ok"
else
  log "kcat not installed: skipped the kcat request"
fi

targets_up() {  # both workers' services scraped by Prometheus, every target up
  curl -sf "http://127.0.0.1:$GENPIPE_PROMETHEUS_PORT/api/v1/targets" | python3 -c '
import json, sys
targets = [t for t in json.load(sys.stdin)["data"]["activeTargets"] if t["labels"]["job"] == "genpipe"]
up = {t["labels"].get("service") for t in targets if t["health"] == "up"}
print(sorted((t["labels"]["instance"], t["health"]) for t in targets))
sys.exit(0 if {"generate", "derender"} <= up and all(t["health"] == "up" for t in targets) else 1)'
}
until_ok 120 "Prometheus scraping generate and derender" targets_up
log "Prometheus targets: $(targets_up)"
log "PASSED in $((SECONDS - start)) s"
