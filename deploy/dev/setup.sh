#!/usr/bin/env bash
# Everything the demo and the tests need on a fresh Debian 12 machine (root), idempotently:
#   - a virtualenv in .venv with the project, the worker extra (TensorFlow CPU) and dev tools;
#   - the consumer environments (Rodan's TensorFlow versions, consumers/), built once and cached;
#   - RabbitMQ answering on 127.0.0.1:5672 (started, or installed then started, unless RABBITMQ_URL is set);
#   - the single-node Slurm cluster (deploy/dev/slurm.sh up) and Grid Engine (deploy/dev/gridengine.sh up),
#     each of which also makes sure of a second unix user (HPC_DEV_OTHER_USER, default hpcother, created
#     with useradd when missing, with a Slurm accounting association) that the backend tests submit
#     held jobs as, to check that the bridge never reads, adopts or cancels another user's jobs.
# Second run: a few seconds (nothing is reinstalled unless pyproject.toml changed).
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$repo"
say() { printf '[setup] %s\n' "$*"; }

# --- Python environment --------------------------------------------------------------
python=${PYTHON:-python3}
if ! "$python" -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null; then
    echo "[setup] need Python >= 3.10 (set PYTHON=/path/to/python3)" >&2
    exit 1
fi
if [ ! -x .venv/bin/python ]; then
    say "creating .venv with $("$python" --version)"
    "$python" -m venv .venv
fi
stamp=.venv/.hpc-bridge-installed
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    say "installing the project into .venv (TensorFlow CPU included; about a minute the first time)"
    .venv/bin/python -m pip install --quiet --upgrade pip
    .venv/bin/python -m pip install --quiet -e '.[worker,jax-cpu,dev]'
    echo "$want" > "$stamp"
else
    say ".venv is up to date"
fi

# --- Consumer environments: the TensorFlow versions Rodan opens our models with --------
# (consumers/: Python 3.7 + TensorFlow 2.5.1, Python 3.11 + TensorFlow 2.15.1), built once under
# HPC_CONSUMERS_DIR (default ~/.cache/hpc-bridge/consumers) and reused while their requirements
# stay the same; a missing Python version stops set-up here, saying how to install it.
.venv/bin/python -m consumers build 2>&1 | sed 's/^/[setup] /'

# --- A wheelhouse: the package's dependencies, the worker extra's included ------------------------
# What a site without PyPI installs from (pip's --no-index --find-links): the operator-guide test's
# account and the upgrade test install from it, at the versions in .venv, instead of downloading
# TensorFlow again for every environment they build. Filled once per pyproject.toml.
wheelhouse=var/wheelhouse
if [ ! -f "$wheelhouse/.built-for" ] || [ "$(cat "$wheelhouse/.built-for")" != "$want" ]; then
    say "filling $wheelhouse (hpc-bridge's dependencies and its worker extra's, as in .venv)"
    rm -rf "$wheelhouse"
    mkdir -p "$wheelhouse"
    .venv/bin/python -m pip freeze --exclude-editable | grep -v ' @ ' > "$wheelhouse/constraints.txt"
    .venv/bin/python -c 'import tomllib; p = tomllib.load(open("pyproject.toml", "rb"))["project"]
print("\n".join(p["dependencies"] + p["optional-dependencies"]["worker"]))' > "$wheelhouse/requirements.txt"
    .venv/bin/python -m pip download --quiet --only-binary=:all: -d "$wheelhouse" \
        -c "$wheelhouse/constraints.txt" -r "$wheelhouse/requirements.txt"
    echo "$want" > "$wheelhouse/.built-for"
else
    say "$wheelhouse is up to date"
fi

# --- RabbitMQ ------------------------------------------------------------------------
broker_up() { (exec 3<>/dev/tcp/127.0.0.1/5672) 2>/dev/null; }
if [ -n "${RABBITMQ_URL:-}" ]; then
    say "using the broker in RABBITMQ_URL"
elif broker_up; then
    say "RabbitMQ answers on 127.0.0.1:5672"
else
    if ! command -v rabbitmq-server >/dev/null; then
        say "installing rabbitmq-server"
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq rabbitmq-server >/dev/null
    fi
    say "starting RabbitMQ (rabbitmq-server -detached)"
    rabbitmq-server -detached >/dev/null 2>&1 || true
    for _ in $(seq 1 60); do broker_up && break; sleep 1; done
    broker_up || { echo "[setup] RabbitMQ did not come up on 127.0.0.1:5672" >&2; exit 1; }
    say "RabbitMQ is up"
fi

# --- tools the tests use (shellcheck on run_check, logrotate -d on its config, openssl for the TLS test,
# cron for the operator guide's deployment, started by deploy/dev/follow_guide.py, systemd-analyze to
# verify the units `hpc-bridge install systemd` writes)
missing=()
for pkg in shellcheck logrotate openssl cron systemd; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "ok installed" || missing+=("$pkg")
done
if [ ${#missing[@]} -gt 0 ]; then
    say "installing ${missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
fi

# promtool checks and unit-tests deploy/monitoring's alert rules. Only the binary: the prometheus
# package would also start a server.
if ! command -v promtool >/dev/null; then
    say "installing promtool (from Debian's prometheus package, binary only)"
    promdir=$(mktemp -d)
    (cd "$promdir" && { apt-get download -qq prometheus >/dev/null 2>&1 \
        || { apt-get update -qq && apt-get download -qq prometheus >/dev/null; }; } && dpkg-deb -x prometheus_*.deb x) \
        && install -m 0755 "$promdir/x/usr/bin/promtool" /usr/local/bin/promtool
    rm -rf "$promdir"
    command -v promtool >/dev/null || { echo "[setup] could not install promtool (apt-get download prometheus)" >&2; exit 1; }
fi

# --- Slurm ---------------------------------------------------------------------------
bash deploy/dev/slurm.sh up

# --- Grid Engine (second scheduler backend; coexists with Slurm, ~1.5 s when already up) ---
bash deploy/dev/gridengine.sh up
