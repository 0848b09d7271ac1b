# autotune service and workers.
#   docker build -t autotune .                                   # CPU image (service, CPU workers)
#   docker build -t autotune-gpu --build-arg BASE=pytorch/pytorch:2.7.1-cuda12.8-cudnn9-runtime \
#                --build-arg TORCH_SPEC= .                       # GPU workers: torch from the base image
#   docker run -p 8000:8000 -e AUTOTUNE_DB_URL=postgresql+psycopg://USER@DB/autotune autotune
#   docker run --gpus all autotune-gpu worker --api http://SERVICE:8000 --device cuda:0
ARG BASE=python:3.11-slim
FROM ${BASE}

# CPU build of torch unless the base image brings its own (set TORCH_SPEC empty then)
ARG TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"
ENV PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1 AUTOTUNE_DATA_DIR=/var/lib/autotune/data \
    AUTOTUNE_SPACES_DIR=/opt/autotune/search_spaces

WORKDIR /opt/autotune
COPY pyproject.toml README.md ./
COPY autotune ./autotune
COPY api ./api
COPY search_spaces ./search_spaces
RUN if [ -n "$TORCH_SPEC" ]; then pip install $TORCH_SPEC; fi \
 && pip install ".[dashboard]" \
 && useradd --create-home --uid 1000 autotune \
 && mkdir -p /var/lib/autotune/data && chown -R autotune /var/lib/autotune
USER autotune
EXPOSE 8000
ENTRYPOINT ["autotune"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000"]
