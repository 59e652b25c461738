# The broker: REST API and agent gateway (`sparecycles broker serve`). No torch, no CUDA.
# Build from the repository root:
#   podman build -f infra/docker/broker.Dockerfile -t sparecycles-broker .
# (docker build likewise). PYTHON_IMAGE pins the base: the official Python image, whose
# Debian release and Python patch level the tag names; any Debian-like image with python3
# and its venv module works (the tests build on one made with debootstrap).
ARG PYTHON_IMAGE=docker.io/library/python:3.11.14-slim-bookworm

# ---- build: the project and its broker dependencies in a virtual environment -------------
FROM ${PYTHON_IMAGE} AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PYTHONDONTWRITEBYTECODE=1
WORKDIR /src
RUN python3 -m venv /opt/sparecycles
# Dependencies first, from the metadata alone, so that a code change
# rebuilds only the last layer. `.[broker]`: the broker's extra (Flask, uvicorn, SQLAlchemy,
# psycopg, grpcio, boto3, …), bounded in pyproject.toml; torch is never pulled (the agent's).
COPY pyproject.toml setup.py constraints.txt ./
# README.md is the metadata's long description only: an empty one here, the real one with
# the code, so that editing it (or the .proto files) does not reinstall every dependency.
RUN touch README.md \
 && /opt/sparecycles/bin/pip install --no-cache-dir -c constraints.txt ".[broker]"
COPY README.md ./
COPY sdk sdk
COPY broker broker
COPY provider_agent provider_agent
COPY plugins plugins
RUN /opt/sparecycles/bin/pip install --no-cache-dir --no-deps --force-reinstall . \
 && /opt/sparecycles/bin/sparecycles broker serve --help >/dev/null

# ---- runtime: the environment, a user of its own, nothing else --------------------------
FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="sparecycles-broker" \
      org.opencontainers.image.description="Sparecycles broker: REST API and agent gateway" \
      org.opencontainers.image.licenses="Apache-2.0"
# uid/gid 10001: never root; a fixed number so volumes and Kubernetes' runAsUser agree.
# blobs/ exists, owned by it, so that a fresh named volume mounted there (the registry's
# files, shared by replicas: infra/compose.yaml) takes that owner.
RUN groupadd --system --gid 10001 sparecycles \
 && useradd --no-log-init --uid 10001 --gid sparecycles --home-dir /var/lib/sparecycles \
      --create-home --shell /usr/sbin/nologin sparecycles \
 && install -d -o 10001 -g 10001 -m 0700 /var/lib/sparecycles/blobs
COPY --from=build /opt/sparecycles /opt/sparecycles
COPY infra/docker/healthcheck.py /opt/sparecycles/healthcheck.py
# Settings are environment variables (broker/settings.py); these are the container's
# defaults: all interfaces (so TLS is needed, or SPARECYCLES_INSECURE=1 behind a proxy that
# terminates it), the data dir a volume.
ENV PATH=/opt/sparecycles/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    SPARECYCLES_DATA_DIR=/var/lib/sparecycles \
    SPARECYCLES_HTTP=0.0.0.0:8080 \
    SPARECYCLES_GRPC=0.0.0.0:50051 \
    SPARECYCLES_LOG_FORMAT=json
VOLUME ["/var/lib/sparecycles"]
WORKDIR /var/lib/sparecycles
USER 10001:10001
EXPOSE 8080 50051
HEALTHCHECK --interval=10s --timeout=5s --start-period=30s --retries=3 \
  CMD ["python3", "/opt/sparecycles/healthcheck.py", "/readyz"]
# `sparecycles broker serve` by default; another broker command as the arguments
# (`migrate`, `create-key --role admin`, `dev-cert --out /tls`, …).
ENTRYPOINT ["sparecycles", "broker"]
CMD ["serve"]
