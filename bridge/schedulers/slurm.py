"""Slurm: sbatch / squeue / sacct / scancel.

Only our jobs: squeue, sacct and scancel always carry ``--user=USER`` (the bridge's own user), and a
cluster chosen in ``HPC_SCHEDULER_ARGS`` (``-M NAME``) reaches every command, not only sbatch.
"""

from __future__ import annotations

import signal
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from bridge.errors import SchedulerUnavailable
from bridge.schedulers.base import (
    CONTINUE_BY,
    NEEDED,
    JobInfo,
    JobSpec,
    JobState,
    Scheduler,
    SiteOption,
    directive_value,
    format_duration,
    one_line,
    plain_job_id,
    scrubbed_environment,
)

# Slurm's state names (squeue %T and sacct State) -> JobState.
STATE_TABLE: dict[str, JobState] = {
    "PENDING": JobState.PENDING,
    "CONFIGURING": JobState.PENDING,
    "REQUEUE_HOLD": JobState.PENDING,
    "REQUEUE_FED": JobState.PENDING,
    "RESV_DEL_HOLD": JobState.PENDING,
    "RUNNING": JobState.RUNNING,
    "COMPLETING": JobState.RUNNING,  # still cleaning up: the outcome is not known yet
    "STAGE_OUT": JobState.RUNNING,
    "SIGNALING": JobState.RUNNING,
    "RESIZING": JobState.RUNNING,
    "SUSPENDED": JobState.SUSPENDED,
    "STOPPED": JobState.SUSPENDED,
    "REQUEUED": JobState.REQUEUED,
    "COMPLETED": JobState.COMPLETED,
    "FAILED": JobState.FAILED,
    "SPECIAL_EXIT": JobState.FAILED,
    "CANCELLED": JobState.CANCELLED,
    "REVOKED": JobState.CANCELLED,
    "TIMEOUT": JobState.TIMEOUT,
    "OUT_OF_MEMORY": JobState.OUT_OF_MEMORY,
    "NODE_FAIL": JobState.NODE_FAIL,
    "PREEMPTED": JobState.PREEMPTED,
    "BOOT_FAIL": JobState.BOOT_FAIL,
    "DEADLINE": JobState.DEADLINE,
}

# sbatch messages that no retry can fix; anything else is treated as transient (bounded).
PERMANENT_SUBMIT_ERRORS = (
    "Memory specification can not be satisfied",
    "Requested node configuration is not available",
    "Invalid generic resource",
    "Invalid gres specification",
    "More processors requested than permitted",
    "Invalid account",
    "Invalid partition",
    "Invalid qos",
    "Requested time limit is invalid",
    "Job violates accounting/QOS policy",
    "Requested partition configuration not available",
    "unrecognized option",
    "invalid option",
)


#: sbatch's input variables named SLURM_* (``man sbatch``): kept when a job submits its successor.
SBATCH_INPUT_VARIABLES = frozenset(
    {"SLURM_CLUSTERS", "SLURM_CONF", "SLURM_DEBUG_FLAGS", "SLURM_EXIT_ERROR", "SLURM_HINT", "SLURM_UMASK"}
)


def successor_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """``environ`` without the ``SLURM_*`` variables that describe the job it is read in.

    sbatch exports the submitting environment to the new job, where Slurm sets its own variables
    again, but not those a plugin sets for some jobs only (``SLURM_TMPDIR``) or that the new job
    has no reason to have (``SLURM_RESTART_COUNT``). sbatch's own input variables (``SLURM_CONF``:
    a configless node's configuration) stay.
    """
    return {k: v for k, v in environ.items() if not k.startswith("SLURM_") or k in SBATCH_INPUT_VARIABLES}


# sbatch's refusal when a submit limit is reached names the limit on the line before "Batch job submission
# failed: Job violates accounting/QOS policy (job submit limit, ...)": QOSMaxSubmitJobPerUserLimit,
# QOSMaxSubmitJobPerAccountLimit, AssocMaxSubmitJobLimit, AssocGrpSubmitJobsLimit, QOSGrpSubmitJobsLimit.
# The same policy line without such a name is a size or time limit: permanent.
SUBMIT_LIMIT_ERRORS = ("MaxSubmitJob", "GrpSubmitJob")

# Options the bridge sets itself, or that a setting of its own controls (long name -> why a site
# directive may not set it). sbatch also takes any unambiguous abbreviation of a long option.
RESERVED_OPTIONS: dict[str, str] = {
    **dict.fromkeys(("job-name", "comment"), "the bridge names each job after its request (and finds it by name)"),
    **dict.fromkeys(
        ("output", "error", "open-mode"), "the job's log goes to its spool directory, where the bridge reads it"
    ),
    **dict.fromkeys(
        ("requeue", "no-requeue", "signal", "dependency"),
        "the bridge continues jobs itself (HPC_WARN_SECONDS, HPC_SLURM_CONTINUE)",
    ),
    "time": "the time limit is the request's 'Maximum time (D-HH:MM)'",
    **dict.fromkeys(("mem", "mem-per-cpu", "mem-per-gpu"), "the memory is the request's 'Maximum memory (MB)'"),
    **dict.fromkeys(("cpus-per-task", "ntasks", "nodes"), "a job is one task on one node with the request's 'CPUs'"),
    **dict.fromkeys(("gres", "gpus"), "GPUs are requested by HPC_GPU_RULES"),
    "account": "set HPC_SLURM_ACCOUNT instead",
    "partition": "set HPC_SLURM_PARTITION instead",
    "qos": "set HPC_SLURM_QOS instead",
    **dict.fromkeys(("mail-user", "mail-type"), "mail goes to the request's notification address"),
    "chdir": "the job runs in its spool directory",
    "array": "the bridge submits one job per request",
    "hold": "a held job would never start",
    "wrap": "the job's script is the bridge's",
    **dict.fromkeys(("wait", "test-only"), "sbatch must return the new job's id at once"),
    **dict.fromkeys(("clusters", "cluster"), "every command needs the cluster: set HPC_SCHEDULER_ARGS=-M NAME"),
}
SHORT_OPTIONS = {
    "J": "job-name",
    "o": "output",
    "e": "error",
    "d": "dependency",
    "t": "time",
    "c": "cpus-per-task",
    "n": "ntasks",
    "N": "nodes",
    "G": "gpus",
    "A": "account",
    "p": "partition",
    "q": "qos",
    "D": "chdir",
    "a": "array",
    "H": "hold",
    "W": "wait",
    "M": "clusters",
}
# sbatch's one-letter options that take no value (so more letters may follow in the same word).
SHORT_FLAGS = frozenset("hHkOQsuvVW")
# Reserved options that only a directive must not set: on sbatch's command line (HPC_SCHEDULER_ARGS)
# they are where they belong (the cluster: every command gets it) or a site's choice (a held job).
COMMAND_LINE_OPTIONS = frozenset({"hold", "clusters", "cluster"})

# The options of the bridge's own directives (as HPC_SLURM_OMIT names them) -> why a site cannot leave
# one out ("": it can, e.g. where memory comes with the GPUs or mail is not allowed).
OWN_OPTIONS: dict[str, str] = {
    "--job-name": NEEDED + "it finds its jobs by name",
    "--comment": "",
    "--time": NEEDED + "the job is told its time limit and warned before it",
    "--mem": "",
    "--nodes": "",
    "--ntasks": "",
    "--cpus-per-task": "",
    "--output": NEEDED + "it reads each job's log in the job's spool directory",
    "--open-mode": NEEDED + "a requeued job appends to its log instead of overwriting it",
    "--requeue": "set HPC_SLURM_CONTINUE=successor instead (jobs continue without requeueing)",
    "--signal": NEEDED + "it is the warning before the time limit, at which a job checkpoints and continues",
    "--dependency": NEEDED + "a successor job waits for the one before it",
    "--gres": "set HPC_GPU_RULES=none instead (no GPUs)",
    "--account": "leave HPC_SLURM_ACCOUNT empty instead",
    "--partition": "leave HPC_SLURM_PARTITION empty instead",
    "--qos": "leave HPC_SLURM_QOS empty instead",
    "--mail-user": "",
    "--mail-type": "",
}


def translate(native: str) -> JobState:
    """``CANCELLED by 0`` -> CANCELLED; unknown words are not guessed at."""
    word = native.split()[0].rstrip("+") if native.strip() else ""
    return STATE_TABLE.get(word, JobState.MISSING)


def slurm_cluster_args(scheduler_args: Sequence[str]) -> tuple[str, ...]:
    """The cluster selection in sbatch's extra arguments, as ``--clusters=NAME`` options.

    ``-M NAME``, ``-MNAME``, ``--clusters=NAME``, ``--clusters NAME``, ``--cluster=NAME`` and
    ``--cluster NAME`` are recognised (sbatch takes them all); everything else is left out. A job
    submitted to another cluster is only seen by squeue, sacct, scancel and scontrol given the same.
    """
    found: list[str] = []
    args = list(scheduler_args)
    i = 0
    while i < len(args):
        arg = args[i]
        value: str | None = None
        if arg in ("-M", "--clusters", "--cluster"):
            if i + 1 < len(args):
                value = args[i + 1]
                i += 1
        elif arg.startswith("-M") and not arg.startswith("--"):
            value = arg[2:]
        elif arg.startswith(("--clusters=", "--cluster=")):
            value = arg.partition("=")[2]
        if value:
            found.append(f"--clusters={value}")
        i += 1
    return tuple(found)


class SlurmScheduler(Scheduler):
    """Slurm. ``cluster_args`` (from :func:`slurm_cluster_args`) go to every command but sbatch,
    which gets them with the rest of ``JobSpec.extra_args``."""

    name = "slurm"
    display_name = "Slurm"
    short_name = "slurm"
    commands = ("sbatch", "squeue", "sacct", "scancel", "scontrol")
    setting_prefix = "HPC_SLURM_"
    site_options = (
        SiteOption("HPC_SLURM_ACCOUNT", private_as="<account>"),
        SiteOption("HPC_SLURM_PARTITION", private_as="<partition>"),
        SiteOption("HPC_SLURM_QOS", keyword="qos"),  # --qos=NAME ("": none)
        SiteOption("HPC_SLURM_CONTINUE", default="requeue", choices=CONTINUE_BY),
        SiteOption("HPC_SLURM_OMIT", keyword="omit"),  # the bridge's own options a site forbids (OWN_OPTIONS)
    )
    account_setting = "HPC_SLURM_ACCOUNT"
    partition_setting = "HPC_SLURM_PARTITION"
    continue_setting = "HPC_SLURM_CONTINUE"  # requeue (the same job id runs again) or successor
    omit_setting = "HPC_SLURM_OMIT"
    warning_signal = signal.SIGUSR1  # --signal=B:USR1@warn_seconds
    scratch_variables = ("SLURM_TMPDIR",)  # set by some sites' plugins (node-local disk)
    restart_variables = ("SLURM_RESTART_COUNT",)
    controller = "slurmctld"
    commands_hint = ", or set HPC_SCHEDULER=gridengine"
    accounting_command = "sacct"
    accounting_fix = (
        "Slurm needs accounting through slurmdbd (AccountingStorageType=accounting_storage/slurmdbd in "
        "slurm.conf, slurmdbd running and reachable from this node); ask your site's administrators"
    )
    template_name = "slurm.sh"
    directive_prefix = "#SBATCH"
    job_id_variable = "SLURM_JOB_ID"
    log_name = "job-%j.out"
    log_name_id = "%j"
    permanent_submit_errors = PERMANENT_SUBMIT_ERRORS
    submit_limit_errors = SUBMIT_LIMIT_ERRORS

    def __init__(
        self,
        *,
        timeout_s: float = 60.0,
        user: str | None = None,
        cluster_args: Sequence[str] = (),
        qos: str = "",
        omit: str = "",
    ) -> None:
        super().__init__(timeout_s=timeout_s, user=user)
        self.cluster_args = tuple(cluster_args)
        self.qos = directive_value("HPC_SLURM_QOS", qos) if qos else ""
        self.omit = self.checked_omit(omit)

    @classmethod
    def translate(cls, native: str) -> JobState:
        return translate(native)

    @classmethod
    def lookup_options(cls, scheduler_args: Sequence[str]) -> dict[str, Any]:
        return {"cluster_args": slurm_cluster_args(scheduler_args)}

    def directives(self, spec: JobSpec) -> list[str]:
        d = [
            f"--job-name={directive_value('job name', spec.name)}",
            f"--comment={directive_value('comment', spec.comment)}",
            f"--time={format_duration(spec.time_minutes)}",
            f"--mem={int(spec.memory_mb)}M",
            "--nodes=1",
            "--ntasks=1",
            f"--cpus-per-task={int(spec.cpus)}",
            f"--output={self.log_path(spec)}",
            "--open-mode=append",  # a requeued job appends to the same file
        ]
        if spec.continue_by not in CONTINUE_BY:
            raise ValueError(f"refusing unsafe value for continue_by: {spec.continue_by!r}")
        if spec.warn_seconds:  # a successor needs no --requeue (sites that forbid it)
            d += ["--requeue"] if spec.continue_by == "requeue" else []
            d.append(f"--signal=B:USR1@{int(spec.warn_seconds)}")
        if spec.hold_after:
            d.append(f"--dependency=afterany:{directive_value('job id', spec.hold_after)}")
        if spec.gres:
            d.append(f"--gres={directive_value('gres', spec.gres)}")
        if spec.account:
            d.append(f"--account={directive_value('account', spec.account)}")
        if spec.partition:
            d.append(f"--partition={directive_value('partition', spec.partition)}")
        if self.qos:
            d.append(f"--qos={self.qos}")
        if spec.email:
            d += [f"--mail-user={directive_value('e-mail', spec.email)}", "--mail-type=END,FAIL"]
        return d

    def own_options(self) -> dict[str, str]:
        return dict(OWN_OPTIONS)

    def reserved_in(self, words: Sequence[str], *, command_line: bool = False) -> list[tuple[str, str]]:
        """``--constraint v100``, ``-C v100``, ``--nice=10``: fine; ``--time=...``, ``-t 5``, ``--out=x``
        (an abbreviation of --output), ``-kH`` (flags run together): the bridge's own (see
        :data:`RESERVED_OPTIONS`), but ``--hold``/``-H`` and ``-M NAME``/``--clusters=NAME`` on the
        command line (:data:`COMMAND_LINE_OPTIONS`). Every word is looked at: sbatch reads them all."""
        found = []
        for word in words:
            if word.startswith("--") and len(word) > 2:
                name = word[2:].split("=", 1)[0]
                for reserved, why in RESERVED_OPTIONS.items():
                    if reserved.startswith(name):
                        if not (command_line and reserved in COMMAND_LINE_OPTIONS):
                            found.append((word, self.set_by_bridge(f"--{reserved}", why, f"--{reserved}")))
                        break
            elif word.startswith("-"):
                for letter in word[1:]:
                    long_name = SHORT_OPTIONS.get(letter, "")
                    if long_name and not (command_line and long_name in COMMAND_LINE_OPTIONS):
                        why = RESERVED_OPTIONS[long_name]
                        found.append((word, self.set_by_bridge(f"-{letter} (--{long_name})", why, f"--{long_name}")))
                        break
                    if letter not in SHORT_FLAGS:
                        break  # the rest of the word is this option's value
        return found

    def submit_command(self, script: Path, spec: JobSpec) -> list[str]:
        return ["sbatch", "--parsable", *spec.extra_args, str(script)]

    def submit(self, script: Path, spec: JobSpec, *, env: Mapping[str, str] | None = None) -> str:
        result = self._submit_command(self.submit_command(script, spec), env=env)
        job_id = plain_job_id(result.stdout.strip().split(";")[0])  # with -M: "ID;CLUSTER"
        if not job_id:
            raise SchedulerUnavailable(f"sbatch printed no job id: {result.stdout[:200]!r}")
        return job_id

    def _command(self, command: str, *args: str, mine: bool = True) -> list[str]:
        """``command`` with the cluster selection and (``mine``) ``--user=USER``, then ``args``."""
        return [command, *self.cluster_args, *([f"--user={self.user}"] if mine else []), *args]

    def query(self, job_ids: Sequence[str]) -> Mapping[str, JobInfo]:
        ids = sorted({plain_job_id(j) for j in job_ids} - {""}, key=int)  # anything else is never ours
        if not ids:
            return {}
        found: dict[str, JobInfo] = {}
        # Live state first: squeue knows running jobs and recently finished ones (MinJobAge).
        live = self._run(self._command("squeue", "-h", "-t", "all", "-j", ",".join(ids), "-o", "%i|%T|%r"), check=False)
        if live.returncode == 0:
            for line in live.stdout.splitlines():
                jid, _, rest = line.strip().partition("|")
                native, _, why = rest.partition("|")
                jid = plain_job_id(jid)
                if jid not in ids:
                    continue
                state = translate(native)
                reason = one_line(why) if state is JobState.PENDING and why.strip() != "None" else ""
                found[jid] = JobInfo(jid, state, native.strip(), source="queue", reason=reason)
        elif "Invalid job id" not in live.stderr:
            raise SchedulerUnavailable(f"squeue failed: {self.clean(live.stderr)}")
        # Accounting for finished or forgotten jobs (and exit codes of finished ones).
        ask = [j for j in ids if j not in found or found[j].state.is_terminal]
        if ask:
            acct = self._run(
                self._command(
                    "sacct", "-n", "-X", "-P", "-j", ",".join(ask), "-o", "JobID,JobIDRaw,State,ExitCode,Elapsed"
                ),
                check=False,
            )
            # Accounting unreachable (slurmdbd down): a job that has left the queue is unknown, not
            # missing. Absent from the result it would start the missing clock, and be judged
            # "vanished" after HPC_MISSING_TIMEOUT when only accounting was down.
            if acct.returncode != 0 and any(j not in found for j in ids):
                raise SchedulerUnavailable(f"sacct failed: {self.clean(acct.stderr)}")
            for line in acct.stdout.splitlines():
                parts = line.strip().split("|")
                if len(parts) < 5:
                    continue
                shown, jid, native, exit_code, elapsed = parts[:5]
                if plain_job_id(shown) != jid or jid not in ask:  # array tasks, het parts: not ours
                    continue
                state = translate(native)
                live_info = found.get(jid)
                if live_info is None or state.is_terminal:
                    found[jid] = JobInfo(jid, state, native, exit_code, elapsed, source="accounting")
        return found

    def find_by_name(self, name: str) -> list[str]:
        name = directive_value("job name", name)
        if "," in name:  # squeue and sacct would read a list of names
            raise ValueError(f"refusing unsafe value for job name: {name!r}")
        ids: set[str] = set()
        live = self._run(self._command("squeue", "-h", "-t", "all", "--name", name, "-o", "%i"), check=False)
        if live.returncode != 0:
            raise SchedulerUnavailable(f"squeue failed: {self.clean(live.stderr)}")
        ids.update(plain_job_id(line) for line in live.stdout.splitlines())  # 123_[0-1], 123_4: arrays, not ours
        acct = self._run(
            self._command("sacct", "-n", "-X", "-P", "--name", name, "-S", "now-30days", "-o", "JobID,JobIDRaw"),
            check=False,
        )
        if acct.returncode == 0:
            for line in acct.stdout.splitlines():
                shown, _, raw = line.strip().partition("|")
                if plain_job_id(shown) == raw.strip():
                    ids.add(plain_job_id(shown))
        ids.discard("")
        return sorted(ids, key=int)

    def clean(self, message: str) -> str:
        return super().clean("\n".join(line.strip().removeprefix("sbatch: error: ") for line in message.splitlines()))

    def continue_job(self, job_id: str, script: Path, spec: JobSpec) -> str:
        """``scontrol requeue``: the same job id runs again (``SLURM_RESTART_COUNT`` counts).
        Called from inside the job, this ends the calling job's current run.

        With ``spec.continue_by == "successor"`` (sites that strip ``--requeue`` or forbid
        ``scontrol requeue``): a new job held on this one (``--dependency=afterany:ID``), submitted
        without this job's own ``SLURM_*`` variables (:func:`successor_environment`), so that it
        starts as the first job did; this job then ends by itself.
        """
        if spec.continue_by == "successor":
            path, successor = self.write_successor(job_id, script, spec)
            return self.submit(path, successor, env=successor_environment(scrubbed_environment()))
        result = self._run(self._command("scontrol", "requeue", job_id, mine=False), check=False)
        if result.returncode != 0:
            raise SchedulerUnavailable(f"scontrol requeue {job_id} failed: {self.clean(result.stderr)}")
        return job_id

    def continues_by(self, spec: JobSpec) -> str:
        return spec.continue_by

    def cancel(self, job_id: str) -> None:
        """scancel, only for a job of ours that has not ended: root's scancel would cancel anyone's.

        ``scancel --user=USER ID`` also leaves another user's job alone (exit 0), and exits 1 without a
        word when no active job of ours has that id: checked with squeue first and again after.
        """
        if not plain_job_id(job_id):
            raise ValueError(f"refusing unsafe value for job id: {job_id!r}")
        if not self._ours_and_active(job_id):
            return
        result = self._run(self._command("scancel", job_id), check=False)
        if result.returncode != 0 and self._ours_and_active(job_id):
            raise SchedulerUnavailable(f"scancel failed: {self.clean(result.stderr) or f'exit {result.returncode}'}")

    def _ours_and_active(self, job_id: str) -> bool:
        """Whether squeue lists job ``job_id`` as ours and not yet ended."""
        live = self._run(self._command("squeue", "-h", "-t", "all", "-j", job_id, "-o", "%i|%T"), check=False)
        if live.returncode != 0:
            if "Invalid job id" in live.stderr:
                return False
            raise SchedulerUnavailable(f"squeue failed: {self.clean(live.stderr)}")
        for line in live.stdout.splitlines():
            jid, _, native = line.strip().partition("|")
            if plain_job_id(jid) == job_id and not translate(native).is_terminal:
                return True
        return False

    def ping(self) -> str:
        result = self._run(self._command("scontrol", "ping", mine=False), check=False)
        if result.returncode != 0 or "DOWN" in result.stdout:
            raise SchedulerUnavailable(f"slurmctld: {self.clean(result.stdout + result.stderr)}")
        return result.stdout.strip()

    def check_accounting(self) -> str:
        """Whether sacct answers (slurmdbd reachable, accounting enabled); raises SchedulerUnavailable.

        Without accounting a job that has left squeue (MinJobAge after it ended) cannot be judged:
        :meth:`query` raises, and reconciliation waits for as long as sacct fails.
        """
        result = self._run(self._command("sacct", "-n", "-X", "-P", "-j", "1", "-o", "JobIDRaw"), check=False)
        output = result.stdout + result.stderr
        if result.returncode != 0 or "accounting storage is disabled" in output.lower():
            raise SchedulerUnavailable(f"sacct: {self.clean(output) or f'exit {result.returncode}'}")
        return "sacct answers"
