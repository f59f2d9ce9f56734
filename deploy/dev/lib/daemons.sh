# deploy/dev/lib/daemons.sh — what slurm.sh and gridengine.sh share: one line per step, clear
# errors, and daemons started by hand (no systemd here) found, checked and stopped reliably.
#
# Sourced, not run. The caller sets PROG (its name in messages) and T0 (its start, `date +%s.%N`)
# and defines `pidfile_of NAME`, which prints the pid file of daemon NAME (its /proc/PID/comm).
# shellcheck shell=bash

# --- output: one line per step, errors on stderr, non-zero exit with a clear message ----------
elapsed() { awk -v a="$T0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }'; }
say() { printf '[%s %5ss] %s\n' "$PROG" "$(elapsed)" "$*"; }
warn() { printf '[%s] WARNING: %s\n' "$PROG" "$*" >&2; }
die() {
  printf '[%s] ERROR: %s\n' "$PROG" "$*" >&2
  exit 1
}
on_err() { printf '[%s] ERROR: command failed (rc=%s) at line %s: %s\n' "$PROG" "$1" "$2" "$3" >&2; }

# --- processes ---------------------------------------------------------------------------------

# is_alive PID COMM: true when PID exists, is not a zombie and runs COMM.
# PID 1 on these machines reaps orphans late, so a stopped daemon stays <defunct> for a while and
# `kill -0` still succeeds; look at /proc/PID/status instead. Checking comm also guards against a
# stale pid file whose pid was reused by another process.
is_alive() {
  local pid=$1 comm=$2 state
  [[ $pid =~ ^[0-9]+$ ]] || return 1
  [[ -r /proc/$pid/status ]] || return 1
  state=$(awk '/^State:/ { print $2; exit }' "/proc/$pid/status" 2>/dev/null) || return 1
  [[ -n $state && $state != Z && $state != X ]] || return 1
  [[ "$(cat "/proc/$pid/comm" 2>/dev/null)" == "$comm" ]]
}

# daemon_pid NAME: prints the pid of a live NAME daemon, or nothing (rc 1). The pid file first,
# then a search by exact comm (a lost pid file must not lead to a second copy).
daemon_pid() {
  local name=$1 pidfile pid="" p
  pidfile=$(pidfile_of "$name")
  if [[ -r $pidfile ]]; then
    pid=$(tr -dc '0-9' <"$pidfile" 2>/dev/null || true)
    if is_alive "$pid" "$name"; then
      echo "$pid"
      return 0
    fi
  fi
  for p in $(pgrep -x "$name" 2>/dev/null || true); do
    if is_alive "$p" "$name"; then
      echo "$p"
      return 0
    fi
  done
  return 1
}

# wait_for SECONDS CMD...: polls CMD every 0.1 s until it succeeds (rc 1 after SECONDS).
wait_for() {
  local deadline
  deadline=$(($(date +%s) + $1))
  shift
  until "$@" >/dev/null 2>&1; do
    (($(date +%s) < deadline)) || return 1
    sleep 0.1
  done
}

# stop_daemon NAME [GRACE_S]: SIGTERM (which lets a controller save its state), wait up to
# GRACE_S seconds (default 30), then SIGKILL as a last resort; the pid file is removed.
stop_daemon() {
  local name=$1 grace=${2:-30} pid pidfile i
  if ! pid=$(daemon_pid "$name"); then
    say "$name: not running"
    return 0
  fi
  pidfile=$(pidfile_of "$name")
  kill -TERM "$pid" 2>/dev/null || true
  for ((i = 0; i < grace * 10; i++)); do
    is_alive "$pid" "$name" || break
    sleep 0.1
  done
  if is_alive "$pid" "$name"; then
    warn "$name (pid $pid) ignored SIGTERM for $grace s, sending SIGKILL"
    kill -KILL "$pid" 2>/dev/null || true
    sleep 0.5
  fi
  rm -f "$pidfile"
  say "$name: stopped (pid $pid)"
}

# --- a second unix user -------------------------------------------------------------------------

# ensure_other_user NAME: a plain unix account NAME (no password, no home, no login shell), created
# with useradd when missing. The backend tests submit held jobs as this user (runuser -u NAME --
# sbatch/qsub) and check that the bridge never adopts, reads or cancels another user's job.
ensure_other_user() {
  local name=$1
  [[ $name =~ ^[a-z_][a-z0-9_-]*$ ]] || die "the second test user's name must match [a-z_][a-z0-9_-]* (got '$name')"
  if getent passwd "$name" >/dev/null; then
    say "user $name: exists"
    return 0
  fi
  useradd --no-create-home --shell /usr/sbin/nologin --comment "hpc-bridge tests, another user's jobs" "$name" \
    || die "useradd $name failed"
  say "user $name: created (no password, no home; submits the tests' other-user jobs)"
}
