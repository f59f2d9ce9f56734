#!/usr/bin/env bash
# deploy/dev/rodan.sh — a real Rodan 3.1.0 (Django runserver + a Celery worker) for the tests and the demo.
#
#   bash deploy/dev/rodan.sh up [--job-package DIR]... [--no-job-packages]
#                                     build (if needed), migrate, start, probe (idempotent); the job
#                                     packages default to rodan_job/hpc_paco_trainer when it exists
#   bash deploy/dev/rodan.sh down     stop the server and the worker (by pid), drop the database, role,
#                                     Redis keys and RabbitMQ vhost; the state directory is removed
#   bash deploy/dev/rodan.sh status   what runs; exit 0 only when the server and the worker are alive
#   bash deploy/dev/rodan.sh env      shell lines for tests and the demo (RODAN_URL, RODAN_EMAIL,
#                                     RODAN_PASSWORD, RODAN_INACTIVE_EMAIL, HPC_DEV_RODAN_DIR);
#                                     exit 1 when it is not up
#
# Target: the disposable dev machine (Debian 12, root) beside deploy/dev/slurm.sh: PostgreSQL on
# 127.0.0.1:5432 with trust authentication, Redis on 127.0.0.1:6379 and RabbitMQ on 127.0.0.1:5672
# (guest/guest) already run; this script only adds its own database, role, Redis db number and
# vhost to them and takes them away again on `down`.
#
# What `up` builds:
#   * Rodan's code, from ../shared/rodan/rodan-v3.1.0-core.tar.gz beside the repository when it exists,
#     else `git clone` of DDMAL/Rodan at v3.1.0 (and DDMAL/Paco_classifier at 64cb949, only when a job
#     package imports Paco_classifier), copied to STATE/code with the job packages in rodan/jobs/ and
#     a registerJobs.yaml of its own (the base jobs, helloworld, pil_rodan and the packages);
#     Paco_classifier's package, when fetched, goes beside manage.py (not its TensorFlow);
#   * a Python 3.7 venv cached under ~/.cache/hpc-bridge/rodan/venv-HASH (HASH of what it installs):
#     Rodan's requirements.txt with setuptools==58 first, psycopg2-binary==2.8.4 for psycopg2, no
#     uWSGI, pybagit 1.5.2 run through lib2to3;
#   * PostgreSQL database and SUPERUSER role hpcb_rodan_ID (ID from the state directory), Redis db
#     HPC_DEV_RODAN_REDIS_DB, RabbitMQ vhost hpcb-rodan-ID; `manage.py migrate`; an active account
#     with an e-mail, a password and its UserPreference row (and an inactive one, inactive-EMAIL,
#     with the same password: Rodan's 403 "Account is not activated.");
#   * `manage.py runserver --noreload 127.0.0.1:PORT` (DEBUG on, so /uploads/ is served) and
#     `celery -A rodan worker -Q celery,Python3 --max-tasks-per-child=1`, each in a session of its
#     own, pid in STATE/run/. Logs in STATE/logs/.
#
# Knobs (environment; the defaults just work):
#   HPC_DEV_RODAN_DIR        state directory (code, media, logs, pids, account)  (default ~/.cache/hpc-bridge/rodan/state)
#   HPC_DEV_RODAN_CACHE      where venvs and clones are cached                    (default ~/.cache/hpc-bridge/rodan)
#   HPC_DEV_RODAN_PORT       port of runserver; busy (or 0): a free one, kept in STATE/port (default 8765)
#   HPC_DEV_RODAN_REDIS_DB   Redis db number                                      (default 13)
#   HPC_DEV_RODAN_PYTHON     a Python 3.7 interpreter           (default pyenv's 3.7.16, else python3.7 on PATH)
#   HPC_DEV_RODAN_SOURCE     auto | archive | git  (auto: the archive when it exists)       (default auto)
#   HPC_DEV_RODAN_GIT_URL    Rodan's repository          (default https://github.com/DDMAL/Rodan.git)
#   HPC_DEV_RODAN_GIT_REF    its tag or commit                                    (default v3.1.0)
#   HPC_DEV_PACO_GIT_URL     Paco_classifier's repository (default https://github.com/DDMAL/Paco_classifier.git)
#   HPC_DEV_PACO_GIT_REF     its commit                                           (default 64cb949)
#   HPC_DEV_RODAN_EMAIL      the account's e-mail                                 (default hpc-bridge@rodan.test)
#   HPC_DEV_RODAN_JOB_PACKAGES  job packages for an `up` without --job-package, separated by ':'
#                            (set but empty: none)          (default rodan_job/hpc_paco_trainer if it exists)
#   HPC_DEV_RODAN_WORKERS    Celery worker processes                              (default 2)
#   HPC_DEV_RODAN_TIMEOUT_S  how long `up` waits for the server and the worker    (default 120)
set -Eeuo pipefail

readonly PROG="rodan.sh"
T0=$(date +%s.%N)
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
readonly REPO
readonly CACHE="${HPC_DEV_RODAN_CACHE:-$HOME/.cache/hpc-bridge/rodan}"
STATE="${HPC_DEV_RODAN_DIR:-$CACHE/state}"
readonly PORT_WANTED="${HPC_DEV_RODAN_PORT:-8765}"
readonly REDIS_DB_NUMBER="${HPC_DEV_RODAN_REDIS_DB:-13}"
readonly SOURCE_MODE="${HPC_DEV_RODAN_SOURCE:-auto}"
readonly RODAN_GIT_URL="${HPC_DEV_RODAN_GIT_URL:-https://github.com/DDMAL/Rodan.git}"
readonly RODAN_GIT_REF="${HPC_DEV_RODAN_GIT_REF:-v3.1.0}"
readonly PACO_GIT_URL="${HPC_DEV_PACO_GIT_URL:-https://github.com/DDMAL/Paco_classifier.git}"
readonly PACO_GIT_REF="${HPC_DEV_PACO_GIT_REF:-64cb949}"
readonly EMAIL="${HPC_DEV_RODAN_EMAIL:-hpc-bridge@rodan.test}"
readonly WORKERS="${HPC_DEV_RODAN_WORKERS:-2}"
readonly TIMEOUT_S="${HPC_DEV_RODAN_TIMEOUT_S:-120}"
readonly SHARED_RODAN="$REPO/../shared/rodan"
readonly RODAN_ARCHIVE="$SHARED_RODAN/rodan-v3.1.0-core.tar.gz"
readonly PACO_ARCHIVE="$SHARED_RODAN/paco-classifier-64cb949.tar.gz"
readonly PG=(psql -X -q -v ON_ERROR_STOP=1 -h 127.0.0.1 -U postgres -d postgres)
readonly DEBIAN_PACKAGES=(postgresql-plpython3-15 python3-redis)

# Output and process helpers (say, warn, die, is_alive, wait_for).
# shellcheck source-path=SCRIPTDIR source=lib/daemons.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/daemons.sh"
trap 'on_err "$?" "$LINENO" "$BASH_COMMAND"' ERR

# --------------------------------------------------------------------------------------------
# names derived from the state directory: two state directories never share a database or vhost
# --------------------------------------------------------------------------------------------
set_names() {
  STATE=$(realpath -m "$STATE")
  local id
  id=$(printf '%s' "$STATE" | sha256sum | cut -c1-10)
  DB="hpcb_rodan_$id"
  VHOST="hpcb-rodan-$id"
  CODE="$STATE/code"
  RUN="$STATE/run"
  LOGS="$STATE/logs"
  MEDIA="$STATE/media"
}

sha_of_files() { # sha256 over the contents and names of the files under the given paths
  local p
  for p in "$@"; do
    if [[ -d $p ]]; then
      (cd "$p" && find . -type f ! -name '*.pyc' ! -path '*/__pycache__/*' -print0 | LC_ALL=C sort -z | xargs -0 -r sha256sum)
    elif [[ -e $p ]]; then
      sha256sum "$p"
    fi
  done | sha256sum | cut -c1-16
}

pkg_installed() { [[ "$(dpkg-query -W -f='${Status}' "$1" 2>/dev/null)" == "install ok installed" ]]; }

install_debian_packages() {
  local missing=() p
  for p in "${DEBIAN_PACKAGES[@]}"; do pkg_installed "$p" || missing+=("$p"); done
  if ((${#missing[@]} == 0)); then
    return 0
  fi
  say "installing ${missing[*]} (migrate's plpython3u trigger imports redis inside PostgreSQL)"
  if ! DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}" >>"$LOGS/apt.log" 2>&1; then
    apt-get update -q >>"$LOGS/apt.log" 2>&1 || true
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}" >>"$LOGS/apt.log" 2>&1 \
      || die "apt-get install ${missing[*]} failed (see $LOGS/apt.log)"
  fi
}

# --------------------------------------------------------------------------------------------
# Python 3.7 and the venv
# --------------------------------------------------------------------------------------------
find_python37() {
  local candidate
  for candidate in "${HPC_DEV_RODAN_PYTHON:-}" "$HOME/.pyenv/versions/3.7.16/bin/python3.7" \
    "$(command -v python3.7 2>/dev/null || true)"; do
    [[ -n $candidate && -x $candidate ]] || continue
    if "$candidate" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 7))' 2>/dev/null; then
      echo "$candidate"
      return 0
    fi
  done
  die "Rodan 3.1.0 needs Python 3.7 (its code uses inspect.getargspec, gone in 3.11) and none was found.
  Install one with pyenv ('pyenv install 3.7.16', https://github.com/pyenv/pyenv) or point
  HPC_DEV_RODAN_PYTHON at a python3.7 interpreter."
}

# The requirements as installed: Rodan's list with the substitutions this machine needs.
write_requirements() {
  local src=$1 dest=$2
  sed -E \
    -e 's/^psycopg2==.*/psycopg2-binary==2.8.4/' \
    -e '/^uWSGI==/d' \
    -e '/pybagit/d' \
    -e 's/[[:space:]]*#.*$//' \
    "$src" | grep -v '^[[:space:]]*$' >"$dest"
}

ensure_venv() {
  local python reqs key tmp
  python=$(find_python37)
  reqs="$STATE/requirements.txt"
  write_requirements "$CODE/requirements.txt" "$reqs"
  key=$({
    "$python" -c 'import sys; print(sys.version)'
    cat "$reqs"
    echo "setuptools==58 pybagit==1.5.2 lib2to3"
  } | sha256sum | cut -c1-12)
  VENV="$CACHE/venv-$key"
  if [[ -x $VENV/bin/python && -e $VENV/.complete ]]; then
    say "venv: $VENV (cached)"
    return 0
  fi
  say "venv: building $VENV (Python 3.7, Rodan's requirements; about a minute)"
  rm -rf "$VENV" "$VENV.tmp"
  tmp="$VENV.tmp"
  mkdir -p "$CACHE"
  "$python" -m venv "$tmp" >>"$LOGS/venv.log" 2>&1 || die "python3.7 -m venv failed (see $LOGS/venv.log)"
  {
    "$tmp/bin/pip" install -q --disable-pip-version-check 'setuptools==58' 'wheel<0.43' \
      && "$tmp/bin/pip" install -q --disable-pip-version-check -r "$reqs" \
      && "$tmp/bin/pip" download -q --disable-pip-version-check --no-deps --no-binary :all: \
        'pybagit==1.5.2' -d "$tmp/src"
  } >>"$LOGS/venv.log" 2>&1 || die "pip install of Rodan's requirements failed (see $LOGS/venv.log)"
  # pybagit 1.5.2 is Python 2 code; jobs/core.py imports it at start-up: convert it, then install.
  (cd "$tmp/src" && tar xzf pybagit-1.5.2.tar.gz && "$tmp/bin/python" -m lib2to3 -w -n pybagit-1.5.2 \
    && "$tmp/bin/pip" install -q --disable-pip-version-check --no-deps ./pybagit-1.5.2) >>"$LOGS/venv.log" 2>&1 \
    || die "installing pybagit 1.5.2 through lib2to3 failed (see $LOGS/venv.log)"
  rm -rf "$tmp/src"
  "$tmp/bin/python" -c 'import django, celery, rest_framework, psycopg2, bagit' >>"$LOGS/venv.log" 2>&1 \
    || "$tmp/bin/python" -c 'import django, celery, rest_framework, psycopg2, pybagit' >>"$LOGS/venv.log" 2>&1 \
    || die "the new venv cannot import Rodan's dependencies (see $LOGS/venv.log)"
  # A venv is not relocatable: rebuild its scripts' shebangs for the final path, then move it.
  grep -rlI --null "$tmp" "$tmp/bin" | xargs -0 -r sed -i "s|$tmp|$VENV|g"
  mv "$tmp" "$VENV"
  touch "$VENV/.complete"
  say "venv: built"
}

# --------------------------------------------------------------------------------------------
# Rodan's code (and Paco_classifier's, when a job package needs it)
# --------------------------------------------------------------------------------------------
use_git() {
  case $SOURCE_MODE in
    git) return 0 ;;
    archive) [[ -r $RODAN_ARCHIVE ]] || die "HPC_DEV_RODAN_SOURCE=archive but $RODAN_ARCHIVE is missing"; return 1 ;;
    auto) [[ ! -r $RODAN_ARCHIVE ]] ;;
    *) die "HPC_DEV_RODAN_SOURCE must be auto, archive or git (got '$SOURCE_MODE')" ;;
  esac
}

# git_checkout URL REF DEST: DEST holds URL at REF (cloned once, kept under the cache); prints the
# commit. A tag or branch is cloned shallow; a commit needs the whole history.
git_checkout() {
  local url=$1 ref=$2 dest=$3
  command -v git >/dev/null || die "git is needed to fetch $url (or put the archives in ../shared/rodan/)"
  if [[ -d $dest/.git ]] && [[ "$(git -C "$dest" config --get remote.origin.url)" == "$url" ]] \
    && git -C "$dest" rev-parse -q --verify "$ref^{commit}" >/dev/null; then
    :
  else
    rm -rf "$dest"
    say "git clone $url ($ref)" >&2
    if ! git clone -q --depth 1 --branch "$ref" "$url" "$dest" >>"$LOGS/git.log" 2>&1; then
      rm -rf "$dest"
      git clone -q "$url" "$dest" >>"$LOGS/git.log" 2>&1 || die "git clone $url failed (see $LOGS/git.log)"
    fi
  fi
  git -C "$dest" -c advice.detachedHead=false checkout -q --force "$ref" >>"$LOGS/git.log" 2>&1 \
    || die "$url has no $ref (see $LOGS/git.log)"
  git -C "$dest" rev-parse HEAD
}

# rodan_source: prints the directory holding Rodan's `code` (manage.py, rodan/, requirements.txt)
# and sets SOURCE_ID (what the code is, for the hashes).
rodan_source() {
  local dest commit
  if use_git; then
    dest="$CACHE/src/rodan-$(printf '%s' "$RODAN_GIT_URL" | sha256sum | cut -c1-8)"
    commit=$(git_checkout "$RODAN_GIT_URL" "$RODAN_GIT_REF" "$dest")
    [[ -f $dest/rodan-main/code/manage.py ]] || die "$RODAN_GIT_URL at $RODAN_GIT_REF has no rodan-main/code/manage.py"
    SOURCE_ID="git:$commit"
    RODAN_SRC="$dest/rodan-main/code"
  else
    dest="$CACHE/src/archive-$(sha256sum "$RODAN_ARCHIVE" | cut -c1-12)"
    if [[ ! -f $dest/rodan-main/code/manage.py ]]; then
      rm -rf "$dest"
      mkdir -p "$dest"
      tar -xzf "$RODAN_ARCHIVE" -C "$dest"
    fi
    SOURCE_ID="archive:$(basename "$dest")"
    RODAN_SRC="$dest/rodan-main/code"
  fi
}

paco_source() {
  local dest
  if use_git; then
    dest="$CACHE/src/paco-git-$(printf '%s' "$PACO_GIT_URL" | sha256sum | cut -c1-8)"
    PACO_ID="git:$(git_checkout "$PACO_GIT_URL" "$PACO_GIT_REF" "$dest")"
    PACO_SRC="$dest"
  else
    [[ -r $PACO_ARCHIVE ]] || die "a job package imports Paco_classifier but $PACO_ARCHIVE is missing"
    dest="$CACHE/src/paco-$(sha256sum "$PACO_ARCHIVE" | cut -c1-12)"
    if [[ ! -f $dest/Paco_classifier/setup.py ]]; then
      rm -rf "$dest"
      mkdir -p "$dest"
      tar -xzf "$PACO_ARCHIVE" -C "$dest"
    fi
    PACO_SRC="$dest/Paco_classifier"
    PACO_ID="archive:$(basename "$dest")"
  fi
  [[ -f $PACO_SRC/Paco_classifier/__init__.py ]] || die "$PACO_SRC has no Paco_classifier package"
}

# job_classes DIR: "module class" for each RodanTask subclass defined at the top of DIR/*.py.
job_classes() {
  local file module
  for file in "$1"/*.py; do
    [[ -e $file ]] || continue
    module=$(basename "$file" .py)
    sed -nE 's/^class ([A-Za-z_][A-Za-z0-9_]*)\((rodan\.jobs\.base\.)?RodanTask\):.*/\1/p' "$file" \
      | while read -r cls; do echo "$module $cls"; done
  done
}

needs_paco() {
  local pkg
  for pkg in "${JOB_PACKAGES[@]}"; do
    grep -rqE '^[[:space:]]*(import|from)[[:space:]]+Paco_classifier' --include='*.py' "$pkg" && return 0
  done
  return 1
}

write_register_jobs() {
  local pkg name line module cls
  {
    echo '# Written by deploy/dev/rodan.sh: the jobs this dev Rodan has (the archive keeps only these).'
    echo '"BASE_JOB_PACKAGES":'
    echo '  "rodan.jobs.resource_distributor": ["ResourceDistributor"]'
    echo '  "rodan.jobs.labeler": ["Labeler"]'
    echo '"RODAN_PYTHON3_JOBS":'
    echo '  "rodan.jobs.helloworld":'
    echo '    "rodan.jobs.helloworld.helloworld": ["HelloWorld", "HelloWorldMultiPort", "HelloWorld3"]'
    echo '  "rodan.jobs.pil_rodan":'
    echo '    "rodan.jobs.pil_rodan.red_filtering": ["RedFilter"]'
    echo '    "rodan.jobs.pil_rodan.resize": ["resize"]'
    echo '    "rodan.jobs.pil_rodan.to_png": ["to_png"]'
    echo '    "rodan.jobs.pil_rodan.to_tiff": ["to_tiff"]'
    for pkg in "${JOB_PACKAGES[@]}"; do
      name=$(basename "$pkg")
      echo "  \"rodan.jobs.$name\":"
      job_classes "$pkg" | awk '{ c[$1] = c[$1] (c[$1] ? ", " : "") "\"" $2 "\"" } END { for (m in c) print m, c[m] }' \
        | while read -r module line; do echo "    \"rodan.jobs.$name.$module\": [$line]"; done
    done
    echo '"RODAN_GPU_JOBS": {}'
  } >"$1"
}

# install_code: STATE/code = Rodan's code + the job packages + our registerJobs.yaml.
install_code() {
  local pkg name
  rm -rf "$CODE.new"
  mkdir -p "$CODE.new"
  cp -a "$RODAN_SRC/." "$CODE.new/"
  for pkg in "${JOB_PACKAGES[@]}"; do
    name=$(basename "$pkg")
    rm -rf "$CODE.new/rodan/jobs/$name"
    cp -a "$pkg" "$CODE.new/rodan/jobs/$name"
    find "$CODE.new/rodan/jobs/$name" -name __pycache__ -prune -exec rm -rf {} +
  done
  write_register_jobs "$CODE.new/rodan/registerJobs.yaml"
  if [[ -n ${PACO_SRC:-} ]]; then
    # Beside manage.py, so on the server's and the worker's sys.path; the shared venv stays as it
    # is. Its own requirements (TensorFlow) are not installed: only the consumers need them.
    cp -a "$PACO_SRC/Paco_classifier" "$CODE.new/Paco_classifier"
    say "Paco_classifier ($PACO_ID) put beside manage.py (a job package imports it)"
  fi
  rm -rf "$CODE"
  mv "$CODE.new" "$CODE"
}

# --------------------------------------------------------------------------------------------
# the shared services: database, role, vhost (ours only)
# --------------------------------------------------------------------------------------------
check_services() {
  "${PG[@]}" -c 'select 1' >/dev/null 2>&1 || die "PostgreSQL does not answer on 127.0.0.1:5432 as user postgres (trust)"
  redis-cli -h 127.0.0.1 -p 6379 ping 2>/dev/null | grep -q PONG || die "Redis does not answer on 127.0.0.1:6379"
  (exec 3<>/dev/tcp/127.0.0.1/5672) 2>/dev/null || die "RabbitMQ does not answer on 127.0.0.1:5672 (deploy/dev/setup.sh starts it)"
}

ensure_database() {
  if [[ -z "$("${PG[@]}" -tAc "select 1 from pg_roles where rolname = '$DB'")" ]]; then
    "${PG[@]}" -c "create role $DB login superuser password '$(cat "$STATE/db-password")'" >/dev/null
    say "postgres: role $DB created (SUPERUSER: migrate recreates a plpython3u function)"
  fi
  if [[ -z "$("${PG[@]}" -tAc "select 1 from pg_database where datname = '$DB'")" ]]; then
    "${PG[@]}" -c "create database $DB owner $DB" >/dev/null
    say "postgres: database $DB created"
    rm -f "$STATE/migrated"
  fi
}

ensure_vhost() {
  if ! rabbitmqctl -q list_vhosts name 2>/dev/null | grep -qx "$VHOST"; then
    rabbitmqctl -q add_vhost "$VHOST" >/dev/null
    rabbitmqctl -q set_permissions -p "$VHOST" guest '.*' '.*' '.*' >/dev/null
    say "rabbitmq: vhost $VHOST created (Celery's broker; guest may use it)"
  fi
}

# --------------------------------------------------------------------------------------------
# Rodan's processes
# --------------------------------------------------------------------------------------------
secret() { # secret FILE: a random token kept in FILE (0600)
  if [[ ! -s $1 ]]; then
    (umask 077 && head -c 32 /dev/urandom | sha256sum | cut -c1-40 | tr -d '\n' >"$1")
  fi
}

rodan_env() { # the environment Rodan reads (settings.py); secrets from files, never on command lines
  export HPC_DEV_RODAN_DIR="$STATE"
  export DJANGO_SETTINGS_MODULE=rodan.settings
  export DJANGO_SECRET_KEY
  DJANGO_SECRET_KEY=$(cat "$STATE/django-secret")
  export DJANGO_DEBUG_MODE=True DJANGO_ADMIN_URL='^api/admin/' DJANGO_ALLOWED_HOSTS='127.0.0.1,localhost'
  export DJANGO_MEDIA_ROOT="$MEDIA/" DJANGO_ACCESS_LOG="$LOGS/database.log" DJANGO_DEBUG_LOG="$LOGS/rodan.log"
  export POSTGRES_DB="$DB" POSTGRES_USER="$DB" POSTGRES_HOST=127.0.0.1 POSTGRES_PORT=5432
  export POSTGRES_PASSWORD
  POSTGRES_PASSWORD=$(cat "$STATE/db-password")
  export RABBITMQ_URL="amqp://guest:guest@127.0.0.1:5672/$VHOST"
  export REDIS_HOST=127.0.0.1 REDIS_PORT=6379 REDIS_DB="$REDIS_DB_NUMBER"
  export IIPSRV_URL="http://127.0.0.1/fcgi-bin/iipsrv.fcgi" SERVER_HOST="127.0.0.1:$PORT"
  export CELERY_JOB_QUEUE=celery PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
}

migrate() {
  say "manage.py migrate (registers the jobs into the database)"
  # A job that left registerJobs.yaml makes load.py ask (input()) whether to delete it: yes.
  (cd "$CODE" && MIGRATE=True "$VENV/bin/python" manage.py migrate --noinput < <(yes y)) >"$LOGS/migrate.log" 2>&1 \
    || die "manage.py migrate failed (see $LOGS/migrate.log)"
}

ensure_account() {
  secret "$STATE/password"
  (cd "$CODE" && RODAN_ACCOUNT_EMAIL="$EMAIL" RODAN_ACCOUNT_PASSWORD_FILE="$STATE/password" \
    "$VENV/bin/python" manage.py shell) >"$LOGS/account.log" 2>&1 <<'EOF' || die "creating the account failed (see $LOGS/account.log)"
import os
from rodan.models import User, UserPreference
email = os.environ["RODAN_ACCOUNT_EMAIL"]
with open(os.environ["RODAN_ACCOUNT_PASSWORD_FILE"]) as handle:
    password = handle.read().strip()
for address, active in ((email, True), ("inactive-" + email, False)):
    user = User.objects.filter(email=address).first() or User(email=address, username=address.split("@")[0])
    user.is_active = active
    user.set_password(password)
    user.save()
    UserPreference.objects.get_or_create(user=user)
    print("account ready:", user.pk, "active" if active else "inactive")
EOF
}

pidfile() { echo "$RUN/$1.pid"; }

# ours PID: PID is alive and was started by this script for this state directory.
ours() {
  local pid=$1
  [[ $pid =~ ^[0-9]+$ && -r /proc/$pid/environ ]] || return 1
  is_alive "$pid" "$(cat "/proc/$pid/comm" 2>/dev/null)" || return 1
  { tr '\0' '\n' <"/proc/$pid/environ"; } 2>/dev/null | grep -qxF "HPC_DEV_RODAN_DIR=$STATE"
}

running_pid() { # running_pid NAME: the pid of our live NAME (server, worker), or rc 1
  local file pid
  file=$(pidfile "$1")
  [[ -r $file ]] || return 1
  pid=$(tr -dc '0-9' <"$file")
  ours "$pid" || return 1
  echo "$pid"
}

start_daemon() { # start_daemon NAME CMD...: in its own session, pid in RUN/NAME.pid
  local name=$1
  shift
  # fd 9 is the lock of `up`: a daemon that kept it would hold every later `up` back
  (cd "$CODE" && exec setsid "$@" >>"$LOGS/$name.log" 2>&1 </dev/null 9>&-) &
  echo $! >"$(pidfile "$name")"
}

stop_pid_group() { # stop_pid_group NAME: SIGTERM to our NAME's process group, SIGKILL after 20 s
  local name=$1 pid i
  if ! pid=$(running_pid "$name"); then
    rm -f "$(pidfile "$name")"
    return 0
  fi
  kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null || true
  for ((i = 0; i < 200; i++)); do
    ours "$pid" || break
    sleep 0.1
  done
  if ours "$pid"; then
    warn "$name (pid $pid) ignored SIGTERM for 20 s, sending SIGKILL"
    kill -KILL -- "-$pid" 2>/dev/null || kill -KILL "$pid" 2>/dev/null || true
  fi
  # the worker's pool processes share its process group; none may outlive it
  kill -KILL -- "-$pid" 2>/dev/null || true
  rm -f "$(pidfile "$name")"
  say "$name: stopped (pid $pid)"
}

port_free() { ! (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

choose_port() {
  local saved=""
  [[ -r $STATE/port ]] && saved=$(tr -dc '0-9' <"$STATE/port")
  if [[ -n $saved ]] && { running_pid server >/dev/null || port_free "$saved"; }; then
    PORT=$saved
  elif [[ $PORT_WANTED != 0 ]] && port_free "$PORT_WANTED"; then
    PORT=$PORT_WANTED
  else
    PORT=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    [[ $PORT_WANTED == 0 ]] || say "port $PORT_WANTED is taken by another program: using $PORT"
  fi
  echo "$PORT" >"$STATE/port"
}

# await NAME CHECK WHAT: waits up to TIMEOUT_S for CHECK; dies at once when NAME exits.
await() {
  local name=$1 check=$2 what=$3 deadline
  deadline=$(($(date +%s) + TIMEOUT_S))
  until "$check" >/dev/null 2>&1; do
    running_pid "$name" >/dev/null || die "$name exited at start-up (see $LOGS/$name.log)"
    (($(date +%s) < deadline)) || die "$what within $TIMEOUT_S s (see $LOGS/$name.log)"
    sleep 0.2
  done
}

http_code() { curl -s -o /dev/null -m 5 -w '%{http_code}' "$@" || true; }
server_answers() { [[ "$(http_code "http://127.0.0.1:$PORT/api/")" =~ ^[234] ]]; }
worker_ready() { grep -qF "rodan-$VHOST@" "$LOGS/worker.log" 2>/dev/null && grep -qE '@[^ ]+ ready\.$' "$LOGS/worker.log"; }

token_works() { # the account gets a token (the password is read from its file, not a command line)
  [[ "$(curl -s -o /dev/null -m 10 -w '%{http_code}' --data-urlencode "email=$EMAIL" \
    --data-urlencode "password@$STATE/password" "http://127.0.0.1:$PORT/api/auth/token/")" == 200 ]]
}

# --------------------------------------------------------------------------------------------
# commands
# --------------------------------------------------------------------------------------------
parse_up_args() {
  JOB_PACKAGES=()
  local given=0
  while (($#)); do
    case $1 in
      --no-job-packages)
        given=1
        shift
        ;;
      --job-package)
        (($# >= 2)) || die "--job-package needs a directory"
        [[ -d $2 && -f $2/__init__.py ]] || die "--job-package $2: not a Python package directory"
        JOB_PACKAGES+=("$(cd "$2" && pwd)")
        given=1
        shift 2
        ;;
      *) die "unknown argument to up: $1 (--job-package DIR, --no-job-packages)" ;;
    esac
  done
  if ((!given)) && [[ -n ${HPC_DEV_RODAN_JOB_PACKAGES+set} ]]; then
    local dir
    IFS=: read -r -a dirs <<<"$HPC_DEV_RODAN_JOB_PACKAGES"
    for dir in "${dirs[@]}"; do
      [[ -z $dir ]] && continue
      [[ -d $dir && -f $dir/__init__.py ]] || die "HPC_DEV_RODAN_JOB_PACKAGES: $dir is not a Python package directory"
      JOB_PACKAGES+=("$(cd "$dir" && pwd)")
    done
  elif ((!given)) && [[ -f $REPO/rodan_job/hpc_paco_trainer/__init__.py ]]; then
    JOB_PACKAGES=("$REPO/rodan_job/hpc_paco_trainer")
  fi
}

cmd_up() {
  parse_up_args "$@"
  set_names
  mkdir -p "$RUN" "$LOGS" "$MEDIA"
  check_services
  install_debian_packages
  rodan_source
  if needs_paco; then paco_source; fi
  # What the running Rodan is: the code, the packages, the venv, the knobs. Equal: nothing to do.
  local config
  config=$( {
    echo "$SOURCE_ID $EMAIL $REDIS_DB_NUMBER $WORKERS $VHOST"
    sha256sum <"${BASH_SOURCE[0]}" # this script: how Rodan is set up and run
    sha_of_files "${JOB_PACKAGES[@]}"
    printf '%s\n' "${JOB_PACKAGES[@]}"
    if [[ -n ${PACO_SRC:-} ]]; then echo "paco:$PACO_ID"; fi
  } | sha256sum | cut -c1-16)
  choose_port
  if [[ "$(cat "$STATE/config" 2>/dev/null)" == "$config" ]] && running_pid server >/dev/null \
    && running_pid worker >/dev/null && server_answers && token_works; then
    say "Rodan 3.1.0 already runs at http://127.0.0.1:$PORT/ (server pid $(running_pid server), worker pid $(running_pid worker))"
    return 0
  fi
  stop_pid_group server
  stop_pid_group worker
  secret "$STATE/db-password"
  secret "$STATE/django-secret"
  install_code
  ensure_venv
  ensure_database
  ensure_vhost
  rodan_env
  # Restarting the same code and packages on the same database (after a reboot, or when a process
  # died) needs no migrate: that is what a job package change or a new database does.
  if [[ "$(cat "$STATE/migrated" 2>/dev/null)" != "$config" ]]; then
    migrate
    echo "$config" >"$STATE/migrated"
  fi
  ensure_account
  : >"$LOGS/worker.log"
  start_daemon server "$VENV/bin/python" manage.py runserver --noreload "127.0.0.1:$PORT"
  start_daemon worker "$VENV/bin/celery" -A rodan worker -l INFO -Q celery,Python3 \
    --concurrency="$WORKERS" --max-tasks-per-child=1 -n "rodan-$VHOST@%h"
  await server server_answers "runserver did not answer on 127.0.0.1:$PORT"
  token_works || die "the account $EMAIL got no token (see $LOGS/server.log, $LOGS/account.log)"
  say "server: http://127.0.0.1:$PORT/ (pid $(running_pid server)), token for $EMAIL: ok"
  await worker worker_ready "the Celery worker was not ready"
  running_pid worker >/dev/null || die "the Celery worker exited (see $LOGS/worker.log)"
  say "worker: ready (pid $(running_pid worker), queues celery, Python3, --max-tasks-per-child=1)"
  echo "$config" >"$STATE/config"
  say "Rodan 3.1.0 is up: bash deploy/dev/rodan.sh env"
}

# redis_db_shared: a live process of another state directory of this script uses our Redis db.
redis_db_shared() {
  local environ lines
  for environ in /proc/[0-9]*/environ; do
    lines=$({ tr '\0' '\n' <"$environ"; } 2>/dev/null) || continue
    grep -q '^HPC_DEV_RODAN_DIR=' <<<"$lines" || continue
    grep -qxF "HPC_DEV_RODAN_DIR=$STATE" <<<"$lines" && continue
    grep -qxF "REDIS_DB=$REDIS_DB_NUMBER" <<<"$lines" && return 0
  done
  return 1
}

cmd_down() {
  set_names
  stop_pid_group server
  stop_pid_group worker
  if "${PG[@]}" -c 'select 1' >/dev/null 2>&1; then
    "${PG[@]}" -c "drop database if exists $DB" >/dev/null 2>&1 \
      || { "${PG[@]}" -c "select pg_terminate_backend(pid) from pg_stat_activity where datname = '$DB'" >/dev/null \
        && "${PG[@]}" -c "drop database if exists $DB" >/dev/null; }
    "${PG[@]}" -c "drop role if exists $DB" >/dev/null
    say "postgres: database and role $DB dropped"
  fi
  if redis_db_shared; then
    say "redis: db $REDIS_DB_NUMBER left as it is (another Rodan of this script uses it)"
  elif redis-cli -h 127.0.0.1 -p 6379 -n "$REDIS_DB_NUMBER" flushdb >/dev/null 2>&1; then
    say "redis: db $REDIS_DB_NUMBER emptied"
  fi
  if rabbitmqctl -q list_vhosts name 2>/dev/null | grep -qx "$VHOST"; then
    rabbitmqctl -q delete_vhost "$VHOST" >/dev/null
    say "rabbitmq: vhost $VHOST deleted"
  fi
  rm -rf "$STATE"
  say "state directory removed (the venv stays cached under $CACHE)"
}

cmd_status() {
  set_names
  local rc=0 pid port
  port=$(cat "$STATE/port" 2>/dev/null || echo "?")
  if pid=$(running_pid server); then
    echo "server: running (pid $pid) http://127.0.0.1:$port/"
  else
    echo "server: not running"
    rc=1
  fi
  if pid=$(running_pid worker); then
    echo "worker: running (pid $pid, $(pgrep -c -g "$pid" || echo 0) processes)"
  else
    echo "worker: not running"
    rc=1
  fi
  echo "state: $STATE (logs in $LOGS)"
  echo "database: $DB, redis db: $REDIS_DB_NUMBER, vhost: $VHOST"
  return $rc
}

cmd_env() {
  set_names
  running_pid server >/dev/null || die "Rodan is not up (bash deploy/dev/rodan.sh up)"
  printf 'RODAN_URL=http://127.0.0.1:%s\n' "$(cat "$STATE/port")"
  printf 'RODAN_EMAIL=%s\n' "$EMAIL"
  printf 'RODAN_PASSWORD=%s\n' "$(cat "$STATE/password")"
  printf 'RODAN_INACTIVE_EMAIL=inactive-%s\n' "$EMAIL"
  printf 'HPC_DEV_RODAN_DIR=%s\n' "$STATE"
}

main() {
  [[ $(id -u) == 0 ]] || die "run as root (it installs Debian packages and manages PostgreSQL roles)"
  local cmd=${1:-}
  shift || true
  if [[ $cmd == up || $cmd == down ]]; then
    # One `up` or `down` at a time (parallel test processes share one Rodan).
    mkdir -p "$CACHE"
    exec 9>"$CACHE/.lock"
    flock 9
  fi
  case $cmd in
    up) cmd_up "$@" ;;
    down) cmd_down ;;
    status)
      trap - ERR # its exit status is the answer, not an error
      cmd_status
      ;;
    env) cmd_env ;;
    *)
      echo "usage: $0 up [--job-package DIR]... [--no-job-packages] | down | status | env" >&2
      exit 2
      ;;
  esac
}

main "$@"
