# gpucloud's control-plane image: one image, every component (`gpucloud api | worker | ledger |
# tracker | migrate | agent | sim | fabric-managers`), chosen by the command. No Temporal dev
# server inside (the `embedded` extra is left out): point GPUCLOUD_TEMPORAL__ADDRESS at a cluster.
# syntax=docker/dockerfile:1

FROM python:3.11-slim AS build
WORKDIR /src
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
COPY pyproject.toml README.md ./
COPY gpucloud ./gpucloud
RUN python -m venv /opt/gpucloud \
    && /opt/gpucloud/bin/pip install --upgrade pip \
    && /opt/gpucloud/bin/pip install .

FROM python:3.11-slim
RUN groupadd --system --gid 10001 gpucloud \
    && useradd --system --uid 10001 --gid gpucloud --home-dir /var/lib/gpucloud --create-home gpucloud
COPY --from=build /opt/gpucloud /opt/gpucloud
ENV PATH=/opt/gpucloud/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    GPUCLOUD_DATA_DIR=/var/lib/gpucloud
USER gpucloud:gpucloud
WORKDIR /var/lib/gpucloud
# API, ledger, tracker, worker metrics (each component's health check is in deploy/compose.yaml:
# they listen on different ports)
EXPOSE 8000 8700 8480 9464
ENTRYPOINT ["gpucloud"]
CMD ["--help"]
