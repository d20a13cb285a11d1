# tokenizer-server in a container: FastAPI on a pool of tokenizer worker processes.
#
#   docker build -t tokenizer-service .
#   docker run -p 8000:8000 -v "$PWD/models:/models:ro" tokenizer-service
#
# Every *.model (SentencePiece, or tiktoken ranks) and *.tiktoken in /models is served under its file stem, and every
# subdirectory holding a tokenizer.json (a Hugging Face Hub snapshot), a tekken.json (Mistral) or an
# original/tokenizer.model (Meta) under its name; Mistral's tekken*.json and NAME.model.vN files too; with /models
# empty the bundled default model is served. Flags after the image name go to tokenizer-server (e.g. `--workers 4`).
# BASE_IMAGE lets CI build from a stand-in image where no registry is reachable; its python must be 3.10+.
# EXTRAS picks the project's extras: `--build-arg EXTRAS=server,corpora` adds tokenizer-pretokenize and
# tokenizer-shards with Parquet and zstandard inputs (the image deploy/k8s/pretokenize-job.yaml runs).
ARG BASE_IMAGE=python:3.11-slim

# Builder: a virtual environment holding the project and its server dependencies, nothing else.
FROM ${BASE_IMAGE} AS builder
ARG EXTRAS=server
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PYTHONDONTWRITEBYTECODE=1
WORKDIR /src
RUN python -m venv /opt/venv
# Dependencies first, from pyproject.toml alone (empty packages stand in for the sources), so editing
# the code rebuilds only the last layer.
COPY pyproject.toml README.md ./
RUN for package in app app/core app/http app/http/routes app/tools app/tools/pretokenize client client/prefetch; do \
        mkdir -p "$package" && touch "$package/__init__.py"; done \
    && /opt/venv/bin/pip install --no-cache-dir ".[${EXTRAS}]" \
    && rm -rf app client build ./*.egg-info
COPY client ./client
COPY app ./app
RUN /opt/venv/bin/pip install --no-cache-dir --no-deps --force-reinstall . \
    && rm -rf build ./*.egg-info

# Runtime: the base image plus that virtual environment, run as an unprivileged user.
FROM ${BASE_IMAGE}
RUN groupadd --system --gid 10001 tokenizer \
    && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent \
        --shell /usr/sbin/nologin tokenizer \
    && mkdir /models
COPY --from=builder /opt/venv /opt/venv
# DL3064 matches "TOKEN" inside TOKENIZER_*: these are settings, not secrets.
# hadolint ignore=DL3064
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    TOKENIZER_HOST=0.0.0.0 \
    TOKENIZER_PORT=8000 \
    TOKENIZER_MODELS_DIR=/models \
    TOKENIZER_EMPTY_MODELS_DIR=bundled \
    TOKENIZER_CACHE_DIR=/tmp/tokenizer-cache
USER 10001:10001
EXPOSE 8000
# 200 only once the models are loaded and the worker pool serves; urllib raises (exit 1) on 503 or no answer.
HEALTHCHECK --interval=10s --timeout=6s --start-period=60s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:' + os.environ.get('TOKENIZER_PORT', '8000') + '/readyz', timeout=5)"]
ENTRYPOINT ["tokenizer-server"]
