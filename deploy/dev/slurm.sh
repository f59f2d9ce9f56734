#!/usr/bin/env bash
# deploy/dev/slurm.sh — a real single-node Slurm 22.05 cluster for the tests and the demo.
#
#   bash deploy/dev/slurm.sh up      install (if needed), configure, start, probe   (idempotent)
#   bash deploy/dev/slurm.sh down    stop slurmd, slurmctld, slurmdbd, munged (SIGTERM, reverse order)
#   bash deploy/dev/slurm.sh status  daemon pids + sinfo; exit 0 only when every daemon is alive
#   bash deploy/dev/slurm.sh stop NAME  stop one daemon (slurmctld, slurmdbd, slurmd), for the fault
#                                    tests; `up` starts it again (both idempotent)
#
# Target: Debian 12, run as root, no systemd (daemons are started by hand). Measured on a 2-core
# box: first `up` 12 s (apt update + downloads included), `up` when everything already runs 0.5 s,
# `up` after a config change (all slurm daemons restarted) 3.5 s.
#
# What `up` builds:
#   munged -> (MariaDB, reused if already running) -> slurmdbd -> slurmctld -> slurmd
#   * one node named after `hostname -s`, NodeAddr=127.0.0.1, advertised with 8 CPUs / 16000 MB
#     (SlurmdParameters=config_overrides) and 2 fake GPUs (gres gpu:2 backed by char devices 1:3);
#   * memory limits enforced by task/cgroup (a job that exceeds --mem ends OUT_OF_MEMORY);
#   * accounting through slurmdbd + MariaDB, so `sacct` works.
#
# Knobs (environment; the defaults just work):
#   HPC_DEV_SLURM_CPUS      CPUs advertised for the node                     (default 8)
#   HPC_DEV_SLURM_MEM_MB    RealMemory of the node, in MB                    (default 16000)
#   HPC_DEV_SLURM_GPUS      number of fake GPUs, 0 disables GRES             (default 2)
#   HPC_DEV_SLURM_DEF_MEM_PER_CPU  memory (MB) of a job without --mem, per CPU (default MEM_MB/CPUS)
#   HPC_DEV_SLURM_CLUSTER   ClusterName                                      (default devcluster)
#   HPC_DEV_SLURM_CGROUP    auto | v1 | v2 | none  (none = no memory limits) (default auto)
#   HPC_DEV_SLURM_DB_PASS   password of the MariaDB user `slurm`             (default slurmdbpass)
#   HPC_DEV_SLURM_PROBE_S   timeout of the final `srun true` probe, seconds  (default 60)
#   HPC_DEV_OTHER_USER      a second unix user with an accounting association: the backend tests
#                           submit held jobs as this user to check that only our jobs are seen
#                           (created with useradd when missing; shared with gridengine.sh) (default hpcother)
set -Eeuo pipefail  # -E: the ERR trap below also fires inside functions

readonly PROG="slurm.sh"
readonly CPUS="${HPC_DEV_SLURM_CPUS:-8}"
readonly MEM_MB="${HPC_DEV_SLURM_MEM_MB:-16000}"
readonly GPUS="${HPC_DEV_SLURM_GPUS:-2}"
DEF_MEM_PER_CPU="${HPC_DEV_SLURM_DEF_MEM_PER_CPU:-}" # default MEM_MB/CPUS, set in check_knobs
readonly CLUSTER="${HPC_DEV_SLURM_CLUSTER:-devcluster}"
readonly CGROUP_MODE_WANTED="${HPC_DEV_SLURM_CGROUP:-auto}"
readonly DB_PASS="${HPC_DEV_SLURM_DB_PASS:-slurmdbpass}"
readonly PROBE_S="${HPC_DEV_SLURM_PROBE_S:-60}"
readonly OTHER_USER="${HPC_DEV_OTHER_USER:-hpcother}"

readonly ETC=/etc/slurm
readonly STATE_DIR=/var/lib/slurm
readonly LOG_DIR=/var/log/slurm
readonly FAKEGPU_DIR="$STATE_DIR/fakegpu"
readonly DB_NAME=slurm_acct_db
readonly DB_USER=slurm

readonly APT_LOG=/var/log/slurm-dev-apt.log
readonly PACKAGES=(slurm-wlm slurmctld slurmd slurm-client munge slurmdbd)

# daemon name (= its /proc/PID/comm) -> pidfile. The pidfiles are the ones named in the
# generated configs (munged's is its compiled-in default).
declare -A PIDFILE=(
  [munged]=/run/munge/munged.pid
  [slurmdbd]=/run/slurmdbd.pid
  [slurmctld]=/run/slurmctld.pid
  [slurmd]=/run/slurmd.pid
)

T0=$(date +%s.%N)
CONFIG_CHANGED=0
CGROUP_MODE=""

# Output and process helpers (say, warn, die, is_alive, daemon_pid, wait_for, stop_daemon).
# shellcheck source-path=SCRIPTDIR source=lib/daemons.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/daemons.sh"
trap 'on_err "$?" "$LINENO" "$BASH_COMMAND"' ERR
pidfile_of() { echo "${PIDFILE[$1]}"; }

port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

# --------------------------------------------------------------------------------------------
# install
# --------------------------------------------------------------------------------------------
pkg_installed() { [[ "$(dpkg-query -W -f='${Status}' "$1" 2>/dev/null)" == "install ok installed" ]]; }

install_packages() {
  local missing=() p
  for p in "$@"; do pkg_installed "$p" || missing+=("$p"); done
  if ((${#missing[@]} == 0)); then
    say "packages: already installed ($*)"
    return 0
  fi
  say "packages: installing ${missing[*]} (apt-get update + install)"
  # apt's chatter (and debconf's "delaying package configuration") goes to a log, shown on failure.
  apt-get update >"$APT_LOG" 2>&1 || die "apt-get update failed: $(tail -5 "$APT_LOG")"
  # Gotcha 1: policy-rc.d forbids the postinst scripts from starting the services; that is
  # expected (we start everything by hand below). The postinsts still create the munge key
  # and the MariaDB datadir.
  DEBIAN_FRONTEND=noninteractive apt-get install -y "$@" >>"$APT_LOG" 2>&1 \
    || die "apt-get install $* failed (full log: $APT_LOG): $(tail -5 "$APT_LOG")"
  say "packages: installed ${missing[*]}"
}

# --------------------------------------------------------------------------------------------
# configuration
# --------------------------------------------------------------------------------------------

# write_if_changed PATH MODE CONTENT: rewrites PATH only when CONTENT differs, and then sets
# CONFIG_CHANGED so that the running slurm daemons are restarted (gotcha 9: slurmd must see the
# same slurm.conf as slurmctld, and e.g. GresTypes changes are ignored by `scontrol reconfigure`).
write_if_changed() {
  local path=$1 mode=$2 content=$3 tmp
  if [[ -f $path ]] && [[ "$(cat "$path")" == "$content" ]] \
    && [[ "$(stat -c %a "$path")" == "$mode" ]]; then
    return 0
  fi
  tmp=$(mktemp "$path.XXXXXX")
  printf '%s\n' "$content" >"$tmp"
  chmod "$mode" "$tmp"
  mv -f "$tmp" "$path"
  CONFIG_CHANGED=1
  say "config: wrote $path"
}

# Which cgroup plugin enforces memory limits here?
# v1: the notes measured the v1 hierarchies (memory, freezer, ...) as writable on this machine
#     kind; we check that by creating (and removing) a child cgroup in memory and freezer.
# v2: only if /sys/fs/cgroup itself is a cgroup2 mount (Slurm 22.05's cgroup/v2 needs that).
detect_cgroup_mode() {
  local probe
  case "$CGROUP_MODE_WANTED" in
    v1 | v2 | none)
      CGROUP_MODE=$CGROUP_MODE_WANTED
      return 0
      ;;
    auto) ;;
    *) die "HPC_DEV_SLURM_CGROUP must be auto, v1, v2 or none (got '$CGROUP_MODE_WANTED')" ;;
  esac
  probe="hpc-dev-slurm-probe.$$"
  if [[ -d /sys/fs/cgroup/memory && -d /sys/fs/cgroup/freezer ]] \
    && mkdir "/sys/fs/cgroup/memory/$probe" 2>/dev/null; then
    rmdir "/sys/fs/cgroup/memory/$probe" 2>/dev/null || true
    if mkdir "/sys/fs/cgroup/freezer/$probe" 2>/dev/null; then
      rmdir "/sys/fs/cgroup/freezer/$probe" 2>/dev/null || true
      CGROUP_MODE=v1
      return 0
    fi
  fi
  if [[ "$(stat -f -c %T /sys/fs/cgroup 2>/dev/null)" == cgroup2fs ]]; then
    CGROUP_MODE=v2
    return 0
  fi
  warn "no writable cgroup hierarchy: memory limits (--mem) will NOT be enforced"
  CGROUP_MODE=none
}

make_fake_gpus() {
  local i
  ((GPUS > 0)) || return 0
  install -d -m 0755 "$FAKEGPU_DIR"
  for ((i = 0; i < GPUS; i++)); do
    # Same major/minor as /dev/null: harmless to open, and gres.conf needs real char devices.
    [[ -c $FAKEGPU_DIR/gpu$i ]] || mknod -m 0666 "$FAKEGPU_DIR/gpu$i" c 1 3
  done
}

write_configs() {
  local node proctrack taskplugin gres_line="" gres_types="" acct_tres="" gres_conf
  node=$(hostname -s)
  [[ -n $node ]] || die "hostname -s is empty"
  detect_cgroup_mode
  if [[ $CGROUP_MODE == none ]]; then
    # proctrack/pgid still kills a job's orphaned children at job end (gotcha 12:
    # proctrack/linuxproc leaks them); but nothing enforces --mem in this mode.
    proctrack=proctrack/pgid
    taskplugin=task/none
  else
    proctrack=proctrack/cgroup
    taskplugin=task/cgroup
  fi
  if ((GPUS > 0)); then
    gres_line=" Gres=gpu:$GPUS"
    gres_types="GresTypes=gpu"
    acct_tres="AccountingStorageTRES=gres/gpu"
  fi

  install -d -m 0755 "$ETC" "$STATE_DIR" "$STATE_DIR/slurmd" "$STATE_DIR/slurmctld" "$LOG_DIR"
  make_fake_gpus

  # Notes on the non-obvious lines:
  #  AuthInfo=cred_expire=10   a requeued job waits cred_expire+1 s before it can run again
  #                            (default 120 s; 5 is the minimum accepted) — gotcha 5.
  #  sched_interval/bf_interval=2  otherwise an eligible job can wait for the next 30 s backfill pass.
  #  DependencyParameters=kill_invalid_depend  in 22.05 it is ignored in SchedulerParameters (gotcha 7);
  #                            an afterok on a failed job is cancelled instead of pending forever.
  #  DefMemPerCPU             with CR_Core_Memory a job without --mem would get the whole node
  #                            (one job at a time) — gotcha 3. The notes use 128, but with task/cgroup
  #                            this is also a HARD limit, and 128 MB kills a plain `python -c 'import
  #                            numpy'`; MEM_MB/CPUS (2000) still lets CPUS one-CPU jobs run at once.
  #  SlurmdParameters=config_overrides  lets the node advertise more CPUs than the 2 real cores
  #                            without being drained — gotcha 4.
  #  EnforcePartLimits=ALL     impossible requests are rejected at submit instead of pending forever.
  #  MailProg=/bin/true        --mail-* is accepted, nothing is sent.
  local slurm_conf
  slurm_conf=$(
    cat <<EOF
# Generated by deploy/dev/slurm.sh — edits are overwritten on the next 'up'.
ClusterName=$CLUSTER
SlurmctldHost=$node(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=cred_expire=10
MpiDefault=none
ProctrackType=$proctrack
TaskPlugin=$taskplugin
JobAcctGatherType=jobacct_gather/linux
JobAcctGatherFrequency=30
SlurmctldPidFile=${PIDFILE[slurmctld]}
SlurmdPidFile=${PIDFILE[slurmd]}
SlurmctldPort=6817
SlurmdPort=6818
SlurmdSpoolDir=$STATE_DIR/slurmd
StateSaveLocation=$STATE_DIR/slurmctld
SlurmctldLogFile=$LOG_DIR/slurmctld.log
SlurmdLogFile=$LOG_DIR/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
ReturnToService=2
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2,bf_interval=2
DependencyParameters=kill_invalid_depend
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
DefMemPerCPU=$DEF_MEM_PER_CPU
SlurmdParameters=config_overrides
EnforcePartLimits=ALL
JobRequeue=1
MinJobAge=300
KillWait=2
OverTimeLimit=0
InactiveLimit=0
MailProg=/bin/true
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
AccountingStoragePort=6819
$acct_tres
$gres_types
NodeName=$node NodeAddr=127.0.0.1 CPUs=$CPUS RealMemory=$MEM_MB$gres_line State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
  )
  write_if_changed "$ETC/slurm.conf" 644 "$slurm_conf"

  # AutoDetect=off: there is no NVML here; the File= entries are the fake char devices.
  if ((GPUS > 0)); then
    gres_conf="AutoDetect=off
NodeName=$node Name=gpu File=$FAKEGPU_DIR/gpu[0-$((GPUS - 1))]"
  else
    gres_conf="AutoDetect=off"
  fi
  write_if_changed "$ETC/gres.conf" 644 "$gres_conf"

  # ConstrainRAMSpace=yes is what turns --mem into a hard limit (the OOM killer fires inside the
  # job's memory cgroup and slurmd reports OUT_OF_MEMORY). ConstrainSwapSpace=no: the machine has
  # no swap. Cores and devices are not constrained: the node advertises more CPUs than it has,
  # and the fake GPUs are /dev/null clones.
  local cgroup_plugin=cgroup/v1
  [[ $CGROUP_MODE == v2 ]] && cgroup_plugin=cgroup/v2
  write_if_changed "$ETC/cgroup.conf" 644 "CgroupPlugin=$cgroup_plugin
CgroupAutomount=yes
ConstrainCores=no
ConstrainRAMSpace=yes
ConstrainSwapSpace=no
ConstrainDevices=no"

  # slurmdbd refuses to start unless its config is 0600 (gotcha 8).
  write_if_changed "$ETC/slurmdbd.conf" 600 "AuthType=auth/munge
DbdHost=localhost
DbdAddr=127.0.0.1
DbdPort=6819
SlurmUser=root
DebugLevel=info
LogFile=$LOG_DIR/slurmdbd.log
PidFile=${PIDFILE[slurmdbd]}
StorageType=accounting_storage/mysql
StorageHost=localhost
StoragePort=3306
StorageUser=$DB_USER
StoragePass=$DB_PASS
StorageLoc=$DB_NAME"

  say "config: $ETC (node $node, ${CPUS} CPUs, ${MEM_MB} MB, ${GPUS} GPUs, cgroup mode $CGROUP_MODE)"
}

# --------------------------------------------------------------------------------------------
# daemons
# --------------------------------------------------------------------------------------------
start_munged() {
  local pid
  if pid=$(daemon_pid munged); then
    say "munged: running (pid $pid)"
    return 0
  fi
  # Gotcha 2: /run is a tmpfs and nothing (no systemd-tmpfiles) recreates /run/munge.
  install -d -o munge -g munge -m 0755 /run/munge
  install -d -o munge -g munge -m 0700 /var/log/munge /var/lib/munge
  if [[ ! -s /etc/munge/munge.key ]]; then
    # Normally created by the package postinst; recreate it if someone removed it.
    mungekey --create --keyfile=/etc/munge/munge.key
    chown munge:munge /etc/munge/munge.key
    chmod 0400 /etc/munge/munge.key
    say "munged: created /etc/munge/munge.key"
  fi
  rm -f /run/munge/munged.pid
  runuser -u munge -- /usr/sbin/munged || die "munged failed to start (see /var/log/munge/munged.log)"
  wait_for 10 munge -n || die "munged does not answer (see /var/log/munge/munged.log)"
  say "munged: started (pid $(daemon_pid munged))"
}

mysql_ok() { mysqladmin --connect-timeout=2 ping; }

# MariaDB is usually installed and already running on this machine kind (started before us):
# reuse it, and never stop it in `down`. Install/start it only when it is absent.
ensure_mariadb() {
  if mysql_ok >/dev/null 2>&1; then
    say "mariadb: running (reused)"
  else
    pkg_installed mariadb-server || install_packages mariadb-server
    # Gotcha 2 again: /run/mysqld is missing after a reboot of the tmpfs.
    install -d -o mysql -g root -m 0755 /run/mysqld
    if [[ ! -d /var/lib/mysql/mysql ]]; then
      mariadb-install-db --user=mysql --datadir=/var/lib/mysql >/dev/null
      say "mariadb: initialised /var/lib/mysql"
    fi
    setsid /usr/sbin/mariadbd --user=mysql --pid-file=/run/mysqld/mysqld.pid \
      >>/var/log/mariadbd.log 2>&1 </dev/null &
    wait_for 30 mysql_ok || die "mariadbd did not start (see /var/log/mariadbd.log)"
    say "mariadb: started"
  fi
  # Root over the unix socket with an empty password (the Debian default). Idempotent.
  mysql -e "CREATE DATABASE IF NOT EXISTS $DB_NAME;
CREATE USER IF NOT EXISTS '$DB_USER'@'localhost' IDENTIFIED BY '$DB_PASS';
ALTER USER '$DB_USER'@'localhost' IDENTIFIED BY '$DB_PASS';
GRANT ALL ON $DB_NAME.* TO '$DB_USER'@'localhost';" \
    || die "cannot create the accounting database (is 'mysql' as root over the socket allowed?)"
  say "mariadb: database $DB_NAME and user $DB_USER ready"
}

start_slurmdbd() {
  local pid
  if pid=$(daemon_pid slurmdbd); then
    say "slurmdbd: running (pid $pid)"
    return 0
  fi
  /usr/sbin/slurmdbd || die "slurmdbd failed to start (see $LOG_DIR/slurmdbd.log)"
  wait_for 30 port_open 6819 \
    || die "slurmdbd does not listen on 6819 (see $LOG_DIR/slurmdbd.log)"
  say "slurmdbd: started (pid $(daemon_pid slurmdbd))"
}

# `sacctmgr -i add cluster` once (gotcha 8): slurmctld must find its cluster in slurmdbd.
ensure_cluster() {
  local clusters
  clusters=$(timeout 20 sacctmgr -n -P show cluster format=cluster 2>&1) \
    || die "sacctmgr cannot talk to slurmdbd: $clusters"
  if grep -qx "$CLUSTER" <<<"$clusters"; then
    say "accounting: cluster $CLUSTER registered"
    return 0
  fi
  timeout 20 sacctmgr -i add cluster "$CLUSTER" >/dev/null || die "sacctmgr add cluster $CLUSTER failed"
  say "accounting: cluster $CLUSTER added"
}

# The second test user, with an association under the `root` account: not needed while
# AccountingStorageEnforce is unset (as here), but a site-like setting of it would refuse the user's jobs.
ensure_other_user_association() {
  local found
  ensure_other_user "$OTHER_USER"
  found=$(timeout 20 sacctmgr -n -P show assoc where cluster="$CLUSTER" user="$OTHER_USER" format=user 2>&1) \
    || die "sacctmgr cannot list the associations: $found"
  if grep -qx "$OTHER_USER" <<<"$found"; then
    say "accounting: user $OTHER_USER has an association"
    return 0
  fi
  timeout 20 sacctmgr -i add user "$OTHER_USER" account=root cluster="$CLUSTER" >/dev/null \
    || die "sacctmgr add user $OTHER_USER failed"
  say "accounting: user $OTHER_USER added (account root)"
}

ctld_up() { scontrol ping 2>/dev/null | grep -q 'is UP'; }

start_slurmctld() {
  local pid
  if pid=$(daemon_pid slurmctld); then
    say "slurmctld: running (pid $pid)"
    return 0
  fi
  /usr/sbin/slurmctld || die "slurmctld failed to start (see $LOG_DIR/slurmctld.log)"
  wait_for 30 ctld_up || die "slurmctld does not answer 'scontrol ping' (see $LOG_DIR/slurmctld.log)"
  say "slurmctld: started (pid $(daemon_pid slurmctld))"
}

start_slurmd() {
  local pid
  if pid=$(daemon_pid slurmd); then
    say "slurmd: running (pid $pid)"
    return 0
  fi
  /usr/sbin/slurmd || die "slurmd failed to start (see $LOG_DIR/slurmd.log)"
  wait_for 10 daemon_pid slurmd || die "slurmd died at start (see $LOG_DIR/slurmd.log)"
  say "slurmd: started (pid $(daemon_pid slurmd))"
}

# Gotcha 10: after a slurmctld (re)start the node shows `idle` from saved state, but jobs only
# start ~3 s later. A real one-task job is the only reliable readiness check.
probe() {
  local out
  if ! out=$(timeout "$PROBE_S" srun -Q -t 1 -J hpc-dev-probe true 2>&1); then
    die "readiness probe 'srun -t 1 true' failed within ${PROBE_S}s: ${out:-timeout}
       see $LOG_DIR/slurmctld.log and $LOG_DIR/slurmd.log; 'sinfo -R' says: $(sinfo -h -R 2>&1 | head -3)"
  fi
  say "probe: srun -t 1 true OK"
}

# --------------------------------------------------------------------------------------------
# commands
# --------------------------------------------------------------------------------------------
check_knobs() {
  local v
  for v in CPUS MEM_MB GPUS PROBE_S; do
    [[ ${!v} =~ ^[0-9]+$ ]] || die "HPC_DEV_SLURM_$v must be a non-negative integer (got '${!v}')"
  done
  ((CPUS > 0)) || die "HPC_DEV_SLURM_CPUS must be > 0"
  [[ -n $DEF_MEM_PER_CPU ]] || DEF_MEM_PER_CPU=$((MEM_MB / CPUS))
  [[ $DEF_MEM_PER_CPU =~ ^[0-9]+$ ]] \
    || die "HPC_DEV_SLURM_DEF_MEM_PER_CPU must be a non-negative integer (got '$DEF_MEM_PER_CPU')"
  ((MEM_MB > 0 && DEF_MEM_PER_CPU > 0)) || die "HPC_DEV_SLURM_MEM_MB and HPC_DEV_SLURM_DEF_MEM_PER_CPU must be > 0"
  [[ $CGROUP_MODE_WANTED =~ ^(auto|v1|v2|none)$ ]] \
    || die "HPC_DEV_SLURM_CGROUP must be auto, v1, v2 or none (got '$CGROUP_MODE_WANTED')"
  [[ $CLUSTER =~ ^[a-z0-9_]+$ ]] || die "HPC_DEV_SLURM_CLUSTER must match [a-z0-9_]+ (got '$CLUSTER')"
  [[ $DB_PASS =~ ^[A-Za-z0-9_.-]+$ ]] || die "HPC_DEV_SLURM_DB_PASS must match [A-Za-z0-9_.-]+ (it goes into SQL)"
}

cmd_up() {
  [[ $EUID -eq 0 ]] || die "must run as root"
  check_knobs
  install_packages "${PACKAGES[@]}"
  write_configs
  if ((CONFIG_CHANGED)); then
    # Gotcha 9: restart every slurm daemon when a config file changed (munged is unaffected).
    local any=0 d
    for d in slurmd slurmctld slurmdbd; do daemon_pid "$d" >/dev/null && any=1; done
    if ((any)); then
      say "config changed: restarting the slurm daemons"
      stop_daemon slurmd 20
      stop_daemon slurmctld 20
      stop_daemon slurmdbd 20
    fi
  fi
  start_munged
  ensure_mariadb
  start_slurmdbd
  ensure_cluster
  ensure_other_user_association
  start_slurmctld
  start_slurmd
  probe
  say "up: cluster $CLUSTER ready"
}

cmd_down() {
  # Reverse start order. MariaDB is never stopped: it usually ran before us and other
  # things may use it.
  stop_daemon slurmd 20
  stop_daemon slurmctld 20
  stop_daemon slurmdbd 20
  stop_daemon munged 20
  say "down: done (mariadb left running)"
}

cmd_status() {
  local d pid rc=0
  for d in munged slurmdbd slurmctld slurmd; do
    if pid=$(daemon_pid "$d"); then
      printf '%-10s running (pid %s)\n' "$d" "$pid"
    else
      printf '%-10s NOT running\n' "$d"
      rc=1
    fi
  done
  if mysql_ok >/dev/null 2>&1; then
    printf '%-10s running\n' mariadb
  else
    printf '%-10s NOT running\n' mariadb
    rc=1
  fi
  if daemon_pid slurmctld >/dev/null; then
    timeout 10 sinfo || rc=1
  fi
  exit "$rc" # exit, not return: a failing return would fire the ERR trap
}

main() {
  case "${1:-}" in
    up) cmd_up ;;
    down) cmd_down ;;
    status) cmd_status ;;
    stop)
      [[ ${2:-} =~ ^(slurmctld|slurmdbd|slurmd)$ ]] || die "usage: bash $0 stop slurmctld|slurmdbd|slurmd"
      stop_daemon "$2" 20
      ;;
    *)
      echo "usage: bash $0 up|down|status|stop NAME" >&2
      exit 2
      ;;
  esac
}

main "$@"
