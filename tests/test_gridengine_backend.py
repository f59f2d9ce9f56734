"""The Grid Engine backend: rendered script (golden file), validation, state table, qacct rules,
submit-error classification and only our jobs (fake commands), then real jobs on the local Grid
Engine (deploy/dev/gridengine.sh up; it fails, never skips, when that is down): among them another
user's jobs named like ours, an array job, and a held job's pending reason."""

from __future__ import annotations

import os
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from bridge.errors import SchedulerRejected, SchedulerUnavailable
from bridge.schedulers import BACKENDS, GridEngineScheduler, JobInfo, JobSpec, JobState, get_scheduler
from bridge.schedulers.gridengine import STATE_TABLE, accounting_info, parse_job_details, parse_qacct, translate
from bridge.shell import run_command
from tests.support.bridge import fake_command
from tests.support.cluster import require_other_user

GOLDEN = Path(__file__).parent / "golden" / "gridengine_job.sh"
GOLDEN_SITE = Path(__file__).parent / "golden" / "gridengine_job_site.sh"
#: HPC_JOB_PROLOGUE as a site writes it (environment modules, its own activation script, a proxy).
SITE_PROLOGUE = (
    "module load cuda/12.2 cudnn\nsource /opt/site/tensorflow-env.sh\nexport HTTPS_PROXY=http://proxy.example.org:3128"
)


def spec(**kw: object) -> JobSpec:
    values: dict[str, object] = dict(
        name="rodan-3f2b8c1e-0d4a-4c1b-9a57-6f1f0c3e2d10",
        comment="3f2b8c1e-0d4a-4c1b-9a57-6f1f0c3e2d10",
        time_minutes=6 * 60,
        memory_mb=16000,
        cpus=6,
        command=("/opt/venv/bin/python", "-m", "worker", "run", "/spool/params/3f2b.json"),
        log_dir=Path("/spool/jobs/3f2b"),
        warn_seconds=300,
        workdir=Path("/spool/jobs/3f2b"),
        gres="gpu:1",
        email="lab@example.org",
        account="def-lab",
        partition="gpu",
    )
    values.update(kw)
    return JobSpec(**values)  # type: ignore[arg-type]


# --- rendering ---------------------------------------------------------------------------------


def test_rendered_script_matches_the_golden_file() -> None:
    text = GridEngineScheduler().render(spec())
    if os.environ.get("UPDATE_GOLDEN"):
        GOLDEN.write_text(text)
    assert text == GOLDEN.read_text()


def test_site_directives_and_prologue_match_the_golden_file() -> None:
    """HPC_JOB_DIRECTIVES after the bridge's own directives, HPC_JOB_PROLOGUE just before the worker."""
    text = GridEngineScheduler().render(spec(directives=("-l h_vmem=4G", "-A lab-ocr", "-R y"), prologue=SITE_PROLOGUE))
    if os.environ.get("UPDATE_GOLDEN"):
        GOLDEN_SITE.write_text(text)
    assert text == GOLDEN_SITE.read_text()


def test_registered_and_configured_from_site_options() -> None:
    assert BACKENDS["gridengine"] is GridEngineScheduler
    ge = get_scheduler("gridengine", options={"pe": "mpi", "gpu_resource": "ngpus", "memory_resource": "h_vmem"})
    text = ge.render(spec(cpus=4, gres="gpu:v100:2"))
    assert "#$ -pe mpi 4" in text and "#$ -l ngpus=2" in text and "#$ -l h_vmem=4000M" in text  # per slot
    assert ge.log_file(Path("/logs"), "42") == Path("/logs/job-42.out")
    assert "#$ -l h_vmem=334M" in ge.render(spec(cpus=3, memory_mb=1000))  # rounded up


def test_optional_directives_are_left_out() -> None:
    text = GridEngineScheduler().render(spec(cpus=1, gres=None, email="", account="", partition="", warn_seconds=0))
    for absent in ("-pe", "-l gpu", "-M", "-m ea", "-P", "-q", "-notify", "-hold_jid"):
        assert f"#$ {absent}" not in text
    assert "#$ -l h_rt=6:00:00" in text and "#$ -l mem_free=16000M" in text and "#$ -r n" in text
    held = GridEngineScheduler().render(spec(time_minutes=90, hold_after="1234"))
    assert "#$ -hold_jid 1234" in held and "#$ -l h_rt=1:30:00" in held


@pytest.mark.parametrize(
    "field",
    [
        {"name": "1rodan"},
        {"name": "rodan:x"},
        {"name": "rodan x"},
        {"name": "rodan/x"},
        {"name": "rodan@x"},
        {"name": "rodan*"},
        {"name": "rodan,x"},
        {"name": "ünï"},
        {"name": "rodan-$(id)"},
        {"hold_after": "12;rm"},
        {"hold_after": "rodan-previous"},
        {"email": "a@b.org\n#$ -u root"},
        {"account": "x;rm -rf /"},
        {"account": "1project"},
        {"partition": "all.q -l h_rt=0"},
        {"log_dir": Path("/tmp/a b")},
        {"workdir": Path("/tmp/$(id)")},
        {"environment": {"A B": "x"}},
        {"environment": {"A": "x\n#$ -u root"}},
    ],
)
def test_unsafe_values_never_reach_the_script(field: dict[str, object]) -> None:
    with pytest.raises(ValueError, match="unsafe value"):
        GridEngineScheduler().render(spec(**field))


@pytest.mark.parametrize("option", [{"pe": "smp 2"}, {"gpu_resource": "gpu=1,h_rt"}, {"memory_resource": "m;x"}])
def test_unsafe_site_settings_are_refused(option: dict[str, str]) -> None:
    with pytest.raises(ValueError, match="unsafe value"):
        GridEngineScheduler(**option)


def test_unsafe_ids_and_names_never_reach_a_command() -> None:
    ge = GridEngineScheduler()
    with pytest.raises(ValueError, match="unsafe value"):
        ge.cancel("12 -u *")
    with pytest.raises(ValueError, match="unsafe value"):
        ge.find_by_name("rodan*")
    with pytest.raises(ValueError, match="unsafe value"):
        ge.render(spec(hold_after="-u"))  # the hold is a directive of the rendered script


def test_command_arguments_are_shell_quoted() -> None:
    text = GridEngineScheduler().render(spec(command=("/opt/py", "-m", "worker", "run", "/spool/it's here.json")))
    assert "exec /opt/py -m worker run '/spool/it'\"'\"'s here.json'" in text


# --- states --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("native", "state"),
    [
        ("qw", JobState.PENDING),
        ("hqw", JobState.PENDING),
        ("hRwq", JobState.PENDING),
        ("t", JobState.RUNNING),
        ("r", JobState.RUNNING),
        ("Rr", JobState.RUNNING),
        ("Rt", JobState.RUNNING),
        ("hr", JobState.RUNNING),
        ("s", JobState.SUSPENDED),
        ("S", JobState.SUSPENDED),
        ("T", JobState.SUSPENDED),
        ("ss", JobState.SUSPENDED),
        ("Rq", JobState.REQUEUED),
        ("Eqw", JobState.ERROR),
        ("Ehqw", JobState.ERROR),
        ("EhRqw", JobState.ERROR),
        ("dr", JobState.RUNNING),
        ("dt", JobState.RUNNING),
        ("dRr", JobState.RUNNING),
        (" r ", JobState.RUNNING),
        ("", JobState.MISSING),
        ("z", JobState.MISSING),
        ("Xw", JobState.MISSING),
    ],
)
def test_state_letters(native: str, state: JobState) -> None:
    assert translate(native) is state


def test_live_states_are_never_terminal_except_error() -> None:
    assert all(not s.is_terminal for s in STATE_TABLE.values())
    assert translate("Eqw").is_terminal


LIMIT = "qmaster enforced h_rt, h_cpu, or h_vmem limit"


# qacct -j output, as Grid Engine 8.1.9 prints it (fields trimmed to the ones that matter).
def qacct_record(job: str, failed: str, exit_status: str, wallclock: str, category: str = "NONE") -> str:
    return f"""==============================================================
qname        all.q
hostname     vm
owner        root
jobname      rodan-x
jobnumber    {job}
taskid       undefined
qsub_time    Thu Nov 26 02:58:28 2026
start_time   Thu Nov 26 02:58:29 2026
end_time     Thu Nov 26 02:58:55 2026
granted_pe   NONE
slots        1
failed       {failed}
exit_status  {exit_status}
ru_wallclock {wallclock}
ru_utime     0.087s
maxvmem      5.348MB
category     {category}
"""


@pytest.mark.parametrize(
    ("text", "state", "native", "exit_code", "elapsed"),
    [
        (qacct_record("7", "0    ", "0", "3s"), JobState.COMPLETED, "exit 0", "0", "00:00:03"),
        (qacct_record("7", "0    ", "3", "3s", "-l h_rt=60,mem_free=100M"), JobState.FAILED, "exit 3", "3", "00:00:03"),
        (
            qacct_record(
                "7", "37  : qmaster enforced h_rt, h_cpu, or h_vmem limit", "137 (Killed)", "26s", "-l h_rt=15"
            ),
            JobState.TIMEOUT,
            "failed 37: qmaster enforced h_rt, h_cpu, or h_vmem limit",
            "137",
            "00:00:26",
        ),
        (
            qacct_record(
                "7",
                "37  : qmaster enforced h_rt, h_cpu, or h_vmem limit",
                "137 (Killed)",
                "61s",
                "-l gpu=1,h_rt=3600,h_vmem=4G -pe smp 2",
            ),
            JobState.OUT_OF_MEMORY,
            "failed 37: qmaster enforced h_rt, h_cpu, or h_vmem limit",
            "137",
            "00:01:01",
        ),
        (
            qacct_record("7", "37  : qmaster enforced h_rt, h_cpu, or h_vmem limit", "137", "3601", "-l h_rt=1:00:00"),
            JobState.TIMEOUT,
            "failed 37: qmaster enforced h_rt, h_cpu, or h_vmem limit",
            "137",
            "01:00:01",
        ),
        (
            qacct_record("7", "100 : assumedly after job", "137                  (Killed)", "13s", "-l h_rt=60"),
            JobState.CANCELLED,
            "failed 100: assumedly after job",
            "137",
            "00:00:13",
        ),
        (
            qacct_record("7", "100 : assumedly after job", "138 (User defined signal 1)", "10s"),
            JobState.FAILED,
            "failed 100: assumedly after job",
            "138",
            "00:00:10",
        ),
        (
            qacct_record("7", "25  : rescheduling", "99", "1s"),
            JobState.REQUEUED,
            "failed 25: rescheduling",
            "99",
            "00:00:01",
        ),
        (
            qacct_record("7", "30  : application error returned", "100", "2s"),
            JobState.FAILED,
            "failed 30: application error returned",
            "100",
            "00:00:02",
        ),
        (
            qacct_record("7", "26  : opening input/output file", "0", "0s"),
            JobState.FAILED,
            "failed 26: opening input/output file",
            "0",
            "00:00:00",
        ),
        (
            qacct_record("7", "28  : changing into working directory", "0", "0s"),
            JobState.FAILED,
            "failed 28: changing into working directory",
            "0",
            "00:00:00",
        ),
        # A job restarted (exit 99) has a record per run: the last one wins.
        (
            qacct_record("7", "25  : rescheduling", "99", "1s") + qacct_record("7", "0    ", "0", "90061s"),
            JobState.COMPLETED,
            "exit 0",
            "0",
            "1-01:01:01",
        ),
        (
            qacct_record("7", "0    ", "0", "2s") + qacct_record("7", "0    ", "5", "4s"),
            JobState.FAILED,
            "exit 5",
            "5",
            "00:00:04",
        ),
    ],
)
def test_accounting_records(text: str, state: JobState, native: str, exit_code: str, elapsed: str) -> None:
    records = parse_qacct(text)
    assert all(r["jobnumber"] == "7" for r in records)
    assert accounting_info("7", records[-1]) == JobInfo("7", state, native, exit_code, elapsed, "accounting")


def test_qacct_parsing_keeps_every_field() -> None:
    records = parse_qacct(qacct_record("9", "0    ", "0", "3s", "-l gpu=1,h_rt=20,mem_free=100M -pe smp 2") * 2)
    assert len(records) == 2
    assert records[0]["category"] == "-l gpu=1,h_rt=20,mem_free=100M -pe smp 2"
    assert records[0]["qsub_time"] == "Thu Nov 26 02:58:28 2026" and records[0]["failed"] == "0"
    assert parse_qacct("") == [] and parse_qacct("error: job id 9 not found\n") == []


# --- commands, faked ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "message",
    [
        'Unable to run job: unknown resource "gpus"',
        "Unable to run job: error: no suitable queues",
        'Unable to run job: denied: "1abc" is not a valid object name (cannot start with a digit)',
        "Unable to run job: Colon (':') not allowed in objectname",
        'Unable to run job: Job was rejected because job requests unknown queue "nosuchq"',
        'Unable to run job: job rejected: the requested project "nosuchproj" does not exist',
        'Unable to run job: job rejected: the requested parallel environment "mpi" does not exist',
        'Unable to run job: attribute "h_rt" is not a time value',
        'qsub: invalid option argument "-bogus"',
    ],
)
def test_permanent_rejection_is_quoted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, message: str) -> None:
    fake_command(tmp_path, monkeypatch, "qsub", f"cat >&2 <<'EOF'\n{message}\nExiting.\nEOF\nexit 1\n")
    with pytest.raises(SchedulerRejected) as err:
        GridEngineScheduler().submit(tmp_path / "job.sh", spec())
    assert str(err.value) == message


@pytest.mark.parametrize(
    "message",
    [
        "error: commlib error: got select error (Connection refused)\nUnable to run job: unable to send message "
        'to qmaster using port 6444 on host "vm": got send error',
        "Unable to run job: failed receiving gdi request response for mid=1 (can't find connection).",
        'error: unable to contact qmaster using port 6444 on host "localhost"',
    ],
)
def test_qmaster_down_is_transient(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, message: str) -> None:
    fake_command(tmp_path, monkeypatch, "qsub", f"cat >&2 <<'EOF'\n{message}\nExiting.\nEOF\nexit 1\n")
    with pytest.raises(SchedulerUnavailable, match=r"^qsub failed: .*(qmaster|gdi request)"):
        GridEngineScheduler().submit(tmp_path / "job.sh", spec())


def test_hanging_qsub_times_out_as_transient(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_command(tmp_path, monkeypatch, "qsub", "sleep 30\n")
    with pytest.raises(SchedulerUnavailable, match="timed out"):
        GridEngineScheduler(timeout_s=0.5).submit(tmp_path / "job.sh", spec())


def test_submit_arguments_job_id_and_no_credentials(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RABBITMQ_PASSWORD", "hunter2")
    monkeypatch.setenv("RODAN_PASSWORD", "hunter3")
    out = tmp_path / "env.txt"
    fake_command(tmp_path, monkeypatch, "qsub", f'env > "{out}"\necho "$@" > "{out}.args"\necho 42.1-3:1\n')
    job = spec(hold_after="41", extra_args=("-p", "-5"))
    assert GridEngineScheduler().submit(tmp_path / "job.sh", job) == "42"
    env = out.read_text()
    assert "hunter2" not in env and "hunter3" not in env and "PATH=" in env
    # everything else (the hold included) is a directive of the rendered script
    assert Path(f"{out}.args").read_text().split() == ["-terse", "-p", "-5", str(tmp_path / "job.sh")]


QSTAT_XML = """<?xml version='1.0'?>
<job_info  xmlns:xsd="http://arc.liv.ac.uk/repos/darcs/sge/source/dist/util/resources/schemas/qstat/qstat.xsd">
  <queue_info>
    <job_list state="running">
      <JB_job_number>21</JB_job_number>
      <JAT_prio>0.75000</JAT_prio>
      <JB_name>rodan-a</JB_name>
      <JB_owner>root</JB_owner>
      <state>r</state>
      <JAT_start_time>2026-11-26T02:58:29</JAT_start_time>
      <queue_name>all.q@vm</queue_name>
      <slots>1</slots>
    </job_list>
  </queue_info>
  <job_info>
    <job_list state="pending">
      <JB_job_number>19</JB_job_number>
      <JAT_prio>0.75000</JAT_prio>
      <JB_name>rodan-a</JB_name>
      <JB_owner>root</JB_owner>
      <state>Eqw</state>
      <JB_submission_time>2026-11-26T02:58:28</JB_submission_time>
      <queue_name></queue_name>
      <slots>1</slots>
    </job_list>
  </job_info>
</job_info>
"""


def test_query_prefers_the_queue_then_the_last_accounting_record(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "qstat.xml").write_text(QSTAT_XML)
    (tmp_path / "qacct.21").write_text(qacct_record("21", "0    ", "0", "1s"))
    (tmp_path / "qacct.23").write_text(qacct_record("23", "25  : rescheduling", "99", "1s") * 2)
    (tmp_path / "qacct.rodan-a").write_text(qacct_record("5", "0    ", "0", "1s").replace("rodan-x", "rodan-a"))
    fake_command(
        tmp_path,
        monkeypatch,
        "qstat",
        f'case "$1" in\n-xml) cat "{tmp_path}/qstat.xml";;\n'
        "-j) echo '=============================================================='; echo 'job_number:     19';"
        " echo 'error reason          1:      11/26/2026 02:58:30 [110:12525]: exit_status of job start = 100';;\n"
        "esac\n",
    )
    _fake_qacct(tmp_path, monkeypatch)
    ge = GridEngineScheduler(user="root")
    found = ge.query(["19", "21", "22", "23"])
    assert found["21"] == JobInfo("21", JobState.RUNNING, "r", source="queue")  # live wins over accounting
    assert found["19"].state is JobState.ERROR
    assert found["19"].native_state.startswith("Eqw: 11/26/2026") and "exit_status of job start = 100" in (
        found["19"].native_state
    )
    assert "22" not in found  # neither live nor in accounting: absent, never guessed
    assert found["23"].state is JobState.REQUEUED and found["23"].source == "accounting"
    assert ge.query([]) == {}
    assert ge.find_by_name("rodan-a") == ["5", "19", "21"]


def _fake_qacct(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """qacct printing the file qacct.JOB (JOB: its last argument), else "not found"; it records its arguments."""
    fake_command(
        tmp_path,
        monkeypatch,
        "qacct",
        f'echo "$*" >> "{tmp_path}/qacct.calls"\nfor last; do :; done\n'
        f'[ -f "{tmp_path}/qacct.$last" ] && exec cat "{tmp_path}/qacct.$last"\n'
        'echo "error: job id $last not found" >&2\nexit 1\n',
    )


def test_no_jobs_and_no_accounting_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_command(tmp_path, monkeypatch, "qstat", "exit 0\n")
    fake_command(tmp_path, monkeypatch, "qacct", "echo 'No jobs running since startup'\nexit 1\n")
    assert GridEngineScheduler().query(["5"]) == {}
    assert GridEngineScheduler().find_by_name("rodan-a") == []


def test_qmaster_down_for_queries_ping_and_cancel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    down = (
        "echo 'error: commlib error: got select error (Connection refused)' >&2\n"
        "echo 'error: unable to send message to qmaster using port 6444 on host \"vm\": got send error' >&2\nexit 1\n"
    )
    for command in ("qstat", "qdel"):
        fake_command(tmp_path, monkeypatch, command, down)
    ge = GridEngineScheduler()
    for call in (lambda: ge.query(["5"]), ge.ping, lambda: ge.find_by_name("x"), lambda: ge.cancel("5")):
        with pytest.raises(SchedulerUnavailable, match="unable to send message to qmaster"):
            call()


@pytest.mark.gridengine  # the real qstat says whether the job is live
def test_cancel_of_a_job_that_is_gone_is_fine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_command(tmp_path, monkeypatch, "qdel", "echo 'denied: job \"99999\" does not exist' >&2\nexit 1\n")
    GridEngineScheduler().cancel("99999")


def _job(number: str, name: str, owner: str, state: str = "qw", tasks: str = "") -> str:
    extra = f"<tasks>{tasks}</tasks>" if tasks else ""
    return (
        f"<job_list state='pending'><JB_job_number>{number}</JB_job_number><JB_name>{name}</JB_name>"
        f"<JB_owner>{owner}</JB_owner><state>{state}</state>{extra}</job_list>"
    )


def test_only_our_jobs_are_read_adopted_or_deleted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    jobs = [
        _job("30", "rodan-a", "other"),  # another user's, named like ours (qstat -u ignored by a fake)
        _job("31", "rodan-a", "hpcbt", "hqw"),
        _job("32", "rodan-a", "hpcbt", tasks="1-2:1"),  # an array job: never one the bridge submitted
        _job("3x", "rodan-a", "hpcbt"),
        _job("", "rodan-a", "hpcbt"),
        _job("\u0663", "rodan-a", "hpcbt"),  # a digit, but not an ASCII one
    ]
    (tmp_path / "qstat.xml").write_text(
        f"<?xml version='1.0'?><job_info><job_info>{''.join(jobs)}</job_info></job_info>"
    )
    records = (
        qacct_record("40", "0    ", "0", "1s").replace("rodan-x", "rodan-a").replace("root", "other")
        + qacct_record("41", "0    ", "0", "1s").replace("rodan-x", "rodan-a").replace("root", "hpcbt")
        + qacct_record("42", "0    ", "0", "1s")
        .replace("rodan-x", "rodan-a")
        .replace("root", "hpcbt")
        .replace("taskid       undefined", "taskid       1")
    )
    for key in ("rodan-a", "40", "41", "42"):
        (tmp_path / f"qacct.{key}").write_text(records)
    calls = tmp_path / "calls.txt"
    fake_command(
        tmp_path,
        monkeypatch,
        "qstat",
        f'echo "qstat $*" >> "{calls}"\n'
        f'case "$1" in\n-xml) cat "{tmp_path}/qstat.xml";;\n'
        "-j) printf '==========\\njob_number:  31\\nscheduling info:   Job is in hold state\\n';;\nesac\n",
    )
    _fake_qacct(tmp_path, monkeypatch)
    fake_command(tmp_path, monkeypatch, "qdel", f'echo "qdel $*" >> "{calls}"\n')
    ge = GridEngineScheduler(user="hpcbt")
    assert ge.find_by_name("rodan-a") == ["31", "41"]
    found = ge.query(["30", "31", "32", "40", "41", "42", "3x", ""])
    assert sorted(found) == ["31", "41"]
    assert found["31"] == JobInfo("31", JobState.PENDING, "hqw", source="queue", reason="Job is in hold state")
    assert found["41"].state is JobState.COMPLETED
    ge.cancel("30")  # another user's: qstat -u hpcbt would not list it, and qdel must not get it
    ge.cancel("32")  # an array job
    ge.cancel("41")  # ended
    ge.cancel("31")  # ours, live: deleted
    lines = calls.read_text().splitlines()
    assert [line for line in lines if line.startswith("qdel")] == ["qdel 31"]
    assert all(line == "qstat -xml -u hpcbt" for line in lines if line.startswith("qstat -xml"))
    assert all(line.startswith("-o hpcbt -j ") for line in (tmp_path / "qacct.calls").read_text().splitlines())


def test_qstat_j_details_and_pending_reasons() -> None:
    text = """==============================================================
job_number:                 12
owner:                      root
error reason          1:      11/26/2026 02:58:30 [110:12525]: exit_status of job start = 100
scheduling info:            queue instance "all.q@vm" dropped because it is full
                            (-l gpu=3) cannot run at host "vm" because it offers only hc:gpu=2.000000

==============================================================
job_number:                 13
scheduling info:            (Collecting of scheduler job information is turned off)
"""
    details = parse_job_details(text)
    assert details["12"]["error reason"].endswith("exit_status of job start = 100")
    assert details["12"]["scheduling info"] == (
        'queue instance "all.q@vm" dropped because it is full; '
        '(-l gpu=3) cannot run at host "vm" because it offers only hc:gpu=2.000000'
    )
    assert details["13"]["scheduling info"].startswith("(Collecting")
    assert parse_job_details("") == {} and parse_job_details("garbage\n\xff\n   indented\n") == {}


def test_odd_qstat_output_never_raises(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_command(tmp_path, monkeypatch, "qstat", "printf '<job_info><job_list><JB_job_number>\\377</JB_job_number>'\n")
    with pytest.raises(SchedulerUnavailable, match="unreadable XML"):
        GridEngineScheduler(user="hpcbt").query(["5"])
    fake_command(tmp_path, monkeypatch, "qstat", "printf '\\377\\376 garbage\\n'\n")
    fake_command(tmp_path, monkeypatch, "qacct", "printf 'jobnumber \\377\\n'\nexit 1\n")
    with pytest.raises(SchedulerUnavailable):
        GridEngineScheduler(user="hpcbt").find_by_name("rodan-a")


# --- the real Grid Engine --------------------------------------------------------------------------

SUBMITTED: list[str] = []


@pytest.fixture(scope="module")
def ge(gridengine: None) -> Iterator[GridEngineScheduler]:
    """The local Grid Engine (conftest's ``gridengine`` fails, never skips, when it is not installed)."""
    scheduler = GridEngineScheduler(timeout_s=30)
    deadline = time.monotonic() + 60  # a qmaster being (re)started answers within seconds
    while True:
        try:
            scheduler.ping()
            break
        except SchedulerUnavailable as exc:
            if time.monotonic() > deadline:
                pytest.fail(f"sge_qmaster is not answering ({exc}): run 'bash deploy/dev/gridengine.sh up'")
            time.sleep(2)
    yield scheduler
    if SUBMITTED:
        subprocess.run(["qdel", *SUBMITTED], capture_output=True, timeout=60)


def real_spec(tmp_path: Path, script: str, **kw: object) -> JobSpec:
    values: dict[str, object] = dict(
        name=f"hpcbt-{uuid.uuid4().hex[:12]}",
        comment="test",
        time_minutes=10,
        memory_mb=100,
        cpus=1,
        command=("/bin/bash", "-c", script),  # an absolute interpreter: the login shell resets PATH
        log_dir=tmp_path,
        workdir=tmp_path,
        gres=None,
    )
    values.update(kw)
    return JobSpec(**values)  # type: ignore[arg-type]


def submit(ge: GridEngineScheduler, job: JobSpec, script_name: str = "job.sh") -> str:
    script = job.workdir / f"{job.name}-{script_name}"
    script.write_text(ge.render(job))
    job_id = ge.submit(script, job)
    SUBMITTED.append(job_id)
    return job_id


def wait_for(ge: GridEngineScheduler, job_id: str, done: Callable[[JobInfo], bool], timeout: float = 30) -> JobInfo:
    deadline = time.monotonic() + timeout
    info = None
    while time.monotonic() < deadline:
        info = ge.query([job_id]).get(job_id)
        if info is not None and done(info):
            return info
        time.sleep(0.3)
    raise AssertionError(f"job {job_id}: still {info} after {timeout:g} s")


def ended(info: JobInfo) -> bool:
    return info.state.is_terminal and info.source == "accounting"


@pytest.fixture(scope="module")
def time_limited(ge: GridEngineScheduler, tmp_path_factory: pytest.TempPathFactory) -> str:
    """A job past its 1-minute h_rt, submitted first so that it runs while the other tests do."""
    return submit(ge, real_spec(tmp_path_factory.mktemp("timeout"), "sleep 120", time_minutes=1))


@pytest.mark.gridengine
def test_real_job_environment_log_and_states(ge: GridEngineScheduler, time_limited: str, tmp_path: Path) -> None:
    env_file = tmp_path / "env.txt"
    job = real_spec(
        tmp_path,
        f'env > {env_file}; echo "path=$PATH"; sleep 2',
        cpus=2,
        warn_seconds=30,
        environment={"HPC_TEST_VALUE": "a,b c", "HPC_TEST_QUOTE": "it's"},
    )
    job_id = submit(ge, job)
    first = ge.query([job_id])[job_id]
    assert first.state in (JobState.PENDING, JobState.RUNNING) and first.source == "queue"
    assert first.native_state in ("qw", "t", "r")
    assert wait_for(ge, job_id, lambda i: i.state is JobState.RUNNING).native_state in ("t", "r")
    info = wait_for(ge, job_id, ended)
    assert info == JobInfo(job_id, JobState.COMPLETED, "exit 0", "0", info.elapsed, "accounting")
    assert info.elapsed >= "00:00:02"
    env = dict(line.split("=", 1) for line in env_file.read_text().splitlines() if "=" in line)
    assert env["HPC_JOB_ID"] == env["JOB_ID"] == job_id
    assert env["HPC_JOB_SCHEDULER"] == "gridengine" and env["HPC_JOB_WARN_S"] == "30"
    assert env["HPC_JOB_TIME_LIMIT_S"] == "600" and env["NSLOTS"] == "2"
    assert env["HPC_TEST_VALUE"] == "a,b c" and env["HPC_TEST_QUOTE"] == "it's"
    assert env["TMPDIR"] == env["TMP"] and f"/{job_id}.1." in env["TMPDIR"]  # root gets no TMPDIR
    assert int(env["HPC_JOB_STARTED"]) > 0 and Path(env["PWD"]) == tmp_path
    assert not any(k.startswith(("RABBITMQ_", "RODAN_")) for k in env)
    log = ge.log_file(tmp_path, job_id).read_text()
    assert f"hpc-bridge job {job.name}: " in log and f"(job {job_id}, restart 0)" in log


@pytest.mark.gridengine
def test_real_exit_codes_and_error_state(ge: GridEngineScheduler, time_limited: str, tmp_path: Path) -> None:
    failed = submit(ge, real_spec(tmp_path, "exit 3"))
    errored = submit(ge, real_spec(tmp_path, "exit 100"))  # Grid Engine parks the job in Eqw
    done = wait_for(ge, failed, ended)
    assert done == JobInfo(failed, JobState.FAILED, "exit 3", "3", done.elapsed, "accounting")
    assert "00:00:00" <= done.elapsed <= "00:00:05"  # qacct rounds a start-to-end second either way
    info = wait_for(ge, errored, lambda i: i.state is JobState.ERROR)
    assert info.source == "queue" and info.native_state.startswith("Eqw: ")
    assert "exit_status of job start = 100" in info.native_state
    ge.cancel(errored)
    gone = wait_for(ge, errored, lambda i: i.source == "accounting")
    assert (gone.state, gone.native_state, gone.exit_code) == (
        JobState.FAILED,
        "failed 30: application error returned",
        "100",
    )


@pytest.mark.gridengine
def test_real_cancel(ge: GridEngineScheduler, time_limited: str, tmp_path: Path) -> None:
    job_id = submit(ge, real_spec(tmp_path, "sleep 120"))
    wait_for(ge, job_id, lambda i: i.state is JobState.RUNNING)
    ge.cancel(job_id)
    info = wait_for(ge, job_id, ended)
    assert (info.state, info.native_state, info.exit_code) == (
        JobState.CANCELLED,
        "failed 100: assumedly after job",
        "137",
    )
    ge.cancel(job_id)  # gone: no error
    ge.cancel("9999999")


@pytest.mark.gridengine
def test_real_find_by_name_live_and_finished(ge: GridEngineScheduler, time_limited: str, tmp_path: Path) -> None:
    job = real_spec(tmp_path, "true")
    finished = submit(ge, job, "a.sh")
    wait_for(ge, finished, ended)
    live = submit(ge, replace(job, command=("/bin/sleep", "60")), "b.sh")
    wait_for(ge, live, lambda i: i.source == "queue")
    assert ge.find_by_name(job.name) == sorted([finished, live], key=int)
    assert ge.find_by_name(f"hpcbt-{uuid.uuid4().hex[:12]}") == []
    ge.cancel(live)


@pytest.mark.gridengine
def test_real_continue_job_waits_for_the_first(ge: GridEngineScheduler, time_limited: str, tmp_path: Path) -> None:
    first = real_spec(tmp_path, f"sleep 3; date +%s.%N > {tmp_path}/first.end")
    first_id = submit(ge, first)
    wait_for(ge, first_id, lambda i: i.state is JobState.RUNNING)
    successor = real_spec(tmp_path, f"date +%s.%N > {tmp_path}/second.start", name=first.name)
    script = tmp_path / "successor.sh"
    script.write_text(ge.render(successor))  # rendered without a hold, as the running job would
    second_id = ge.continue_job(first_id, script, successor)
    SUBMITTED.append(second_id)
    assert second_id != first_id
    held = ge.query([second_id])[second_id]
    assert (held.state, held.native_state) == (JobState.PENDING, "hqw")
    assert wait_for(ge, second_id, ended).state is JobState.COMPLETED
    assert float((tmp_path / "second.start").read_text()) >= float((tmp_path / "first.end").read_text())
    assert ge.query([first_id])[first_id].state is JobState.COMPLETED


def _host_gpus() -> int:
    host = subprocess.run(["hostname"], capture_output=True, text=True).stdout.strip()
    config = subprocess.run(["qconf", "-se", host], capture_output=True, text=True).stdout
    for word in config.replace(",", " ").split():
        if word.startswith("gpu="):
            return int(float(word.removeprefix("gpu=")))
    return int(os.environ.get("HPC_DEV_SGE_GPUS", "2"))


@pytest.mark.gridengine
def test_real_gpu_requests_and_refusals(ge: GridEngineScheduler, time_limited: str, tmp_path: Path) -> None:
    job_id = submit(ge, real_spec(tmp_path, "exit 0", gres="gpu:1"))
    # It may wait for a GPU that another test's job holds (the suite runs two at a time).
    assert wait_for(ge, job_id, ended, timeout=600).state is JobState.COMPLETED
    # More GPUs or memory than the host has: refused at submit time (the script's `-w e`), never left in qw.
    with pytest.raises(SchedulerRejected, match="no suitable queues"):
        submit(ge, real_spec(tmp_path, "exit 0", gres=f"gpu:{_host_gpus() + 1}"))
    with pytest.raises(SchedulerRejected, match="no suitable queues"):
        submit(ge, replace(real_spec(tmp_path, "exit 0"), memory_mb=500_000))
    with pytest.raises(SchedulerRejected, match="unknown queue"):
        submit(ge, real_spec(tmp_path, "exit 0", partition=f"q{uuid.uuid4().hex[:8]}"))


@pytest.mark.gridengine
@pytest.mark.slow  # waits for a one-minute h_rt
@pytest.mark.waits
def test_real_time_limit_ends_as_timeout(ge: GridEngineScheduler, time_limited: str) -> None:
    info = wait_for(ge, time_limited, ended, timeout=120)
    assert (info.state, info.native_state, info.exit_code) == (
        JobState.TIMEOUT,
        "failed 37: qmaster enforced h_rt, h_cpu, or h_vmem limit",
        "137",
    )
    assert info.elapsed >= "00:01:00"


# --- the real Grid Engine: only our jobs ----------------------------------------------------------


@pytest.fixture(scope="module")
def other_user(gridengine: None) -> str:
    """A second unix user who may submit jobs (deploy/dev/gridengine.sh up creates it). Fails, never skips."""
    return require_other_user("gridengine.sh")


@pytest.fixture
def leftovers() -> Iterator[list[str]]:
    """Job ids to delete (as root, a manager: whoever owns them) after the test."""
    ids: list[str] = []
    yield ids
    if ids:
        subprocess.run(["qdel", *ids], capture_output=True, timeout=60)


def _qsub_as(user: str | None, name: str, *args: str) -> str:
    """``qsub`` of a job that does nothing, run by ``user`` (runuser) or by us; returns its id."""
    as_user = ["runuser", "-u", user, "--"] if user else []
    qsub = ["qsub", "-terse", "-N", name, "-b", "y", "-o", "/dev/null", "-j", "y", "-wd", "/", *args, "/bin/true"]
    return run_command([*as_user, *qsub], timeout=60).stdout.strip().split(".")[0]


def _raw_live(job_id: str) -> str:
    """The job's state letters as root sees it (any user's job), or "" when qstat does not list it."""
    out = subprocess.run(["qstat", "-u", "*"], capture_output=True, text=True, timeout=30).stdout
    for line in out.splitlines():
        words = line.split()
        if words[:1] == [job_id]:
            return words[4]
    return ""


def _accounted(job_id: str, timeout: float = 120) -> None:
    """Wait until qacct (any user's records) has the job."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        out = subprocess.run(["qacct", "-j", job_id], capture_output=True, text=True, timeout=30).stdout
        if any(line.split() == ["jobnumber", job_id] for line in out.splitlines()):
            return
        time.sleep(0.5)
    raise AssertionError(f"job {job_id} not in accounting after {timeout:g} s")


def submit_held(ge: GridEngineScheduler, tmp_path: Path, name: str) -> str:
    job = real_spec(tmp_path, "true", name=name, extra_args=("-h",))
    script = tmp_path / f"{uuid.uuid4().hex[:8]}.sh"
    script.write_text(ge.render(job))
    return ge.submit(script, job)


@pytest.mark.gridengine
def test_real_another_users_jobs_are_never_ours(
    ge: GridEngineScheduler, other_user: str, leftovers: list[str], tmp_path: Path
) -> None:
    name = f"rodan-hpcbt-{uuid.uuid4().hex[:12]}"
    theirs_held = _qsub_as(other_user, name, "-h")
    leftovers.append(theirs_held)
    theirs_done = _qsub_as(other_user, name)
    leftovers.append(theirs_done)
    ours = submit_held(ge, tmp_path, name)
    leftovers.append(ours)
    _accounted(theirs_done)

    assert ge.find_by_name(name) == [ours]
    found = ge.query([theirs_held, theirs_done, ours])
    assert list(found) == [ours] and found[ours].state is JobState.PENDING

    ge.cancel(theirs_held)
    assert _raw_live(theirs_held) == "hqw"  # still there: not ours to delete
    ge.cancel(ours)
    assert _raw_live(ours) == ""


@pytest.mark.gridengine
def test_real_array_job_of_ours_is_not_adopted(ge: GridEngineScheduler, leftovers: list[str], tmp_path: Path) -> None:
    name = f"rodan-hpcbt-{uuid.uuid4().hex[:12]}"
    array = _qsub_as(None, name, "-h", "-t", "1-2")
    leftovers.append(array)
    plain = submit_held(ge, tmp_path, name)
    leftovers.append(plain)
    assert _raw_live(array) == "hqw"
    assert ge.find_by_name(name) == [plain]
    assert list(ge.query([array, plain])) == [plain]


@pytest.mark.gridengine
def test_real_held_job_says_why_it_waits(ge: GridEngineScheduler, leftovers: list[str], tmp_path: Path) -> None:
    job_id = submit_held(ge, tmp_path, f"rodan-hpcbt-{uuid.uuid4().hex[:12]}")
    leftovers.append(job_id)
    # The scheduler writes a job's scheduling info on its next run (schedule_interval: 1 s here).
    info = wait_for(ge, job_id, lambda i: bool(i.reason))
    assert (info.state, info.native_state, info.source) == (JobState.PENDING, "hqw", "queue")
    assert info.reason == "Job is in hold state"
    assert ge.check_accounting() == "qacct answers"
