#!/usr/bin/env bash
# Builds genpipe's images without an image registry, each only when its inputs changed:
#   genpipe/debian:bookworm   the base (ops/docker/build-base.sh; skipped when present)
#   genpipe/kafka:<version>   Kafka from the Maven jars of ops/kafka/pom.xml (ops/kafka/Dockerfile)
#   genpipe:latest            the CLI and workers (Dockerfile)
#   genpipe/prometheus:local  Debian's prometheus package (ops/docker/prometheus.Dockerfile)
# Each image carries a label genpipe.inputs = sha256 of its inputs (files, base image id,
# build args); a rerun with nothing changed builds nothing.
#
#   ops/docker/build-images.sh [base|kafka|genpipe|prometheus ...]   # default: all
#
# Env: GENPIPE_BASE_IMAGE (default genpipe/debian:bookworm; set debian:bookworm-slim to use
# the registry's), GENPIPE_CACHE_DIR (Kafka jars, the pip wheelhouse), GENPIPE_PIP_DIRECT=1
# (pip inside the build downloads from PyPI itself instead of the host's wheelhouse),
# GENPIPE_WHEELHOUSE_PORT (default 38765: the loopback port that serves the wheelhouse to
# the build; fixed, because it is part of a build argument and so of the layer cache).
# Runs `docker build --network host` (the legacy builder; no BuildKit needed).
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT="$PWD"
BASE="${GENPIPE_BASE_IMAGE:-genpipe/debian:bookworm}"
CACHE="${GENPIPE_CACHE_DIR:-$HOME/.cache/genpipe}"
KAFKA_VERSION="$(sed -n 's:.*<kafka.version>\(.*\)</kafka.version>.*:\1:p' ops/kafka/pom.xml)"
KAFKA_IMAGE="genpipe/kafka:$KAFKA_VERSION"
PROMETHEUS_IMAGE="genpipe/prometheus:local"
GENPIPE_IMAGE="genpipe:latest"
TARGETS=("$@")
[ ${#TARGETS[@]} -gt 0 ] || TARGETS=(base kafka genpipe prometheus)

log() { printf '[build-images %s] %s\n' "$(date +%H:%M:%S)" "$*"; }
wants() { [[ " ${TARGETS[*]} " == *" $1 "* ]]; }

# inputs_hash EXTRA PATH...: sha256 over the files' paths and contents, the base image's
# id and EXTRA (build args), so any change to what goes into an image rebuilds it.
inputs_hash() {
  local extra="$1"; shift
  { docker image inspect -f '{{.Id}}' "$BASE"; echo "$extra"
    find "$@" -type f ! -path '*/__pycache__/*' ! -name '*.pyc' | LC_ALL=C sort \
      | while read -r f; do echo "$f"; sha256sum <"$f"; done
  } | sha256sum | cut -c1-16
}
up_to_date() {  # up_to_date IMAGE HASH
  [ "$(docker image inspect -f '{{index .Config.Labels "genpipe.inputs"}}' "$1" 2>/dev/null)" = "$2" ]
}
build() {  # build IMAGE HASH DOCKERFILE CONTEXT [docker build args...]
  local image="$1" hash="$2" dockerfile="$3" context="$4"; shift 4
  local start=$SECONDS old
  old="$(docker image inspect -f '{{.Id}}' "$image" 2>/dev/null || true)"
  log "$image: building (inputs $hash)"
  docker build --network host -q -f "$dockerfile" --build-arg "BASE=$BASE" \
    --label "genpipe.inputs=$hash" -t "$image" "$@" "$context" >/dev/null \
    2> >(grep -vE 'DEPRECATED: The legacy builder|Install the buildx|docs.docker.com/go/buildx|^$' >&2)
  # The image this one replaces (now untagged): drop it, keeping the layers still used.
  if [ -n "$old" ] && [ "$old" != "$(docker image inspect -f '{{.Id}}' "$image")" ]; then
    docker image rm "$old" >/dev/null 2>&1 || true
  fi
  log "$image: built in $((SECONDS - start)) s, $(docker image inspect -f '{{.Size}}' "$image" | numfmt --to=iec)"
}

if wants base || ! docker image inspect "$BASE" >/dev/null 2>&1; then
  ops/docker/build-base.sh "$BASE"
fi

if wants kafka; then
  hash="$(inputs_hash "" ops/kafka/Dockerfile ops/kafka/docker ops/kafka/pom.xml)"
  if up_to_date "$KAFKA_IMAGE" "$hash"; then
    log "$KAFKA_IMAGE: up to date"
  else
    # The context: the broker's jars (resolved by Maven on the host, like the local
    # broker's; cached) plus kafka-tools for kafka-broker-api-versions.sh.
    ctx="$CACHE/docker/kafka-context"
    rm -rf "$ctx" && mkdir -p "$ctx"
    libs="$(python3 -c 'from workers.broker.local import ensure_jars; print(ensure_jars(quiet=True))')"
    cp -r "$libs" "$ctx/libs"
    out="$(mvn -q -B -Dstyle.color=never dependency:copy -DoutputDirectory="$ctx/libs" \
      -Dartifact="org.apache.kafka:kafka-tools:$KAFKA_VERSION" </dev/null 2>&1)" \
      || { echo "$out" >&2; echo "error: Maven could not fetch kafka-tools $KAFKA_VERSION" >&2; exit 1; }
    cp ops/kafka/docker/* "$ctx/"
    build "$KAFKA_IMAGE" "$hash" ops/kafka/Dockerfile "$ctx"
  fi
fi

if wants genpipe; then
  port="${GENPIPE_WHEELHOUSE_PORT:-38765}"
  pip_args="--no-index --find-links http://127.0.0.1:$port/ --trusted-host 127.0.0.1"
  [ "${GENPIPE_PIP_DIRECT:-0}" = 1 ] && pip_args=""
  hash="$(inputs_hash "PIP_ARGS=$pip_args" Dockerfile .dockerignore pyproject.toml README.md schemas workers)"
  if up_to_date "$GENPIPE_IMAGE" "$hash"; then
    log "$GENPIPE_IMAGE: up to date"
  elif [ -z "$pip_args" ]; then
    build "$GENPIPE_IMAGE" "$hash" Dockerfile .
  else
    # pip inside the build gets every wheel from a wheelhouse the host's pip fills (and
    # keeps: a rebuild downloads nothing new), served on loopback for the build only.
    wheels="$CACHE/wheelhouse"
    mkdir -p "$wheels" "$CACHE/docker"
    rm -f "$CACHE/docker/wheelhouse.port"
    # (on its own: in one substitution with the printf, a failure here was hidden and the
    # wheelhouse got setuptools and wheel alone, found only inside `docker build`)
    deps="$(python3 -c 'import tomllib; print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]))')"
    reqs="$deps"$'\n''setuptools>=68'$'\n''wheel'
    # The image's Python (Debian bookworm's 3.11), not the host's: pip downloads for the
    # interpreter it runs on, and a 3.12 host's wheels (cp312) would not install in the image
    target=(--only-binary=:all: --python-version 3.11 --implementation cp --platform manylinux_2_28_x86_64
            --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
    marker="${target[*]}"$'\n'"$reqs"
    if [ "$(cat "$wheels/.genpipe-requirements" 2>/dev/null)" != "$marker" ]; then
      log "wheelhouse $wheels: pip download"
      python3 -m pip download -q -d "$wheels" "${target[@]}" -r /dev/stdin <<<"$reqs"
      printf '%s\n' "$marker" >"$wheels/.genpipe-requirements"
    fi
    python3 ops/docker/serve_dir.py "$wheels" "$port" >"$CACHE/docker/wheelhouse.port" &
    server=$!
    trap 'kill "$server" 2>/dev/null || true' EXIT
    for _ in $(seq 100); do  # until it listens (or exits: port taken)
      [ -s "$CACHE/docker/wheelhouse.port" ] || ! kill -0 "$server" 2>/dev/null && break
      sleep 0.1
    done
    [ -s "$CACHE/docker/wheelhouse.port" ] || { echo "error: the wheelhouse server did not start" >&2; exit 1; }
    build "$GENPIPE_IMAGE" "$hash" Dockerfile . --build-arg "PIP_ARGS=$pip_args"
    kill "$server" 2>/dev/null || true
  fi
fi

if wants prometheus; then
  hash="$(inputs_hash "" ops/docker/prometheus.Dockerfile)"
  if up_to_date "$PROMETHEUS_IMAGE" "$hash"; then
    log "$PROMETHEUS_IMAGE: up to date"
  else
    ctx="$(mktemp -d)"
    build "$PROMETHEUS_IMAGE" "$hash" ops/docker/prometheus.Dockerfile "$ctx"
    rmdir "$ctx"
  fi
fi
log "done: $BASE $KAFKA_IMAGE $GENPIPE_IMAGE $PROMETHEUS_IMAGE"
