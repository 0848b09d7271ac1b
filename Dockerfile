# syntax=docker/dockerfile:1
# The autotune service image: the REST API (`autotune serve`), its database migrations
# (`autotune db upgrade`), token administration (`autotune token ...`) and optuna-dashboard.
#   docker build -t autotune .
#   docker run -p 8000:8000 -e AUTOTUNE_DB_URL=postgresql+psycopg://USER@DBHOST/autotune -e PGPASSWORD autotune
#   (the password in PGPASSWORD, or a ~/.pgpass / secret file: never in the URL, which `ps` and logs show)
#   docker run --rm -e AUTOTUNE_DB_URL=... autotune token create --role admin
# Without AUTOTUNE_DB_URL it serves a SQLite file in the /var/lib/autotune volume.
# No torch here: the service never imports it (tests/deploy/test_docker.py checks that). GPU
# workers have their own image, docker/worker.Dockerfile; docs/deploy.md has the compose setup.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# --- build: a virtual environment with the project and its runtime dependencies, minus torch --
FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:$PATH
RUN python -m venv /opt/venv
WORKDIR /src
# dependencies first: this layer is rebuilt only when pyproject.toml changes
COPY pyproject.toml README.md ./
COPY docker/requirements.py docker/requirements.py
RUN python docker/requirements.py --extra dashboard --exclude torch > requirements.txt \
 && pip install --requirement requirements.txt
# autotune/api, autotune/migrations and autotune/search_spaces are links to these folders: the
# wheel holds them inside the autotune package (search spaces as package data)
COPY autotune ./autotune
COPY api ./api
COPY migrations ./migrations
COPY search_spaces ./search_spaces
# --no-deps: the requirements are installed above, and torch must not come in with the project
RUN pip install --no-deps .

# --- the service image -------------------------------------------------------------------------
FROM ${PYTHON_IMAGE}
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    AUTOTUNE_DB_URL=sqlite:////var/lib/autotune/autotune.db \
    AUTOTUNE_HEALTH_URL=http://127.0.0.1:8000/v1/health
COPY --from=build /opt/venv /opt/venv
COPY --chmod=755 docker/healthcheck.py /usr/local/bin/autotune-healthcheck
RUN groupadd --system --gid 10001 autotune \
 && useradd --system --uid 10001 --gid autotune --create-home autotune \
 && mkdir -p /var/lib/autotune \
 && chown autotune:autotune /var/lib/autotune
# numeric, so a runtime that enforces non-root (Kubernetes runAsNonRoot) can check it
USER 10001:10001
WORKDIR /var/lib/autotune
VOLUME ["/var/lib/autotune"]
EXPOSE 8000
# /v1/health needs no token and answers 503 when the database is unreachable; the start
# period covers the schema upgrade `autotune serve` runs before it listens
HEALTHCHECK --interval=30s --timeout=5s --start-period=60s --retries=3 CMD ["autotune-healthcheck"]
ENTRYPOINT ["autotune"]
# on 0.0.0.0 the service requires bearer tokens (see docs/deploy.md for creating the first one)
CMD ["serve", "--host", "0.0.0.0", "--port", "8000"]
