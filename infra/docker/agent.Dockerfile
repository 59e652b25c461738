# The provider agent (`sparecycles agent run`) on a GPU machine: torch's CUDA build,
# bubblewrap for the plugin sandbox, its own unprivileged user.
# Build from the repository root:
#   podman build -f infra/docker/agent.Dockerfile -t sparecycles-agent .
# Run (GPUs through the NVIDIA container toolkit; the sandbox needs user namespaces and its
# own /proc, see infra/README.md, *Agent container*):
#   docker run --gpus all --security-opt seccomp=unconfined --security-opt systempaths=unconfined \
#     -e SPARECYCLES_API_KEY=sc_provider_… -v sparecycles-agent:/var/lib/sparecycles-agent \
#     sparecycles-agent --broker broker.example.com:50051
#
# CUDA_IMAGE pins the base: NVIDIA's CUDA base image (Ubuntu 24.04: Python 3.12), which sets
# NVIDIA_VISIBLE_DEVICES / NVIDIA_DRIVER_CAPABILITIES for the container toolkit. The CUDA
# libraries themselves come with torch's wheels (PyPI's Linux torch is the CUDA build).
ARG CUDA_IMAGE=docker.io/nvidia/cuda:12.8.1-base-ubuntu24.04

# ---- build: the project with the agent's dependencies in a virtual environment ------------
FROM ${CUDA_IMAGE} AS build
ENV DEBIAN_FRONTEND=noninteractive \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PYTHONDONTWRITEBYTECODE=1
# The distribution's own Python; versions follow the base image's pinned release.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
RUN python3 -m venv /opt/sparecycles
# Dependencies first (the metadata alone), so a code change rebuilds only the
# last layer. torch's version is the one constraints.txt pins.
COPY pyproject.toml setup.py constraints.txt ./
# README.md is the metadata's long description only: an empty one here, the real one with
# the code, so that editing it (or the .proto files) does not reinstall every dependency.
RUN touch README.md \
 && /opt/sparecycles/bin/pip install --no-cache-dir -c constraints.txt ".[agent]"
COPY README.md ./
COPY sdk sdk
COPY broker broker
COPY provider_agent provider_agent
COPY plugins plugins
RUN /opt/sparecycles/bin/pip install --no-cache-dir --no-deps --force-reinstall . \
 && /opt/sparecycles/bin/sparecycles agent run --help >/dev/null

# ---- runtime ------------------------------------------------------------------------------
FROM ${CUDA_IMAGE}
LABEL org.opencontainers.image.title="sparecycles-agent" \
      org.opencontainers.image.description="Sparecycles provider agent (CUDA)" \
      org.opencontainers.image.licenses="Apache-2.0"
ENV DEBIAN_FRONTEND=noninteractive
# python3 for the environment copied below; bubblewrap and libseccomp2 sandbox every plugin
# host (never --no-sandbox in an image). The GPUs' device nodes come from the NVIDIA
# container toolkit, usable by any user, so the agent's user needs no video group.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 bubblewrap libseccomp2 ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --system --gid 10002 sparecycles-agent \
 && useradd --no-log-init --uid 10002 --gid sparecycles-agent \
      --home-dir /var/lib/sparecycles-agent --create-home --shell /usr/sbin/nologin \
      sparecycles-agent
COPY --from=build /opt/sparecycles /opt/sparecycles
COPY infra/docker/agent-entrypoint.sh /opt/sparecycles/agent-entrypoint.sh
ENV PATH=/opt/sparecycles/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    SPARECYCLES_AGENT_HOME=/var/lib/sparecycles-agent \
    SPARECYCLES_LOG_FORMAT=json \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility
# agent.toml (rewritten at each start) and the machine's identity key (kept): a volume.
VOLUME ["/var/lib/sparecycles-agent"]
WORKDIR /var/lib/sparecycles-agent
USER 10002:10002
# The agent's own /metrics, when run with --metrics-addr 0.0.0.0:9464.
EXPOSE 9464
# No HEALTHCHECK: the agent serves nothing by default, it dials out to the broker, which
# shows whether it is connected (the console, GET /v1/providers); run it with
# --metrics-addr and watch sparecycles_agent_* in Prometheus.
# Arguments: `agent init`'s (at least --broker HOST:PORT), then -- and `agent run`'s.
ENTRYPOINT ["/opt/sparecycles/agent-entrypoint.sh"]
