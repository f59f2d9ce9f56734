#!/usr/bin/env bash
# deploy/dev/gridengine.sh — a real single-node Grid Engine (SGE 8.1.9, Debian 12 packages) for tests.
#
#   bash deploy/dev/gridengine.sh up      install (if needed), configure, start, probe   (idempotent)
#   bash deploy/dev/gridengine.sh down    stop sge_execd, then sge_qmaster (SIGTERM via their pid files)
#   bash deploy/dev/gridengine.sh status  daemon pids + `qstat -g c`; exit 0 only when both daemons
#                                         are alive and qmaster answers
#   bash deploy/dev/gridengine.sh stop NAME  stop one daemon (sge_qmaster or sge_execd), for the fault
#                                         tests; `up` starts it again (both idempotent)
#
# Target: Debian 12, run as root, no systemd (the daemons are started by hand). It coexists with the
# Slurm dev cluster (deploy/dev/slurm.sh): it never touches munge or Slurm (SGE needs neither).
# Measured on a 2-core box (hostname `vm`): first `up` on a purged machine 11.5 s (7.4 s of it apt:
# 12 packages, 11.2 MB downloaded, package lists already fresh; an `apt-get update` adds ~5 s), `up`
# when everything already runs 0.6-1.5 s (mostly the probe job), `up` after `down` 4.7 s (execd's
# first load report takes ~3 s), `up` after `stop sge_qmaster` 5.5 s (it restarts execd too: left
# alone, it took the probe job only after a minute or more), `up` after wiping the spool and the cell
# 4.9 s, `down` 1.6-10 s (sge_qmaster takes 1-9 s to shut down on SIGTERM).
#
# What `up` builds (docs/dev-clusters.md says why each item is needed):
#   * packages gridengine-master, gridengine-exec, gridengine-client, preseeded through debconf so
#     that the master postinst runs init_cluster (cell `default`, BerkeleyDB spool); services are
#     never started by dpkg (policy-rc.d), sge_qmaster and sge_execd are started here, each with a
#     clean `env -i` environment (execd's environment is inherited by every job);
#   * the host name: when the host's IPv4 address reverse-resolves to another name (here
#     127.0.0.1 -> `localhost` while `hostname` is `vm`), $SGE_ROOT/default/common/host_aliases
#     maps it back, and act_qmaster names the host; both are read only at daemon start;
#   * global config: min_uid/min_gid 0 (jobs run as root), login_shells none (no profile in jobs: see
#     configure_global), shepherd_cmd = the real binary (the
#     Debian wrapper costs ~0.35 s CPU per job), accounting flushed at once (qacct sees a job ~1 s
#     after it ends), execd_params ENABLE_ADDGRP_KILL=TRUE;
#   * scheduler: schedule_interval 0:0:1, flush_submit_sec 1, flush_finish_sec 1 (a job starts
#     ~0.03 s after qsub; a -hold_jid link costs ~1 s), no load adjustments;
#   * the host as admin, submit and exec host, with a complex `gpu` (INT, consumable per JOB, default
#     0), `mem_free` made consumable, and complex_values gpu=GPUS,mem_free=MEM_MB on the host (SGE
#     sets no CUDA_VISIBLE_DEVICES); hostgroup @allhosts; parallel environment smp ($pe_slots);
#   * queue all.q: hostlist @allhosts, SLOTS slots, pe_list smp, load_thresholds NONE, notify
#     NOTIFY_S seconds (the grace time between SIGUSR2/SIGUSR1 and SIGKILL for `qsub -notify`).
#   Each object is created with `qconf -A*` when missing, else modified with `qconf -M*` only when
#   one of the values above differs (a second `up` changes nothing). `up` ends with a real job
#   (`qsub -sync y /bin/true`) that must finish within PROBE_S seconds.
#   Afterwards the plain /usr/bin/q* commands (qsub, qstat, qacct, qdel, qconf) work for root with no
#   extra environment. Logs: /var/spool/gridengine/qmaster/messages and
#   /var/spool/gridengine/execd/<host>/messages; accounting: /var/lib/gridengine/default/common/accounting.
#
# Knobs (environment; the defaults just work):
#   HPC_DEV_SGE_SLOTS     slots of all.q (the 2 CPUs may be oversubscribed: no load thresholds) (default 8)
#   HPC_DEV_SGE_GPUS      value of the consumable `gpu` on the host (0: every -l gpu=N waits)    (default 2)
#   HPC_DEV_SGE_MEM_MB    value of the consumable `mem_free` on the host, in MB                  (default 16000)
#   HPC_DEV_SGE_NOTIFY_S  queue `notify` time: SIGUSR2 -> SIGKILL delay with qsub -notify, seconds (default 10)
#   HPC_DEV_SGE_PROBE_S   timeout of the final `qsub -sync y` probe, seconds                       (default 60)
#   HPC_DEV_OTHER_USER    a second unix user (created with useradd when missing; shared with slurm.sh): the
#                         backend tests submit held jobs as this user to check that only our jobs are seen.
#                         all.q has user_lists NONE, so it may submit like any user             (default hpcother)
set -Eeuo pipefail # -E: the ERR trap below also fires inside functions

readonly PROG="gridengine.sh"
readonly SLOTS="${HPC_DEV_SGE_SLOTS:-8}"
readonly GPUS="${HPC_DEV_SGE_GPUS:-2}"
readonly MEM_MB="${HPC_DEV_SGE_MEM_MB:-16000}"
readonly NOTIFY_S="${HPC_DEV_SGE_NOTIFY_S:-10}"
readonly PROBE_S="${HPC_DEV_SGE_PROBE_S:-60}"
readonly OTHER_USER="${HPC_DEV_OTHER_USER:-hpcother}"

# The Debian layout. SGE_ROOT/SGE_CELL are exported for the real binaries in /usr/lib/gridengine
# (the /usr/bin wrappers find them on their own, at ~60 ms per call).
# HPC_DEV_SGE_ROOT: only a test points it elsewhere (to see the refusal of a foreign cell).
export SGE_ROOT="${HPC_DEV_SGE_ROOT:-/var/lib/gridengine}"
export SGE_CELL=default
readonly COMMON="$SGE_ROOT/$SGE_CELL/common"
readonly OWN_MARKER=hpc-bridge-dev-cell  # in $COMMON: this script created the cell
readonly SPOOL=/var/spool/gridengine
readonly SPOOLDB="$SPOOL/spooldb"
readonly BIN=/usr/lib/gridengine
readonly ADMIN_USER=sgeadmin
readonly DAEMON_PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
readonly QMASTER_PIDFILE="$SPOOL/qmaster/qmaster.pid"
readonly QMASTER_LOG="$SPOOL/qmaster/messages"

readonly APT_LOG=/var/log/gridengine-dev-apt.log
readonly INIT_LOG=/var/log/gridengine-dev-init.log
readonly PACKAGES=(gridengine-master gridengine-exec gridengine-client)
readonly POLICY_RC=/usr/sbin/policy-rc.d

T0=$(date +%s.%N)
HOST=""           # `hostname`: the name SGE uses for this host (set in resolve_host)
CHANGES=0         # objects/files changed or daemons started by this run
RESTART_NEEDED=0  # host_aliases/act_qmaster changed while the daemons ran
OUR_POLICY_RC=0   # we created policy-rc.d and must remove it
WORK=""           # temporary directory for qconf files

# Output and process helpers (say, warn, die, is_alive, daemon_pid, wait_for, stop_daemon).
# shellcheck source-path=SCRIPTDIR source=lib/daemons.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/daemons.sh"
changed() {
  CHANGES=$((CHANGES + 1))
  say "$*"
}
cleanup() {
  if ((OUR_POLICY_RC)); then rm -f "$POLICY_RC"; fi
  if [[ -n $WORK ]]; then rm -rf "$WORK"; fi
}
trap 'on_err "$?" "$LINENO" "$BASH_COMMAND"' ERR
trap cleanup EXIT

# pidfile_of NAME: the daemon's pid file. execd's spool dir is named after the host's *raw*
# name (here `localhost`, not `vm`), so it is found by glob.
pidfile_of() {
  local f
  case "$1" in
    sge_qmaster) echo "$QMASTER_PIDFILE" ;;
    sge_execd)
      for f in "$SPOOL"/execd/*/execd.pid; do
        [[ -e $f ]] && echo "$f" && return 0
      done
      echo "$SPOOL/execd/$HOST/execd.pid"
      ;;
  esac
}

# The real binaries (no wrapper), with SGE_ROOT/SGE_CELL from the environment above.
qconf() { "$BIN/qconf" "$@"; }
qmaster_answers() { qconf -sconf global >/dev/null 2>&1; }

# --------------------------------------------------------------------------------------------
# install
# --------------------------------------------------------------------------------------------
pkg_installed() { [[ "$(dpkg-query -W -f='${Status}' "$1" 2>/dev/null)" == "install ok installed" ]]; }

# resolve_host: `hostname` must resolve, or neither daemon can start. /etc/hosts is appended to
# (not rewritten with sed -i): it is often a bind mount.
resolve_host() {
  HOST=$(hostname)
  [[ -n $HOST ]] || die "hostname is empty"
  if ! getent ahostsv4 "$HOST" >/dev/null 2>&1; then
    printf '127.0.1.1 %s\n' "$HOST" >>/etc/hosts
    changed "hosts: $HOST did not resolve; added '127.0.1.1 $HOST' to /etc/hosts"
  fi
}

install_packages() {
  local missing=() p pkg
  for p in "${PACKAGES[@]}"; do pkg_installed "$p" || missing+=("$p"); done
  if ((${#missing[@]} == 0)); then
    say "packages: already installed (${PACKAGES[*]})"
    return 0
  fi
  say "packages: installing ${missing[*]} (log: $APT_LOG)"
  # The postinsts ask (debconf) whether to configure a cluster; with these answers the master's
  # postinst runs init_cluster and the exec/client postinsts write act_qmaster.
  for pkg in gridengine-common "${PACKAGES[@]}"; do
    printf '%s shared/gridengineconfig boolean true\n%s shared/gridenginecell string %s\n%s shared/gridenginemaster string %s\n' \
      "$pkg" "$pkg" "$SGE_CELL" "$pkg" "$HOST"
  done | debconf-set-selections
  # The postinsts run `invoke-rc.d gridengine-* start || exit 1`: a policy-rc.d that says 101
  # keeps dpkg from depending on init scripts (we start the daemons by hand). Many container
  # images already have one; add ours only when there is none, and remove it afterwards.
  if [[ ! -e $POLICY_RC ]]; then
    printf '#!/bin/sh\n# temporary, from deploy/dev/gridengine.sh\nexit 101\n' >"$POLICY_RC"
    chmod 0755 "$POLICY_RC"
    OUR_POLICY_RC=1
  fi
  : >"$APT_LOG"
  # Try with the package lists there are; `apt-get update` only when that fails (saves ~5 s).
  # The lock timeout: another apt (e.g. slurm.sh's) may be running.
  local apt=(apt-get -o DPkg::Lock::Timeout=300)
  if ! DEBIAN_FRONTEND=noninteractive "${apt[@]}" install -y --no-install-recommends "${PACKAGES[@]}" \
    >>"$APT_LOG" 2>&1; then
    "${apt[@]}" update >>"$APT_LOG" 2>&1 || die "apt-get update failed: $(tail -5 "$APT_LOG")"
    DEBIAN_FRONTEND=noninteractive "${apt[@]}" install -y --no-install-recommends "${PACKAGES[@]}" \
      >>"$APT_LOG" 2>&1 \
      || die "apt-get install ${PACKAGES[*]} failed (full log: $APT_LOG): $(tail -5 "$APT_LOG")"
  fi
  if ((OUR_POLICY_RC)); then
    rm -f "$POLICY_RC"
    OUR_POLICY_RC=0
  fi
  changed "packages: installed ${missing[*]}"
}

# ensure_cell: what the postinsts create, recreated when someone wiped /var/lib/gridengine/default
# or /var/spool/gridengine (or installed with debconf saying "don't configure").
ensure_cell() {
  local d
  install -d -o "$ADMIN_USER" -g "$ADMIN_USER" -m 0755 "$SGE_ROOT" "$SGE_ROOT/$SGE_CELL" "$COMMON" \
    "$SPOOL" "$SPOOL/qmaster" "$SPOOL/qmaster/job_scripts" "$SPOOLDB" "$SPOOL/execd"
  if [[ ! -s $COMMON/bootstrap ]]; then
    install -m 0644 -o "$ADMIN_USER" -g "$ADMIN_USER" /usr/share/gridengine/default-bootstrap "$COMMON/bootstrap"
    changed "cell: wrote $COMMON/bootstrap"
  fi
  if [[ ! -e $SPOOLDB/sge ]]; then
    # A spool without database: init_cluster (as the master postinst does). The daemons must
    # not run on the old state. Job ids start again at 1, so an old accounting file is moved
    # aside (else `qacct -j 1` would also show the old job 1).
    for d in sge_execd sge_qmaster; do stop_daemon "$d"; done
    if [[ -e $COMMON/accounting ]]; then
      mv -f "$COMMON/accounting" "$COMMON/accounting.before-$(date +%Y%m%d%H%M%S)"
    fi
    runuser -u "$ADMIN_USER" -- /usr/share/gridengine/scripts/init_cluster \
      "$SGE_ROOT" "$SGE_CELL" "$SPOOLDB" "$ADMIN_USER" >>"$INIT_LOG" 2>&1 \
      || die "init_cluster failed (log: $INIT_LOG): $(tail -5 "$INIT_LOG")"
    changed "cell: init_cluster created the spool database $SPOOLDB"
  fi
}

# write_common NAME CONTENT: a file in $COMMON, owned by sgeadmin; empty CONTENT removes it.
# A change while the daemons run means they must be restarted (they read it only at start).
write_common() {
  local path="$COMMON/$1" content=$2
  if [[ -z $content ]]; then
    [[ -e $path ]] || return 0
    rm -f "$path"
  else
    [[ -f $path && "$(cat "$path")" == "$content" ]] && return 0
    printf '%s\n' "$content" >"$path.tmp"
    chown "$ADMIN_USER:$ADMIN_USER" "$path.tmp"
    chmod 0644 "$path.tmp"
    mv -f "$path.tmp" "$path"
  fi
  if daemon_pid sge_qmaster >/dev/null || daemon_pid sge_execd >/dev/null; then RESTART_NEEDED=1; fi
  if [[ -n $content ]]; then changed "cell: wrote $path ($content)"; else changed "cell: removed $path"; fi
}

# The blocker on these machines: `vm` resolves to 127.0.0.1, which reverse-resolves to
# `localhost`. qmaster then calls itself `localhost` and refuses every client ("client IP resolved
# to host name localhost. This is not identical to clients host name vm"). host_aliases
# `vm localhost` (the first word is the name SGE uses) plus act_qmaster=vm fix it without touching
# /etc/hosts. The reverse name is the resolver's own answer (getent), not SGE's gethostbyaddr,
# which applies host_aliases itself.
configure_host_names() {
  local ip rname aliases=""
  ip=$(getent ahostsv4 "$HOST" | awk 'NR == 1 { print $1 }')
  [[ -n $ip ]] || die "cannot resolve $HOST"
  rname=$(getent hosts "$ip" | awk 'NR == 1 { print $2 }')
  if [[ -n $rname && $rname != "$HOST" ]]; then aliases="$HOST $rname"; fi
  write_common host_aliases "$aliases"
  write_common act_qmaster "$HOST"
}

# --------------------------------------------------------------------------------------------
# daemons
# --------------------------------------------------------------------------------------------

# Both daemonize on their own, drop to euid sgeadmin and write their pid files. `env -i`: execd's
# environment is inherited by every job (execd_params INHERIT_ENV defaults to true).
start_daemon() {
  local name=$1 log=$2 pid
  if pid=$(daemon_pid "$name"); then
    say "$name: running (pid $pid)"
    return 0
  fi
  rm -f "$(pidfile_of "$name")"
  env -i PATH="$DAEMON_PATH" SGE_ROOT="$SGE_ROOT" SGE_CELL="$SGE_CELL" LANG=C.UTF-8 \
    "$BIN/$name" </dev/null >/dev/null 2>&1 || die "$name failed to start (see $log)"
  wait_for 10 daemon_pid "$name" || die "$name died at start (see $log)"
  if [[ $name == sge_qmaster ]]; then
    wait_for 30 qmaster_answers || die "sge_qmaster does not answer qconf (see $log)"
  fi
  changed "$name: started (pid $(daemon_pid "$name"))"
}

# --------------------------------------------------------------------------------------------
# configuration through qconf's file forms (-A*/-M*; the -a*/-m* forms open $EDITOR)
# --------------------------------------------------------------------------------------------

# normalize: qconf's `-s*` output as "key value" lines: continuation lines (ending in `\`) joined,
# comments and blank lines dropped, runs of blanks squeezed to one space.
normalize() {
  awk '
    { sub(/\r$/, "") }
    pending != "" { sub(/^[ \t]+/, ""); $0 = pending " " $0; pending = "" }
    /\\[ \t]*$/ { sub(/[ \t]*\\[ \t]*$/, ""); pending = $0; next }
    /^[ \t]*(#|$)/ { next }
    { $1 = $1; print }
    END { if (pending != "") { $0 = pending; $1 = $1; print } }
  '
}

# differs CURRENT WANTED: true when one of WANTED's "key value" lines is missing from CURRENT
# or has another value there (both normalized). Keys that WANTED does not name are ignored.
differs() {
  awk 'NR == FNR { cur[$1] = $0; next } !($1 in cur) || cur[$1] != $0 { bad = 1 } END { exit !bad }' \
    <(printf '%s\n' "$1") <(printf '%s\n' "$2")
}

# with_values CURRENT WANTED: CURRENT with WANTED's lines replacing those of the same key
# (appended when absent); for the objects whose many other keys are kept as they are.
with_values() {
  awk 'NR == FNR { want[$1] = $0; order[++n] = $1; next }
       $1 in want { print want[$1]; seen[$1] = 1; next }
       { print }
       END { for (i = 1; i <= n; i++) if (!(order[i] in seen)) print want[order[i]] }' \
    <(printf '%s\n' "$2") <(printf '%s\n' "$1")
}

# write_form NAME CONTENT: $WORK/NAME holding CONTENT; prints the path.
write_form() {
  printf '%s\n' "$2" >"$WORK/$1"
  echo "$WORK/$1"
}

# ensure_object WHAT NAME SHOW ADD MOD WANTED [TEMPLATE]: the object NAME shown by `qconf SHOW NAME`
# gets WANTED's values. Without TEMPLATE, WANTED is the whole form: `qconf ADD file` when the
# object is missing, `qconf MOD file` when one of its values differs (the shown form can hold
# read-only keys, e.g. an exec host's load_values, that MOD refuses). With TEMPLATE, ADD gets
# TEMPLATE+WANTED and MOD gets the current form+WANTED.
ensure_object() {
  local what=$1 name=$2 show=$3 add=$4 mod=$5 wanted=$6 template=${7:-} current file out
  if current=$(qconf "$show" "$name" 2>/dev/null) && [[ -n $current ]]; then
    current=$(normalize <<<"$current")
    if ! differs "$current" "$wanted"; then
      say "$what $name: unchanged"
      return 0
    fi
    if [[ -n $template ]]; then
      file=$(write_form "$what" "$(with_values "$current" "$wanted")")
    else
      file=$(write_form "$what" "$wanted")
    fi
    out=$(qconf "$mod" "$file" 2>&1) || die "qconf $mod ($what $name) failed: $out"
    changed "$what $name: modified"
  elif [[ -n $template ]]; then
    file=$(write_form "$what" "$(with_values "$(normalize <<<"$template")" "$wanted")")
    out=$(qconf "$add" "$file" 2>&1) || die "qconf $add ($what $name) failed: $out"
    changed "$what $name: added"
  else
    file=$(write_form "$what" "$wanted")
    out=$(qconf "$add" "$file" 2>&1) || die "qconf $add ($what $name) failed: $out"
    changed "$what $name: added"
  fi
}

# Global configuration. `qconf -Mconf FILE` takes the configuration's *name* from the
# file name, so the file is $WORK/global and qconf runs in $WORK.
configure_global() {
  local current wanted out
  current=$(qconf -sconf global 2>&1) || die "qconf -sconf global failed: $current"
  current=$(normalize <<<"$current")
  # min_uid/min_gid 0: root's jobs are refused with the default 1000.
  # reporting_params: the default flush_time=00:00:15 delays qacct by up to 15 s.
  # login_shells none: job shells read no profile. Root's ~/.bashrc on these machines runs
  # `pyenv rehash`, which waits 60 s on a lock that any job killed inside it leaves behind, so
  # every later job would start a minute late. (Job scripts do not rely on a profile: they call
  # absolute paths, which also covers sites whose login shells reset PATH.)
  wanted="min_uid 0
min_gid 0
login_shells none
load_report_time 00:00:10
shepherd_cmd $BIN/sge_shepherd
execd_params ENABLE_ADDGRP_KILL=TRUE
reporting_params accounting=true reporting=false flush_time=00:00:01 joblog=false sharelog=00:00:00 accounting_flush_time=00:00:00"
  if ! differs "$current" "$wanted"; then
    say "config global: unchanged"
    return 0
  fi
  write_form global "$(with_values "$current" "$wanted")" >/dev/null
  out=$(cd "$WORK" && qconf -Mconf global 2>&1) || die "qconf -Mconf global failed: $out"
  changed "config global: modified"
}

configure_scheduler() {
  local current wanted file out
  current=$(qconf -ssconf 2>&1) || die "qconf -ssconf failed: $current"
  current=$(normalize <<<"$current")
  wanted="schedule_interval 0:0:1
flush_submit_sec 1
flush_finish_sec 1
job_load_adjustments NONE
load_adjustment_decay_time 0:0:0
schedd_job_info true"
  if ! differs "$current" "$wanted"; then
    say "scheduler: unchanged"
    return 0
  fi
  file=$(write_form sconf "$(with_values "$current" "$wanted")")
  out=$(qconf -Msconf "$file" 2>&1) || die "qconf -Msconf failed: $out"
  changed "scheduler: modified"
}

# The consumables: name shortcut type relop requestable consumable default urgency.
# `gpu` is consumed per job (JOB), not per slot: `-pe smp 4 -l gpu=1` takes one GPU, not four.
# `mem_free` is made consumable (per slot, as sites do) against the host's MEM_MB, so that
# `qsub -w e` refuses a job asking for more memory than the node has instead of queueing it for ever.
configure_complex() {
  local current wanted="gpu gpu INT <= YES JOB 0 0
mem_free mf MEMORY <= YES YES 0 0" file out
  current=$(qconf -sc 2>&1) || die "qconf -sc failed: $current"
  current=$(normalize <<<"$current")
  if ! differs "$current" "$wanted"; then
    say "complexes gpu, mem_free: unchanged"
    return 0
  fi
  file=$(write_form complex "$(with_values "$current" "$wanted")")
  out=$(qconf -Mc "$file" 2>&1) || die "qconf -Mc failed: $out"
  changed "complexes gpu (consumable per job), mem_free (consumable): defined"
}

configure_hosts() {
  local out
  if qconf -sh 2>/dev/null | grep -qxF "$HOST"; then
    say "host $HOST: admin host"
  else
    out=$(qconf -ah "$HOST" 2>&1) || die "qconf -ah $HOST failed: $out"
    changed "host $HOST: added as admin host"
  fi
  if qconf -ss 2>/dev/null | grep -qxF "$HOST"; then
    say "host $HOST: submit host"
  else
    out=$(qconf -as "$HOST" 2>&1) || die "qconf -as $HOST failed: $out"
    changed "host $HOST: added as submit host"
  fi
  ensure_object exechost "$HOST" -se -Ae -Me "hostname $HOST
load_scaling NONE
complex_values gpu=$GPUS,mem_free=${MEM_MB}M
user_lists NONE
xuser_lists NONE
projects NONE
xprojects NONE
usage_scaling NONE
report_variables NONE"
  ensure_object hostgroup @allhosts -shgrp -Ahgrp -Mhgrp "group_name @allhosts
hostlist $HOST"
}

configure_pe() {
  ensure_object pe smp -sp -Ap -Mp "pe_name smp
slots 999
user_lists NONE
xuser_lists NONE
start_proc_args NONE
stop_proc_args NONE
allocation_rule \$pe_slots
control_slaves FALSE
job_is_first_task TRUE
urgency_slots min
accounting_summary FALSE
qsort_args NONE"
}

# Queue all.q, created from qconf's queue template (`qconf -sq` without a name).
configure_queue() {
  local template notify
  notify=$(printf '%02d:%02d:%02d' $((NOTIFY_S / 3600)) $((NOTIFY_S % 3600 / 60)) $((NOTIFY_S % 60)))
  template=$(qconf -sq 2>/dev/null) || template=""
  ensure_object queue all.q -sq -Aq -Mq "qname all.q
hostlist @allhosts
slots $SLOTS
pe_list smp
load_thresholds NONE
suspend_thresholds NONE
notify $notify
shell /bin/sh
shell_start_mode posix_compliant
tmpdir /tmp" "$template"
}

# --------------------------------------------------------------------------------------------
# commands
# --------------------------------------------------------------------------------------------

# A real job is the only reliable readiness check: the queue instance stays in state `u` until
# execd has reported. `qsub -sync y` returns the job's exit status.
probe() {
  local out
  if ! out=$(cd / && timeout "$PROBE_S" "$BIN/qsub" -sync y -b y -shell no -N hpc-dev-probe \
    -o /dev/null -j y /bin/true 2>&1); then
    die "readiness probe 'qsub -sync y /bin/true' failed within ${PROBE_S}s: ${out:-timeout}
       qstat -f says: $("$BIN/qstat" -f 2>&1 | tail -5)
       see $QMASTER_LOG and $SPOOL/execd/*/messages"
  fi
  say "probe: qsub -sync y /bin/true OK"
}

check_knobs() {
  local v
  for v in SLOTS GPUS NOTIFY_S PROBE_S; do
    [[ ${!v} =~ ^[0-9]+$ ]] || die "HPC_DEV_SGE_$v must be a non-negative integer (got '${!v}')"
  done
  ((SLOTS > 0)) || die "HPC_DEV_SGE_SLOTS must be > 0"
  ((PROBE_S > 0)) || die "HPC_DEV_SGE_PROBE_S must be > 0"
}

# refuse_foreign_cell: this script builds a disposable one-node cluster. A cell that exists before
# it ran and does not carry its marker file is someone else's (a real cluster): nothing is changed.
refuse_foreign_cell() {
  if [[ -e $COMMON/bootstrap && ! -e $COMMON/$OWN_MARKER ]]; then
    die "refusing to touch the Grid Engine cell $SGE_ROOT/$SGE_CELL: deploy/dev/gridengine.sh did not" \
      "create it (this looks like a real cluster). This script builds a disposable dev cluster only"
  fi
}

cmd_up() {
  [[ $EUID -eq 0 ]] || die "must run as root"
  check_knobs
  refuse_foreign_cell
  resolve_host
  install_packages
  # Ours from here on (the packages' postinst may just have created the cell).
  mkdir -p "$COMMON"
  [[ -e $COMMON/$OWN_MARKER ]] || echo "written by deploy/dev/gridengine.sh: a disposable dev cell" >"$COMMON/$OWN_MARKER"
  ensure_cell
  configure_host_names
  if ((RESTART_NEEDED)); then
    say "host names changed: restarting the daemons"
    stop_daemon sge_execd
    stop_daemon sge_qmaster
  fi
  local qmaster_was_down=0
  daemon_pid sge_qmaster >/dev/null || qmaster_was_down=1
  start_daemon sge_qmaster "$QMASTER_LOG"
  # An execd that outlived its qmaster gives up registering ("abort qmaster registration due to
  # communication errors") and takes no job until much later: restart it (running jobs keep
  # running: their shepherds do not depend on execd).
  if ((qmaster_was_down)) && daemon_pid sge_execd >/dev/null; then
    say "sge_qmaster was down: restarting sge_execd so that it registers now"
    stop_daemon sge_execd
  fi
  WORK=$(mktemp -d /tmp/gridengine-dev.XXXXXX)
  configure_global
  configure_scheduler
  configure_complex
  configure_hosts
  configure_pe
  configure_queue
  start_daemon sge_execd "$SPOOL/execd/*/messages"
  ensure_other_user "$OTHER_USER"
  probe
  say "up: Grid Engine ready on $HOST ($CHANGES changes)"
}

cmd_down() {
  stop_daemon sge_execd
  stop_daemon sge_qmaster
  say "down: done"
}

cmd_status() {
  local d pid rc=0
  HOST=$(hostname)
  for d in sge_qmaster sge_execd; do
    if pid=$(daemon_pid "$d"); then
      printf '%-12s running (pid %s)\n' "$d" "$pid"
    else
      printf '%-12s NOT running\n' "$d"
      rc=1
    fi
  done
  if daemon_pid sge_qmaster >/dev/null; then
    timeout 10 "$BIN/qstat" -g c || rc=1
  fi
  exit "$rc" # exit, not return: a failing return would fire the ERR trap
}

main() {
  case "${1:-}" in
    up) cmd_up ;;
    down) cmd_down ;;
    status) cmd_status ;;
    stop)
      [[ ${2:-} =~ ^(sge_qmaster|sge_execd)$ ]] || die "usage: bash $0 stop sge_qmaster|sge_execd"
      HOST=$(hostname)
      stop_daemon "$2"
      ;;
    *)
      echo "usage: bash $0 up|down|status|stop NAME" >&2
      exit 2
      ;;
  esac
}

main "$@"
