"""Grid Engine (SGE 8.1 / Son of Grid Engine): qsub / qstat / qacct / qdel.

Only our jobs: qstat lists ``-u USER`` (and each job's ``JB_owner`` is checked), qacct reads
``-o USER`` records (and each record's ``owner`` is checked), and qdel is only given a job that
qstat lists as ours: root is a Grid Engine manager, whose qdel would delete anyone's job.
Array jobs (``tasks``) are never ours: the bridge submits none.

Measured behaviour this module relies on: ``docs/dev-clusters.md`` (Grid Engine).
"""

from __future__ import annotations

import re
import signal
import xml.etree.ElementTree as ET  # parses only qstat's own output
from collections.abc import Mapping, Sequence
from pathlib import Path

from bridge.errors import SchedulerUnavailable
from bridge.schedulers.base import (
    NEEDED,
    JobInfo,
    JobSpec,
    JobState,
    Scheduler,
    SiteOption,
    directive_value,
    one_line,
    plain_job_id,
)

# qstat's state letters -> JobState. Any other state that holds an "E" (Eqw, Ehqw, ...) is ERROR:
# the job is parked in an error state and never runs unless an operator clears it (qmod -cj).
STATE_TABLE: dict[str, JobState] = {
    "qw": JobState.PENDING,
    "hqw": JobState.PENDING,  # held (e.g. -hold_jid on a job that has not ended)
    "hRwq": JobState.PENDING,
    "t": JobState.RUNNING,  # being transferred to the execution host
    "r": JobState.RUNNING,
    "Rr": JobState.RUNNING,  # running again after a restart
    "Rt": JobState.RUNNING,
    "hr": JobState.RUNNING,  # qhold on a running job: it keeps running
    "s": JobState.SUSPENDED,
    "S": JobState.SUSPENDED,
    "T": JobState.SUSPENDED,
    "ss": JobState.SUSPENDED,
    "Rq": JobState.REQUEUED,  # rescheduled (exit 99, qmod -rj) and waiting to run again
    # Being deleted: the outcome is only known once accounting has the record.
    "dr": JobState.RUNNING,
    "dt": JobState.RUNNING,
    "dRr": JobState.RUNNING,
}

# qsub refusals that no retry can fix; anything else (qmaster unreachable, timeouts) is transient.
PERMANENT_SUBMIT_ERRORS = (
    "unknown resource",
    "no suitable queues",
    "not a valid object name",
    "not allowed in objectname",
    "must not contain",
    "job rejected",
    "Job was rejected",
    "denied:",
    "is not a time value",
    "is not a memory value",
    "invalid option",
    "unknown option",
)

# qsub's refusals when max_u_jobs / max_jobs (qconf -sconf) is reached: "job rejected: Only 2 jobs are
# allowed per user (current job count: 2)", "... allowed per cluster". Checked before "job rejected".
SUBMIT_LIMIT_ERRORS = ("jobs are allowed per user", "jobs are allowed per cluster")

# Options the bridge sets itself, or that a setting of its own controls (option -> why a site directive
# may not set it). qsub takes no abbreviations.
RESERVED_OPTIONS: dict[str, str] = {
    "-N": "the bridge names each job after its request (and finds it by name)",
    **dict.fromkeys(("-o", "-e", "-j"), "the job's log goes to its spool directory, where the bridge reads it"),
    **dict.fromkeys(("-wd", "-cwd"), "the job runs in its spool directory"),
    "-S": "the job's script is a bash script",
    **dict.fromkeys(
        ("-r", "-notify", "-hold_jid", "-hold_jid_ad"), "the bridge continues jobs itself (HPC_WARN_SECONDS)"
    ),
    "-w": "the bridge has impossible requests refused at submit (-w e)",
    "-pe": "CPUs use HPC_SGE_PE",
    "-P": "set HPC_SGE_PROJECT instead",
    "-q": "set HPC_SGE_QUEUE instead",
    **dict.fromkeys(("-M", "-m"), "mail goes to the request's notification address"),
    **dict.fromkeys(("-t", "-tc"), "the bridge submits one job per request"),
    "-h": "a held job would never start",
    "-b": "the job's script is the bridge's",
    **dict.fromkeys(("-sync", "-terse"), "qsub must return the new job's id at once"),
    "-now": "a job that cannot start at once would be refused instead of waiting",
    **dict.fromkeys(("-clear", "-C", "-@"), "it would change how the bridge's own directives are read"),
}
# Reserved options that only a directive must not set: on qsub's command line (HPC_SCHEDULER_ARGS) a held
# job is a site's choice.
COMMAND_LINE_OPTIONS = frozenset({"-h"})


# A Grid Engine object name: no leading digit, none of / : @ * or space, ASCII; no comma either
# (it would split a -hold_jid list) and nothing a shell or qacct's pattern matching reads specially.
_GE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.=%+-]*$")
_RESOURCE = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]*$")


def translate(native: str) -> JobState:
    """``qw`` -> PENDING, ``Eqw`` -> ERROR; unknown letters are not guessed at (MISSING)."""
    word = native.strip()
    if word in STATE_TABLE:
        return STATE_TABLE[word]
    return JobState.ERROR if "E" in word else JobState.MISSING


def ge_name(what: str, value: str) -> str:
    text = directive_value(what, value)
    if not _GE_NAME.match(text):
        raise ValueError(f"refusing unsafe value for {what}: {text!r}")
    return text


def parse_qacct(text: str) -> list[dict[str, str]]:
    """``qacct -j`` output -> one dict per record (key -> rest of the line), oldest first."""
    records: list[dict[str, str]] = []
    for line in text.splitlines():
        if line.startswith("====="):
            records.append({})
        elif records and line.strip():
            key, _, value = line.partition(" ")
            records[-1][key] = value.strip()
    return [r for r in records if r]


def accounting_info(job_id: str, record: Mapping[str, str]) -> JobInfo:
    """One qacct record -> JobInfo. ``failed`` says how Grid Engine ended the job, exit_status how it exited.

    * failed 0: COMPLETED for exit 0, else FAILED.
    * failed 37 (``qmaster enforced h_rt, h_cpu, or h_vmem limit``): TIMEOUT when the wall clock
      reached the job's h_rt (from ``category``), else OUT_OF_MEMORY (h_vmem).
    * failed 100 (``assumedly after job``) with exit 137: the job was SIGKILLed while running:
      qdel, but equally a ``kill -9`` or the kernel's OOM killer (accounting cannot tell them apart);
      CANCELLED, or TIMEOUT if it had run for its whole h_rt.
    * failed 25 (``rescheduling``): REQUEUED; another record follows once it runs again.
    * any other code (1-36: failed before or while starting, e.g. 26 output file, 28 working
      directory; 30 after ``exit 100``): FAILED.
    """
    code_text, _, reason = record.get("failed", "0").partition(":")
    code = int(code_text.strip()) if code_text.strip().isdigit() else -1
    exit_code = (record.get("exit_status", "").split() or [""])[0]
    wall = _seconds(record.get("ru_wallclock", ""))
    limit = _h_rt(record.get("category", ""))
    timed_out = limit is not None and wall is not None and wall >= limit
    native = f"failed {code}: {reason.strip()}" if code else f"exit {exit_code}"
    if code == 0:
        state = JobState.COMPLETED if exit_code == "0" else JobState.FAILED
    elif code == 37:
        state = JobState.TIMEOUT if timed_out else JobState.OUT_OF_MEMORY
    elif code == 100 and exit_code == "137":
        state = JobState.TIMEOUT if timed_out else JobState.CANCELLED
    elif code == 25:
        state = JobState.REQUEUED
    else:
        state = JobState.FAILED
    return JobInfo(job_id, state, native, exit_code, _elapsed(wall), source="accounting")


class GridEngineScheduler(Scheduler):
    """Grid Engine. ``pe`` is the parallel environment for multi-CPU jobs (allocation ``$pe_slots``),
    ``gpu_resource`` a consumable complex counting GPUs and ``memory_resource`` the memory request.

    Grid Engine multiplies a per-slot request by the slots (``-pe smp 6 -l gpu=1`` takes 6 GPUs of a
    ``YES`` consumable). Memory is therefore requested per slot (``memory_mb / cpus``, the usual
    convention for h_vmem / mem_free), and the GPU complex must be a per-job consumable
    (``gpu gpu INT <= YES JOB 0 0``) for multi-CPU GPU jobs.
    A request no host can ever satisfy (too many GPUs, too much memory) waits in ``qw`` for ever
    unless the job is submitted with ``-w e`` (``JobSpec.extra_args``), which refuses it at
    submit time (``no suitable queues`` -> SchedulerRejected).
    """

    name = "gridengine"
    aliases = ("sge", "grid engine")
    display_name = "Grid Engine"
    short_name = "sge"
    commands = ("qsub", "qstat", "qacct", "qdel")
    # The cell the commands talk to (its settings.sh sets them); cron and systemd must pass them on.
    command_environment = ("SGE_ROOT", "SGE_CELL", "SGE_QMASTER_PORT", "SGE_EXECD_PORT")
    setting_prefix = "HPC_SGE_"
    site_options = (
        SiteOption("HPC_SGE_PROJECT", private_as="<project>"),
        SiteOption("HPC_SGE_QUEUE", private_as="<queue>"),
        SiteOption("HPC_SGE_PE", default="smp", keyword="pe"),  # parallel environment for multi-CPU jobs
        SiteOption("HPC_SGE_GPU_RESOURCE", default="gpu", keyword="gpu_resource"),  # consumable counting GPUs
        # The complex that requests memory (h_vmem where sites enforce it).
        SiteOption("HPC_SGE_MEMORY_RESOURCE", default="mem_free", keyword="memory_resource"),
        SiteOption("HPC_SGE_OMIT", keyword="omit"),  # the bridge's own options a site forbids (own_options)
    )
    account_setting = "HPC_SGE_PROJECT"
    partition_setting = "HPC_SGE_QUEUE"
    omit_setting = "HPC_SGE_OMIT"
    warning_signal = signal.SIGUSR2  # -notify
    restart_variables = ("RESTARTED",)
    controller = "sge_qmaster"
    # Grid Engine's commands find the qmaster through the cell's settings (its settings.sh sets them).
    controller_hint = (
        ", and that SGE_ROOT, SGE_CELL and SGE_QMASTER_PORT are the cell's (source its settings.sh in "
        "the cron/systemd environment)"
    )
    accounting_command = "qacct"
    accounting_fix = "make the cell's accounting file readable here (qacct reads $SGE_ROOT/$SGE_CELL/common/accounting)"
    accounting_needs_controller = True  # qacct needs the same cell settings
    template_name = "gridengine.sh"
    directive_prefix = "#$"
    job_id_variable = "JOB_ID"
    log_name = "job-$JOB_ID.out"  # Grid Engine expands $JOB_ID in -o paths itself
    log_name_id = "$JOB_ID"
    permanent_submit_errors = PERMANENT_SUBMIT_ERRORS
    submit_limit_errors = SUBMIT_LIMIT_ERRORS

    def __init__(
        self,
        *,
        timeout_s: float = 60.0,
        user: str | None = None,
        pe: str = "smp",
        gpu_resource: str = "gpu",
        memory_resource: str = "mem_free",
        omit: str = "",
    ) -> None:
        super().__init__(timeout_s=timeout_s, user=user)
        settings = {"HPC_SGE_PE": pe, "HPC_SGE_GPU_RESOURCE": gpu_resource, "HPC_SGE_MEMORY_RESOURCE": memory_resource}
        for what, value in settings.items():
            if not _RESOURCE.match(directive_value(what, value)):
                raise ValueError(f"refusing unsafe value for {what}: {value!r}")
        self.pe, self.gpu_resource, self.memory_resource = pe, gpu_resource, memory_resource
        self.omit = self.checked_omit(omit)

    @classmethod
    def translate(cls, native: str) -> JobState:
        return translate(native)

    def directives(self, spec: JobSpec) -> list[str]:
        hours, minutes = divmod(int(spec.time_minutes), 60)
        d = [
            f"-N {ge_name('job name', spec.name)}",
            "-S /bin/bash",  # '#!' is ignored in the usual posix_compliant shell_start_mode
            f"-o {self.log_path(spec)}",
            "-j y",
            f"-wd {directive_value('working directory', spec.workdir)}",
            f"-l h_rt={hours}:{minutes:02d}:00",
            f"-l {self.memory_resource}={-(-int(spec.memory_mb) // max(int(spec.cpus), 1))}M",  # per slot
            # Not rerunnable: after a host crash Grid Engine would silently run the job again from the
            # start under the same id; the bridge counts continuations and decides itself (from the
            # checkpoint), so such a job must end in accounting instead.
            "-r n",
            # Refuse at submit a job that could never run, even on an empty cluster (more memory,
            # GPUs or slots than any host has), instead of leaving it waiting for ever.
            "-w e",
        ]
        if spec.cpus > 1:
            d.append(f"-pe {self.pe} {int(spec.cpus)}")
        if spec.gpus > 0:
            d.append(f"-l {self.gpu_resource}={spec.gpus}")
        if spec.account:
            d.append(f"-P {ge_name('project', spec.account)}")
        if spec.partition:
            d.append(f"-q {directive_value('queue', spec.partition)}")
        if spec.email:
            d += [f"-M {directive_value('e-mail', spec.email)}", "-m ea"]
        if spec.warn_seconds > 0:
            # SIGUSR2 'notify' seconds (a queue setting) before the SIGKILL at h_rt or after qdel. That is
            # not warn_seconds, so the worker also runs its own timer. (s_rt is not used: a job that
            # catches its SIGUSR1 is then never killed at h_rt in 8.1.9.)
            d.append("-notify")
        if spec.hold_after:
            d.append(f"-hold_jid {_job_id('hold job id', spec.hold_after)}")
        return d

    def directive_key(self, directive: str) -> str:
        """``-l mem_free=100M`` -> ``-l mem_free`` (a resource is named with its ``-l``), ``-pe smp 4`` -> ``-pe``."""
        words = directive.split()
        return f"-l {words[1].split('=', 1)[0]}" if words[0] == "-l" and len(words) > 1 else words[0]

    def own_options(self) -> dict[str, str]:
        """As HPC_SGE_OMIT names them: the memory request, ``-w`` (sites whose resource quotas make
        ``-w e`` refuse jobs that could run) and mail may be left out."""
        return {
            "-N": NEEDED + "it finds its jobs by name",
            "-S": NEEDED + "the job's script is a bash script",
            "-o": NEEDED + "it reads each job's log in the job's spool directory",
            "-j": NEEDED + "the job's errors go to the same log",
            "-wd": NEEDED + "the job runs in its spool directory",
            "-l h_rt": NEEDED + "the job is told its time limit and warned before it",
            f"-l {self.memory_resource}": "",
            "-r": NEEDED + "it decides itself whether a job runs again",
            "-w": "",
            "-pe": "the job's CPUs are slots of HPC_SGE_PE, and its memory is requested per slot",
            f"-l {self.gpu_resource}": "set HPC_GPU_RULES=none instead (no GPUs)",
            "-P": "leave HPC_SGE_PROJECT empty instead",
            "-q": "leave HPC_SGE_QUEUE empty instead",
            "-M": "",
            "-m": "",
            "-notify": NEEDED + "it is the warning before the time limit, at which a job checkpoints and continues",
            "-hold_jid": NEEDED + "a successor job waits for the one before it",
        }

    def reserved_in(self, words: Sequence[str], *, command_line: bool = False) -> list[tuple[str, str]]:
        """``-l h_vmem=4G``, ``-p -5``, ``-A lab``: fine; ``-N x``, ``-l h_rt=1:00:00``, ``-pe mpi 4``: the
        bridge's own (see :data:`RESERVED_OPTIONS`; for ``-l``, the time, memory and GPU resources),
        but ``-h`` on the command line (:data:`COMMAND_LINE_OPTIONS`). Every word is looked at: qsub
        reads them all."""
        memory = f"-l {self.memory_resource}"
        own = {"h_rt": ("the time limit is the request's 'Maximum time (D-HH:MM)'", "-l h_rt")}
        own["s_rt"] = own["h_rt"]
        own[self.memory_resource] = (
            "the memory is the request's 'Maximum memory (MB)' (HPC_SGE_MEMORY_RESOURCE)",
            memory,
        )
        if self.memory_resource == "mem_free":
            own["mf"] = own["mem_free"]  # its shortcut
        own[self.gpu_resource] = ("GPUs are requested by HPC_GPU_RULES (HPC_SGE_GPU_RESOURCE)", "")
        found = []
        for i, word in enumerate(words):
            if word in RESERVED_OPTIONS and not (command_line and word in COMMAND_LINE_OPTIONS):
                found.append((word, self.set_by_bridge(word, RESERVED_OPTIONS[word], word)))
            elif word == "-l" and i + 1 < len(words):
                for request in words[i + 1].split(","):
                    name = request.split("=", 1)[0]
                    if name in own:
                        why, key = own[name]
                        found.append((f"-l {words[i + 1]}", self.set_by_bridge(f"-l {name}", why, key)))
                        break
        return found

    def clean(self, message: str) -> str:
        return super().clean("\n".join(line for line in message.splitlines() if line.strip() != "Exiting."))

    def submit_command(self, script: Path, spec: JobSpec) -> list[str]:
        return ["qsub", "-terse", *spec.extra_args, str(script)]

    def submit(self, script: Path, spec: JobSpec) -> str:
        result = self._submit_command(self.submit_command(script, spec))
        for line in result.stdout.splitlines():
            job_id = plain_job_id(line.strip().split(".")[0])  # an array job prints N.1-3:1
            if job_id:
                return job_id
        raise SchedulerUnavailable(f"qsub printed no job id: {result.stdout[:200]!r}")

    def query(self, job_ids: Sequence[str]) -> Mapping[str, JobInfo]:
        found: dict[str, JobInfo] = {}
        ids = {plain_job_id(j) for j in job_ids} - {""}  # anything else is never ours
        if not ids:
            return found
        for jid, _, native in self._live():
            if jid in ids and jid not in found:
                found[jid] = JobInfo(jid, translate(native), native, source="queue")
        # Why a job waits (PENDING: scheduling info) or is stuck (ERROR: error reason): one qstat -j.
        asked = sorted((j for j, i in found.items() if i.state in (JobState.PENDING, JobState.ERROR)), key=int)
        details = self._details(asked) if asked else {}
        for jid in asked:
            info, detail = found[jid], details.get(jid, {})
            if info.state is JobState.ERROR:
                native = f"{info.native_state}: {one_line(detail.get('error reason', ''))}".rstrip(": ")
                found[jid] = JobInfo(jid, info.state, native, source="queue")
            else:
                found[jid] = JobInfo(jid, info.state, info.native_state, source="queue", reason=_pending(detail))
        # Jobs that have left the queue: the last accounting record (a restarted job has several).
        for jid in sorted(ids - set(found), key=int):
            acct = self._run(["qacct", "-o", self.user, "-j", jid], check=False)
            records = [r for r in self._own_records(acct.stdout) if r.get("jobnumber") == jid]
            if records:
                found[jid] = accounting_info(jid, records[-1])
            elif acct.returncode != 0 and not _no_record(acct.stdout + acct.stderr):
                # Accounting unreadable: the job is unknown, not missing (see SlurmScheduler.query).
                raise SchedulerUnavailable(f"qacct failed: {self.clean(acct.stdout + acct.stderr)}")
        return found

    def find_by_name(self, name: str) -> list[str]:
        ge_name("job name", name)
        ids = {jid for jid, job_name, _ in self._live() if job_name == name}
        acct = self._run(["qacct", "-o", self.user, "-j", name], check=False)
        ids.update(r.get("jobnumber", "") for r in self._own_records(acct.stdout) if r.get("jobname") == name)
        return sorted((i for i in ids if plain_job_id(i)), key=int)

    def cancel(self, job_id: str) -> None:
        job_id = _job_id("job id", job_id)
        if job_id not in {jid for jid, _, _ in self._live()}:
            return  # ended, never existed, or another user's: nothing of ours to delete
        result = self._run(["qdel", job_id], check=False)
        if result.returncode != 0 and "does not exist" not in result.stdout + result.stderr:
            raise SchedulerUnavailable(f"qdel failed: {self.clean(result.stdout + result.stderr)}")

    def ping(self) -> str:
        result = self._run(["qstat", "-g", "c"], check=False)
        if result.returncode != 0:
            raise SchedulerUnavailable(f"sge_qmaster: {self.clean(result.stdout + result.stderr)}")
        rows = [ln.split() for ln in result.stdout.splitlines()[2:] if len(ln.split()) >= 6]
        return "; ".join(f"{r[0]}: {r[2]} of {r[5]} slots used" for r in rows) or "no cluster queues"

    def check_accounting(self) -> str:
        """qacct reads the cell's accounting file: "no such job" is an answer, anything else is not."""
        result = self._run(["qacct", "-o", self.user, "-j", "1"], check=False)
        output = result.stdout + result.stderr
        if result.returncode != 0 and not _no_record(output):
            raise SchedulerUnavailable(f"qacct: {self.clean(output) or f'exit {result.returncode}'}")
        return "qacct answers"

    def _live(self) -> list[tuple[str, str, str]]:
        """(id, name, state letters) of every live job of ours that is not an array job."""
        result = self._run(["qstat", "-xml", "-u", self.user], check=False)
        if result.returncode != 0:
            raise SchedulerUnavailable(f"qstat failed: {self.clean(result.stdout + result.stderr)}")
        if not result.stdout.strip():
            return []
        try:
            root = ET.fromstring(result.stdout)  # noqa: S314 - the output of our own qstat, not remote input
        except ET.ParseError as exc:
            raise SchedulerUnavailable(f"qstat printed unreadable XML: {exc}") from exc
        jobs = []
        for job in root.iter("job_list"):
            jid = plain_job_id(job.findtext("JB_job_number") or "")
            owner = (job.findtext("JB_owner") or "").strip()
            if jid and owner == self.user and job.find("tasks") is None:
                jobs.append((jid, job.findtext("JB_name") or "", (job.findtext("state") or "").strip()))
        return jobs

    def _own_records(self, qacct_output: str) -> list[dict[str, str]]:
        """qacct records of our own jobs, array tasks left out."""
        return [
            r
            for r in parse_qacct(qacct_output)
            if r.get("owner") == self.user and r.get("taskid", "undefined") == "undefined"
        ]

    def _details(self, job_ids: Sequence[str]) -> dict[str, dict[str, str]]:
        """``qstat -j ID,...``: job id -> its fields (``scheduling info``, ``error reason``), best effort.

        A job that left the queue meanwhile is missing from the answer; a failing qstat gives {}.
        """
        result = self._run(["qstat", "-j", ",".join(job_ids)], check=False)
        return parse_job_details(result.stdout)


def parse_job_details(text: str) -> dict[str, dict[str, str]]:
    """``qstat -j`` output -> job number -> field -> value; continuation lines (indented) are
    joined to their field with "; ". ``error reason    1:`` is read as ``error reason``."""
    jobs: dict[str, dict[str, str]] = {}
    current: dict[str, str] | None = None
    key = ""
    for line in text.splitlines():
        if line.startswith("====="):
            current, key = None, ""
            continue
        if line[:1].isspace():
            if current is not None and key and line.strip():
                current[key] = f"{current[key]}; {line.strip()}" if current[key] else line.strip()
            continue
        name, sep, value = line.partition(":")
        if not sep:
            continue
        key = " ".join(name.split()[:2]) if name.startswith("error reason") else name.strip()
        if key == "job_number":
            current = jobs.setdefault(value.strip(), {})
        if current is not None and key not in current:
            current[key] = value.strip()
    return jobs


def _pending(detail: Mapping[str, str]) -> str:
    """A waiting job's reason, from its ``scheduling info`` (none when the scheduler keeps none)."""
    info = detail.get("scheduling info", "")
    if "turned off" in info or "Collecting of scheduler job information" in info:
        return ""
    return one_line(info)


def _job_id(what: str, value: str) -> str:
    """A job id is digits only (a name would be accepted by -hold_jid, silently, and match by pattern)."""
    if not value.isdigit():
        raise ValueError(f"refusing unsafe value for {what}: {value!r}")
    return value


def _no_record(output: str) -> bool:
    """qacct's answers for "no such job yet": ``error: job id N not found``, and
    ``No jobs running since startup`` while no job has ever ended (no accounting file)."""
    return "not found" in output or "No jobs running since startup" in output


def _seconds(text: str) -> float | None:
    """qacct's ``21s`` / ``21.000`` -> 21.0."""
    try:
        return float(text.strip().rstrip("s"))
    except ValueError:
        return None


def _h_rt(category: str) -> float | None:
    """The h_rt in seconds from a category like ``-l gpu=1,h_rt=20,mem_free=100M -pe smp 2``."""
    match = re.search(r"(?:^|[\s,])h_rt=([0-9:]+)", category)
    if not match:
        return None
    seconds = 0.0
    for part in match.group(1).split(":"):
        seconds = seconds * 60 + float(part or 0)
    return seconds


def _elapsed(seconds: float | None) -> str:
    """Seconds -> ``D-HH:MM:SS`` / ``HH:MM:SS``, like sacct's Elapsed."""
    if seconds is None:
        return ""
    minutes, secs = divmod(int(seconds), 60)
    hours, mins = divmod(minutes, 60)
    days, hours = divmod(hours, 24)
    return f"{days}-{hours:02d}:{mins:02d}:{secs:02d}" if days else f"{hours:02d}:{mins:02d}:{secs:02d}"
