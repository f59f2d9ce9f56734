#!/usr/bin/env bash
# run_check: the crontab entry for hpc-bridge. Runs one pass,
#     hpc-bridge --instance NAME --credentials FILE check
# appends its output to a private log, and exits with hpc-bridge's exit status
# (0 done or another bridge holds the lock, 1 broker unreachable or pass
# failed, 2 configuration error, 127 hpc-bridge not found), so a failure is
# visible to cron and to monitoring.
#
# It ships inside the package: `hpc-bridge-run-check` (an entry point of the
# installed package) runs this script with the hpc-bridge beside it, so an
# installation needs no checkout. `hpc-bridge install cron` writes the crontab
# line:
#
#     * * * * * /path/to/venv/bin/hpc-bridge-run-check
#
# What it prints, cron mails to MAILTO, so it prints only when something
# changes: a short note with the last lines of the run when the exit status
# changes (the first failure, or a different one), the same as a reminder every
# HPC_BRIDGE_REMIND_S seconds (default 3600; 0: every failed run) while the
# failure lasts, and one "recovered" line on the first success after failures.
# A two-hour broker outage is three mails, not 120. What the last run ended with
# is kept in a state file next to the log (run_check.state). A run that found
# the spool lock taken (the previous pass or the daemon is working) says nothing
# about health and leaves that state alone.
#
# Where things are (every one can be overridden from the crontab line or the
# environment; bridge/instance.py says what an instance is):
#   HPC_BRIDGE_INSTANCE     which bridge of this account (default: default).
#   HPC_BRIDGE_SETTINGS_DIR the instance's settings folder. Default:
#                           ${XDG_CONFIG_HOME:-~/.config}/hpc-bridge/INSTANCE.
#   HPC_BRIDGE_CREDENTIALS  default SETTINGS_DIR/credentials.env (chmod 600).
#   HPC_BRIDGE_LOG          default ${XDG_STATE_HOME:-~/.local/state}/hpc-bridge/
#                           INSTANCE/run_check.log (directory created 0700, file
#                           kept 0600); the state file is next to it (run_check.state).
#   HPC_BRIDGE_EXE          the hpc-bridge to run. Default: the one beside
#                           hpc-bridge-run-check, else the first on PATH.
#   HPC_BRIDGE_HOME         the folder the pass runs in (relative paths in the
#                           settings are relative to it). Default: the folder of
#                           the credentials file.
#   HPC_BRIDGE_SITE_ENV     site set-up that cron's bare environment lacks
#                           (module load, SSL_CERT_FILE, the Slurm bin directory
#                           on PATH), sourced when present. Default:
#                           SETTINGS_DIR/site-env.sh.
#   HPC_BRIDGE_REMIND_S     seconds between reminders while a failure lasts
#                           (default 3600; 0 reports every failed run).
#
# Never traced (no `set -x`) and never prints a setting: the old cron wrapper
# traced every line and so wrote the passwords into a world-readable log.
set +x
set -uo pipefail
umask 077
# Should anything (a site file below) turn tracing on, the trace goes nowhere.
exec {xtrace_fd}>/dev/null
BASH_XTRACEFD=$xtrace_fd

note() { printf 'run_check: %s\n' "$*" >&2; }

# --- the instance ----------------------------------------------------------------
instance=${HPC_BRIDGE_INSTANCE:-default}
case "$instance" in
    [a-z0-9]*) ;;
    *) note "HPC_BRIDGE_INSTANCE=$instance is not an instance name"; exit 2 ;;
esac
case "$instance" in
    *[!a-z0-9_-]*) note "HPC_BRIDGE_INSTANCE=$instance is not an instance name"; exit 2 ;;
esac
settings_dir=${HPC_BRIDGE_SETTINGS_DIR:-${XDG_CONFIG_HOME:-$HOME/.config}/hpc-bridge/$instance}
credentials=${HPC_BRIDGE_CREDENTIALS:-$settings_dir/credentials.env}
log=${HPC_BRIDGE_LOG:-${XDG_STATE_HOME:-$HOME/.local/state}/hpc-bridge/$instance/run_check.log}
workdir=${HPC_BRIDGE_HOME:-$(dirname -- "$credentials")}
site=${HPC_BRIDGE_SITE_ENV:-$settings_dir/site-env.sh}

# --- the private log -------------------------------------------------------------
# Until the log exists there is no state either: these failures are always printed.
log_dir=$(dirname -- "$log")
if [ ! -d "$log_dir" ]; then
    # umask 077 makes every directory created here 0700, parents included.
    if ! { mkdir -p -- "$log_dir" && chmod 700 -- "$log_dir"; }; then
        note "cannot create the log directory $log_dir"
        exit 1
    fi
fi
: >>"$log" || { note "cannot write the log $log"; exit 1; }
chmod 600 -- "$log" || { note "cannot make the log $log private (chmod 600)"; exit 1; }
# Where this run's output starts, to quote it on failure (a log that logrotate
# renames meanwhile is a new file: this run's lines in it start at its beginning).
start_bytes=$(wc -c <"$log")
start_inode=$(stat -c %i -- "$log" 2>/dev/null || echo 0)
this_run() {  # this run's lines of the log
    if [ "$(stat -c %i -- "$log" 2>/dev/null || echo 0)" != "$start_inode" ]; then
        cat -- "$log"
    else
        tail -c "+$((start_bytes + 1))" -- "$log"
    fi
}

stamp() { date -u +%Y-%m-%dT%H:%M:%SZ; }
log_event() {  # a JSON line like hpc-bridge's own, so the log stays JSON lines
    printf '{"event": "%s", "component": "run_check", "timestamp": "%s", "pid": %d%s}\n' \
        "$1" "$(stamp)" "$$" "${2:-}" >>"$log"
}

# One run_check at a time per log: a run started while the previous one still
# works (a pass longer than the schedule) leaves at once, without touching the
# state, since the running one will report. (hpc-bridge's own spool lock would
# stop it too, but only run_check knows the state.) The lock is a file of its
# own: logrotate renames the log, and a lock on it would move with it.
exec {lock_fd}>>"${log%.log}.lock"
if command -v flock >/dev/null 2>&1 && ! flock -n "$lock_fd"; then
    log_event run_check_busy ', "reason": "the previous run_check is still running"'
    exit 0
fi

# --- mail only when something changes ----------------------------------------------
# The state file holds what the last run ended with: "STATUS SINCE REPORTED FAILED_RUNS"
# (exit status, since when it has been that, when it was last reported, in epoch
# seconds, and how many failed runs in a row). Missing or unreadable: as after a success.
state=${log%.log}.state
case "${HPC_BRIDGE_REMIND_S:-3600}" in
    '' | *[!0-9]*) remind_s=3600 ;;
    *) remind_s=$((10#${HPC_BRIDGE_REMIND_S:-3600})) ;;
esac
last_status=0 last_since=0 last_reported=0 last_failures=0
if [ -f "$state" ] && read -r s1 s2 s3 s4 _ <"$state" 2>/dev/null; then
    case "$s1:$s2:$s3:$s4" in
        *[!0-9:]* | :* | *::* | *:) ;;  # not four numbers: ignore it
        *) last_status=$((10#$s1)) last_since=$((10#$s2)) last_reported=$((10#$s3)) last_failures=$((10#$s4)) ;;
    esac
fi

save_state() {  # written whole, then renamed: a torn file would read as a change
    printf '%s %s %s %s\n' "$@" >"$state.$$" && mv -f -- "$state.$$" "$state"
}

utc() { date -u -d "@$1" +%Y-%m-%dT%H:%M:%SZ 2>/dev/null || printf '%s' "$1"; }

# finish STATUS [REASON]: report as the rules above say, record the state, log
# run_check_done and exit with STATUS. REASON is the one-line note of a failure.
finish() {
    local status=$1 reason=${2:-} now notified=none
    now=$(date +%s)
    if [ "$status" -eq 0 ]; then
        if [ "$last_status" -ne 0 ]; then
            notified=recovered
            note "recovered: hpc-bridge check succeeds again; it had failed (last with exit status $last_status)" \
                "since $(utc "$last_since"), $last_failures run(s) in a row"
        fi
        save_state 0 "$now" "$now" 0
    else
        if [ "$status" -ne "$last_status" ]; then
            notified=change
            save_state "$status" "$now" "$now" 1
        elif [ $((now - last_reported)) -ge "$remind_s" ]; then
            notified=reminder
            note "still failing since $(utc "$last_since"), $((last_failures + 1)) run(s) in a row" \
                "(a reminder every ${remind_s} s; the next change is reported at once)"
            save_state "$status" "$last_since" "$now" $((last_failures + 1))
        else
            save_state "$status" "$last_since" "$last_reported" $((last_failures + 1))
        fi
        if [ "$notified" != none ]; then
            note "$reason"
            # This run's own lines (hpc-bridge redacts secrets from what it writes).
            this_run | tail -n 20 >&2
        fi
    fi
    log_event run_check_done ", \"exit_status\": $status, \"notified\": \"$notified\""
    exit "$status"
}

# --- the environment cron does not give --------------------------------------------
PATH="${PATH:+$PATH:}/usr/local/bin:/usr/bin:/bin"
export PATH

if [ -f "$site" ]; then
    # It runs as this user with access to the credentials: refuse one others may edit.
    if [ -n "$(find "$site" -maxdepth 0 -perm /022 2>/dev/null)" ]; then
        log_event run_check_refused ', "reason": "site-env.sh is writable by group or others"'
        finish 2 "refusing $site: group or others can write it (chmod go-w $site)"
    fi
    # Lmod/environment-modules scripts reference unset variables: relax -u for them.
    set +u
    # shellcheck source=/dev/null
    . "$site" >>"$log" 2>&1
    site_status=$?
    set +x +e  # whatever the site file did: never trace, and check failures ourselves
    BASH_XTRACEFD=$xtrace_fd
    set -u
    umask 077
    if [ "$site_status" -ne 0 ]; then
        log_event run_check_refused ", \"reason\": \"site-env.sh failed\", \"exit_status\": $site_status"
        finish "$site_status" "$site failed (exit status $site_status); see $log"
    fi
fi

# Slurm commands: the bridge runs sbatch/squeue/sacct from PATH.
if ! command -v sbatch >/dev/null 2>&1; then
    for dir in /opt/slurm/bin /usr/local/slurm/bin /opt/software/slurm/bin; do
        if [ -x "$dir/sbatch" ]; then
            PATH="$PATH:$dir"
            break
        fi
    done
fi

# --- hpc-bridge ---------------------------------------------------------------------
if [ -n "${HPC_BRIDGE_EXE:-}" ]; then
    exe=$HPC_BRIDGE_EXE
    if [ ! -x "$exe" ]; then
        log_event run_check_refused ', "reason": "HPC_BRIDGE_EXE is not an executable"'
        finish 127 "HPC_BRIDGE_EXE=$exe is not an executable file"
    fi
elif exe=$(command -v hpc-bridge); then
    :
else
    log_event run_check_refused ', "reason": "hpc-bridge not found"'
    finish 127 "hpc-bridge not found on PATH; run hpc-bridge-run-check from the installation, or set HPC_BRIDGE_EXE"
fi

cd -- "$workdir" || finish 1 "cannot enter $workdir"
log_event run_check_start
"$exe" --instance "$instance" --credentials "$credentials" check </dev/null >>"$log" 2>&1
status=$?

if [ "$status" -eq 0 ] && this_run | grep -q '"event": "bridge_lock_busy"'; then
    # Another pass or the daemon holds the spool: this run tells nothing about health.
    log_event run_check_done ', "exit_status": 0, "notified": "none", "lock_busy": true'
    exit 0
fi
finish "$status" "hpc-bridge check failed with exit status $status; log: $log (and HPC_LOG_FILE if set)"
