# syntax=docker/dockerfile:1
# The autotune GPU worker image: `autotune worker` on a CUDA PyTorch base, one container per GPU.
#   docker build -f docker/worker.Dockerfile -t autotune-worker .
#   docker run --gpus '"device=0"' --shm-size=8g -e AUTOTUNE_API=https://SERVICE \
#       -v /etc/autotune/worker-token:/run/secrets/worker_token:ro -v autotune-cache:/var/cache/autotune \
#       autotune-worker --device cuda:0 --token-file /run/secrets/worker_token
# (docs/deploy.md; deploy/compose.yaml runs one per GPU with `--scale worker=N`)
# BASE must be a PyTorch image whose torch suits your driver (CUDA 13 needs driver >= 580;
# for older drivers use e.g. pytorch/pytorch:2.11.0-cuda12.8-cudnn9-runtime). The project is
# installed with the base's torch pinned, so the build fails rather than download another torch.
ARG BASE=pytorch/pytorch:2.11.0-cuda13.0-cudnn9-runtime
FROM ${BASE}
# torchao (fp8 training) must match the base's torch: see pytorch/ao's compatibility table and
# pin it here (e.g. --build-arg TORCHAO_SPEC=torchao==0.15.0), or set it empty to leave fp8 out
ARG TORCHAO_SPEC=torchao
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore \
    PYTHONUNBUFFERED=1 \
    AUTOTUNE_API=http://service:8000 \
    AUTOTUNE_DATA_DIR=/var/cache/autotune/data \
    AUTOTUNE_INDUCTOR_CACHE_DIR=/var/cache/autotune/inductor \
    TRITON_CACHE_DIR=/var/cache/autotune/triton

# torch.compile needs a C compiler at run time (Triton builds its kernel launcher with gcc,
# inductor's CPU code needs g++); the -runtime images do not all have one. Versions come with
# the base image's Ubuntu release, which BASE pins.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc g++ \
 && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/autotune
COPY pyproject.toml README.md ./
# autotune/api, autotune/migrations and autotune/search_spaces link to these: the package holds them
COPY autotune ./autotune
COPY api ./api
COPY migrations ./migrations
COPY search_spaces ./search_spaces
# the base's torch as a constraint: pip keeps it, or stops with a conflict
RUN python -c "import torch; print('torch==' + torch.__version__)" > /tmp/torch-constraint.txt \
 && pip install --constraint /tmp/torch-constraint.txt . ${TORCHAO_SPEC:+"$TORCHAO_SPEC"} \
 && python -c "import torch, autotune.worker; print('autotune on torch', torch.__version__)"

RUN groupadd --system --gid 10001 autotune \
 && useradd --system --uid 10001 --gid autotune --create-home autotune \
 && mkdir -p /var/cache/autotune/data /var/cache/autotune/inductor /var/cache/autotune/triton \
 && chown -R autotune:autotune /var/cache/autotune
USER 10001:10001
# compile caches (inductor, Triton) and the generated workload data: a named volume keeps a
# repeated compiled config's warm-up at ~3 s instead of ~30 s across container restarts
VOLUME ["/var/cache/autotune"]
ENTRYPOINT ["autotune", "worker"]
# inside a container given one GPU, that GPU is cuda:0
CMD ["--device", "cuda:0"]
