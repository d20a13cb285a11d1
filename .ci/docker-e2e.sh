#!/usr/bin/env bash
# Docker end to end, as a user runs it: start a private dockerd, make a stand-in base image (no
# registry here), `docker compose build tokenizer`, `docker compose up --wait tokenizer`, tokenize real
# text through the published port and compare with in-process sentencepiece, then recreate it with a
# model in the mounted models directory and API keys, and compare again. Any failure fails the stage;
# nothing skips. Cleans up (compose down, dockerd stopped, scratch directory removed) on any exit.
#
# Needs root, docker.io, containerd, debootstrap, python3-venv, the compose plugin
# (.ci/install-compose.sh) and the project installed in python3 (`pip install -e '.[test]'`).
set -euo pipefail
cd "$(dirname "$0")/.."

W=$(mktemp -d /tmp/tokenizer-e2e.XXXXXX)
# The Python the project is installed in (before PATH puts /usr/bin first).
PYTHON=${PYTHON:-$(command -v python3)}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}  # the checker imports tests.conftest
# Debian's docker client first (it matches Debian's dockerd); a private daemon on a private socket.
export PATH=/usr/bin:/usr/sbin:$PATH
export DOCKER_CONFIG=$W/docker-config DOCKER_HOST=unix://$W/docker.sock
export COMPOSE_PROJECT_NAME=tokenizer-e2e
export BASE_IMAGE=local/python:3.11-slim
export TOKENIZER_MODELS=$W/models TOKENIZER_WORKERS=2
PORT=$("$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
export TOKENIZER_PUBLISH=127.0.0.1:$PORT
URL=http://127.0.0.1:$PORT

START=$SECONDS
step() { printf '[docker-e2e %4ds] %s\n' $((SECONDS - START)) "$*"; }
fail() { printf '[docker-e2e] FAILED: %s\n' "$*" >&2; exit 1; }

cleanup() {
    local rc=$?
    set +e
    trap - EXIT
    if [ -S "$W/docker.sock" ] && docker info >/dev/null 2>&1; then
        if [ "$rc" -ne 0 ]; then
            docker compose ps -a
            docker compose logs --no-color --tail 200 tokenizer
        fi
        docker compose down --volumes --timeout 20 >/dev/null 2>&1
    fi
    if [ -f "$W/dockerd.pid" ]; then
        local pid
        pid=$(cat "$W/dockerd.pid")
        kill "$pid" 2>/dev/null
        for _ in $(seq 30); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
        kill -9 "$pid" 2>/dev/null
    fi
    [ "$rc" -ne 0 ] && [ -f "$W/dockerd.log" ] && tail -n 40 "$W/dockerd.log"
    # Leftover mounts (a killed daemon) would make rm fail on busy files: unmount first.
    grep -o " $W/[^ ]*" /proc/mounts | sort -r | xargs -r -n1 umount -l 2>/dev/null
    rm -rf "$W"
    step "finished with status $rc"
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

for tool in dockerd debootstrap; do
    command -v "$tool" >/dev/null || fail "$tool is missing (apt-get install docker.io containerd debootstrap)"
done
docker compose version >/dev/null 2>&1 || fail "the docker compose plugin is missing (.ci/install-compose.sh)"
mkdir -p "$DOCKER_CONFIG" "$TOKENIZER_MODELS"

step "starting dockerd"
dockerd --host "$DOCKER_HOST" --data-root "$W/docker-data" --exec-root "$W/docker-exec" \
    --pidfile "$W/dockerd.pid" >"$W/dockerd.log" 2>&1 &
for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
docker info >/dev/null 2>&1 || fail "dockerd did not start"

step "docker compose config"
docker compose config -q

step "building the stand-in base image $BASE_IMAGE (debootstrap bookworm)"
debootstrap --variant=minbase --include=python3,python3-venv,python3-pip,python-is-python3,ca-certificates \
    bookworm "$W/rootfs" >"$W/debootstrap.log" 2>&1 || { tail -n 40 "$W/debootstrap.log"; fail "debootstrap"; }
rm -rf "$W"/rootfs/var/cache/apt/archives/*.deb "$W"/rootfs/var/lib/apt/lists/* \
    "$W"/rootfs/usr/lib/python3.*/EXTERNALLY-MANAGED
cp /etc/ssl/certs/ca-certificates.crt "$W/rootfs/etc/ssl/certs/ca-certificates.crt"
tar -C "$W/rootfs" -c . | docker import \
    -c 'ENV LANG=C.UTF-8 PIP_CERT=/etc/ssl/certs/ca-certificates.crt SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt' \
    -c 'CMD ["python3"]' - "$BASE_IMAGE" >/dev/null
rm -rf "$W/rootfs"

step "docker compose build tokenizer"
docker compose build --progress plain tokenizer >"$W/build.log" 2>&1 || { tail -n 60 "$W/build.log"; fail "build"; }
docker image ls --format '  {{.Repository}}:{{.Tag}} {{.Size}}' tokenizer-service

step "docker compose up --wait tokenizer (models dir empty: the bundled default model)"
docker compose up --detach --wait --wait-timeout 180 tokenizer
"$PYTHON" .ci/docker_e2e_check.py --url "$URL" --model default=app/models/default.model

step "the image's own HEALTHCHECK, the user and the read-only root filesystem"
"$PYTHON" .ci/docker_e2e_check.py --url "$URL" --inspect tokenizer-service:latest --service tokenizer

step "a model in the mounted models directory, and API keys, in a recreated container"
"$PYTHON" - "$TOKENIZER_MODELS" <<'PY'
import sys
import sentencepiece as spm

spm.SentencePieceTrainer.train(
    input="tests/data/botchan.txt", model_prefix=f"{sys.argv[1]}/botchan_bpe", model_type="bpe",
    vocab_size=2000, byte_fallback=True, minloglevel=2, num_threads=2,
)
PY
chmod a+r "$TOKENIZER_MODELS"/*
export TOKENIZER_API_KEYS=e2e-key-1,e2e-key-2
docker compose up --detach --wait --wait-timeout 180 tokenizer
"$PYTHON" .ci/docker_e2e_check.py --url "$URL" --model "botchan_bpe=$TOKENIZER_MODELS/botchan_bpe.model" \
    --api-key e2e-key-2

step "a Hugging Face snapshot directory and a tiktoken file with its sidecar beside it, ids as their libraries give them"
"$PYTHON" - "$TOKENIZER_MODELS" <<'PY'
import sys
from pathlib import Path

from tests.conftest import read_documents, read_multilingual
from tests.tokenizer_models import write_bpe_snapshot, write_tiktoken

texts = read_documents() + read_multilingual()
snapshot = write_bpe_snapshot(Path(sys.argv[1]) / "hfbpe", texts)
write_tiktoken(Path(sys.argv[1]) / "ranks.tiktoken", texts)
# a chat template beside the tokenizer.json, as recent Hub snapshots ship it: conversations with loss masks
(snapshot / "chat_template.jinja").write_text(
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n"
    "{% if m.role == 'assistant' %}{% generation %}{{ m.content }}<|end_of_text|>{% endgeneration %}"
    "{% else %}{{ m.content }}<|end_of_text|>{% endif %}{% endfor %}"
)
PY
chmod -R a+rX "$TOKENIZER_MODELS"
docker compose up --detach --wait --wait-timeout 180 --force-recreate tokenizer
"$PYTHON" .ci/docker_e2e_check.py --url "$URL" --api-key e2e-key-2 \
    --library-model "hfbpe=$TOKENIZER_MODELS/hfbpe" --library-model "ranks=$TOKENIZER_MODELS/ranks.tiktoken"

step "docker compose stop: SIGTERM is a clean stop (exit status 0, not 143)"
docker compose stop --timeout 20 tokenizer
status=$(docker inspect --format '{{.State.ExitCode}}' "$(docker compose ps --all --quiet tokenizer)")
[ "$status" = 0 ] || fail "the stopped container exited with status $status, not 0"

step "a model file the container cannot read: up --wait fails, the log says why in one line"
chmod 600 "$TOKENIZER_MODELS/botchan_bpe.model"
if docker compose up --detach --wait --wait-timeout 90 tokenizer; then
    fail "up --wait succeeded with an unreadable model"
fi
docker compose logs --no-color tokenizer 2>&1 | grep "tokenizer-server: model 'botchan_bpe': cannot read" ||
    fail "the log does not name the unreadable model"
chmod a+r "$TOKENIZER_MODELS/botchan_bpe.model"

step "docker compose down"
docker compose down --volumes --timeout 20
step "passed"
