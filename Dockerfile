# syntax=docker/dockerfile:1
# The rate-limiting gateway as a small, non-root image.
#
#   docker build -t ratelimit-gateway .
#   docker run --rm -p 8080:8080 -p 127.0.0.1:9090:9090 ratelimit-gateway
#
# The operator console (port 9090) answers 403 until GATEWAY_ADMIN_TOKEN is set (the admin
# port listens on 0.0.0.0 here, not on loopback): docker run -e GATEWAY_ADMIN_TOKEN ...
#
# Without GATEWAY_UPSTREAM the container serves the built-in Store and control plane with
# in-process counters. Sidecar / Redis / several regions: see docs/deployment.md.

# --- build: install the project and its dependencies into a virtualenv -----------------
# gcc compiles the data plane's hot modules (mypyc, setup.py); the runtime image needs no
# compiler.
FROM python:3.11-slim AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY gateway ./gateway
RUN python -m venv /opt/venv \
 && /opt/venv/bin/pip install --upgrade pip \
 && /opt/venv/bin/pip install .

# --- runtime: the virtualenv, the rules and an unprivileged user ---------------------------
FROM python:3.11-slim
RUN groupadd --system --gid 10001 gateway \
 && useradd --system --uid 10001 --gid gateway --home-dir /data --no-create-home \
      --shell /usr/sbin/nologin gateway \
 && mkdir -p /data /etc/gateway \
 && chown gateway:gateway /data
COPY --from=build /opt/venv /opt/venv
# Baked-in rules; mount a directory over /etc/gateway/rules to use your own (edits to
# mounted files are picked up without a restart).
COPY rules/ /etc/gateway/rules/
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
# Listen on every interface inside the container (the gateway's own default is loopback);
# the admin port serves /metrics for Prometheus (open), /info (to a Host naming the
# container) and /console (only with GATEWAY_ADMIN_TOKEN set, since this is not loopback).
ENV GATEWAY_HOST=0.0.0.0 \
    GATEWAY_ADMIN_HOST=0.0.0.0 \
    GATEWAY_RULES=/etc/gateway/rules \
    GATEWAY_DATA_DIR=/data \
    GATEWAY_ACCESS_LOG=json
VOLUME ["/data"]
# ./rules is the default rule path, so `gateway rules check|explain` run with
# `docker exec` find the baked-in rules from here.
WORKDIR /etc/gateway
USER 10001:10001
EXPOSE 8080 9090
# `gateway health` asks this container's gateway for /ok with the settings `gateway serve`
# reads: it follows the port (GATEWAY_PORT or the config file) and speaks HTTPS when TLS is
# on (a plain-HTTP probe failed then).
HEALTHCHECK --interval=15s --timeout=3s --start-period=10s --retries=3 \
  CMD ["gateway", "health"]
# Every setting comes from GATEWAY_* variables (flag > environment > config file); the
# command carries no flags so that each of them can still be changed with -e/environment:.
CMD ["gateway", "serve"]
