"""Slurm: sbatch / squeue / sacct / scancel."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from bridge.errors import SchedulerUnavailable
from bridge.protocol import format_duration
from bridge.schedulers.base import JobInfo, JobSpec, JobState, Scheduler, directive_value

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


def translate(native: str) -> JobState:
    """``CANCELLED by 0`` -> CANCELLED; unknown words are not guessed at."""
    word = native.split()[0].rstrip("+") if native.strip() else ""
    return STATE_TABLE.get(word, JobState.MISSING)


class SlurmScheduler(Scheduler):
    name = "slurm"
    display_name = "Slurm"
    template_name = "slurm.sh"
    directive_prefix = "#SBATCH"
    job_id_variable = "SLURM_JOB_ID"
    log_name = "job-%j.out"
    log_name_id = "%j"
    permanent_submit_errors = PERMANENT_SUBMIT_ERRORS

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
        if spec.warn_seconds:
            d += ["--requeue", f"--signal=B:USR1@{int(spec.warn_seconds)}"]
        if spec.hold_after:
            d.append(f"--dependency=afterany:{directive_value('job id', spec.hold_after)}")
        if spec.gres:
            d.append(f"--gres={directive_value('gres', spec.gres)}")
        if spec.account:
            d.append(f"--account={directive_value('account', spec.account)}")
        if spec.partition:
            d.append(f"--partition={directive_value('partition', spec.partition)}")
        if spec.email:
            d += [f"--mail-user={directive_value('e-mail', spec.email)}", "--mail-type=END,FAIL"]
        return d

    def submit(self, script: Path, spec: JobSpec) -> str:
        result = self._submit_command(["sbatch", "--parsable", *spec.extra_args, str(script)])
        job_id = result.stdout.strip().split(";")[0]
        if not job_id.isdigit():
            raise SchedulerUnavailable(f"sbatch printed no job id: {result.stdout!r}")
        return job_id

    def query(self, job_ids: Sequence[str]) -> Mapping[str, JobInfo]:
        if not job_ids:
            return {}
        found: dict[str, JobInfo] = {}
        # Live state first: squeue knows running jobs and recently finished ones (MinJobAge).
        live = self._run(["squeue", "-h", "-t", "all", "-j", ",".join(job_ids), "-o", "%i|%T"], check=False)
        if live.returncode == 0:
            for line in live.stdout.splitlines():
                jid, _, native = line.strip().partition("|")
                if jid in job_ids:
                    found[jid] = JobInfo(jid, translate(native), native, source="queue")
        elif "Invalid job id" not in live.stderr:
            raise SchedulerUnavailable(f"squeue failed: {self.clean(live.stderr)}")
        # Accounting for finished or forgotten jobs (and exit codes of finished ones).
        ask = [j for j in job_ids if j not in found or found[j].state.is_terminal]
        if ask:
            acct = self._run(
                ["sacct", "-n", "-X", "-P", "-j", ",".join(ask), "-o", "JobIDRaw,State,ExitCode,Elapsed"],
                check=False,
            )
            # Accounting unreachable (slurmdbd down): a job that has left the queue is unknown, not
            # missing. Absent from the result it would start the missing clock, and be judged
            # "vanished" after HPC_MISSING_TIMEOUT when only accounting was down.
            if acct.returncode != 0 and any(j not in found for j in job_ids):
                raise SchedulerUnavailable(f"sacct failed: {self.clean(acct.stderr)}")
            for line in acct.stdout.splitlines():
                parts = line.strip().split("|")
                if len(parts) < 4 or parts[0] not in ask:
                    continue
                jid, native, exit_code, elapsed = parts[:4]
                state = translate(native)
                live_info = found.get(jid)
                if live_info is None or state.is_terminal:
                    found[jid] = JobInfo(jid, state, native, exit_code, elapsed, source="accounting")
        return found

    def find_by_name(self, name: str) -> list[str]:
        ids: set[str] = set()
        live = self._run(["squeue", "-h", "-t", "all", "--name", name, "-o", "%i"], check=False)
        if live.returncode != 0:
            raise SchedulerUnavailable(f"squeue failed: {self.clean(live.stderr)}")
        ids.update(line.strip() for line in live.stdout.splitlines() if line.strip())
        acct = self._run(["sacct", "-n", "-X", "-P", "--name", name, "-S", "now-30days", "-o", "JobIDRaw"], check=False)
        if acct.returncode == 0:
            ids.update(line.strip() for line in acct.stdout.splitlines() if line.strip())
        return sorted(ids, key=int)

    def clean(self, message: str) -> str:
        return super().clean("\n".join(line.strip().removeprefix("sbatch: error: ") for line in message.splitlines()))

    def continue_job(self, job_id: str, script: Path, spec: JobSpec) -> str:
        """``scontrol requeue``: the same job id runs again (``SLURM_RESTART_COUNT`` counts).

        Called from inside the job, this ends the calling job's current run.
        """
        result = self._run(["scontrol", "requeue", job_id], check=False)
        if result.returncode != 0:
            raise SchedulerUnavailable(f"scontrol requeue {job_id} failed: {self.clean(result.stderr)}")
        return job_id

    def cancel(self, job_id: str) -> None:
        result = self._run(["scancel", job_id], check=False)
        if result.returncode != 0:
            raise SchedulerUnavailable(f"scancel failed: {self.clean(result.stderr)}")

    def ping(self) -> str:
        result = self._run(["scontrol", "ping"], check=False)
        if result.returncode != 0 or "DOWN" in result.stdout:
            raise SchedulerUnavailable(f"slurmctld: {self.clean(result.stdout + result.stderr)}")
        return result.stdout.strip()
