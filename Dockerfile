# The genpipe image: the `genpipe` CLI and workers (docker-compose.yml, ops/k8s).
#   docker build -t genpipe:latest .                       # base debian:bookworm-slim
#   ops/docker/build-images.sh                             # no registry: local base, cached
# torch from PyPI is the CUDA build (its CUDA libraries come as nvidia-* wheels; the
# host's NVIDIA driver and Container Toolkit supply the rest): the same image runs on a
# GPU (`--device cuda`) and on CPU. For a smaller CPU-only image:
#   docker build --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu -t genpipe:cpu .
ARG BASE=debian:bookworm-slim
FROM ${BASE}
# Debian bookworm's python3 is 3.11 (genpipe needs 3.11+); a venv keeps pip off the system.
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      python3 python3-venv ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && python3 -m venv /opt/genpipe
ENV PATH=/opt/genpipe/bin:$PATH PYTHONDONTWRITEBYTECODE=1

# Dependencies first, from pyproject.toml alone: a code change rebuilds only the last layer.
# PIP_ARGS: extra pip options (build-images.sh installs from a local wheelhouse with them).
ARG PIP_ARGS=
ARG TORCH_INDEX_URL=
WORKDIR /src
COPY pyproject.toml ./
RUN if [ -n "$TORCH_INDEX_URL" ]; then pip install $PIP_ARGS --index-url "$TORCH_INDEX_URL" torch; fi \
 && python3 -c 'import tomllib; print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]))' >/tmp/deps.txt \
 && pip install --no-cache-dir $PIP_ARGS -r /tmp/deps.txt && rm /tmp/deps.txt

# Only what the package needs; ops/ and tests/ stay out of the image (.dockerignore).
COPY README.md ./
COPY schemas ./schemas
COPY workers ./workers
RUN pip install --no-cache-dir $PIP_ARGS --no-deps . && rm -rf /src

WORKDIR /
ENTRYPOINT ["genpipe"]
CMD ["--help"]
