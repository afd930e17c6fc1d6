# The image a Docker (or Kubernetes / ECS) work pool runs TrainMover's flows in: `prefect deploy --prefect-file
# prefect.docker.yaml --all` builds and pushes it (see docs/flows.md, "A Docker work pool").
#
# TORCH_INDEX picks torch's build: CUDA 12.8 wheels by default (for a GPU worker host); pass
# --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cpu for a CPU-only image (about 1 GB smaller).
FROM python:3.11-slim

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu128

ENV PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1

# iproute2: `ip`, for namespace hosts in drills and for agents bound to an interface.
RUN apt-get update -qq && apt-get install -y -qq --no-install-recommends iproute2 && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/trainmover
RUN pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX}"
COPY pyproject.toml README.md ./
COPY runtime runtime
COPY policy policy
COPY cloud cloud
COPY flows flows
COPY trainmover trainmover
COPY examples examples
COPY bench bench
RUN pip install -e ".[flows,cloud]"

# No secret is baked in: cloud credentials come from a Prefect Secret block (credentials_block) or the worker
# host's identity; the job's own secret is made per run.
