# The genpipe image: the `genpipe` CLI and workers (used by docker-compose.yml).
FROM python:3.11-slim

WORKDIR /src
# Only what the package needs; ops/ and tests/ stay out of the image.
COPY pyproject.toml README.md ./
COPY schemas ./schemas
COPY workers ./workers
RUN pip install --no-cache-dir . && rm -rf /src

WORKDIR /
ENTRYPOINT ["genpipe"]
CMD ["--help"]
