"""Hostile input (fault suite item 5: docs/reliability.md): nothing Rodan's side of the queue sends can crash
the bridge, add a scheduler option to a batch script, or take the Rodan token to another host.

* A property-based fuzz (hypothesis) of request bodies and AMQP properties through
  :func:`bridge.protocol.parse_request` and, for the requests it accepts, through the real
  batch-script rendering of both schedulers (``Intake.job_spec`` -> ``Scheduler.render``).
  It runs ``HPC_FUZZ_EXAMPLES`` generated requests (default 2 000, a new draw every run: 5 s alone on
  2 cores; marked ``slow``), or as many as asked::

      HPC_FUZZ_EXAMPLES=100000 .venv/bin/python -m pytest -q tests/test_fault_input.py -k fuzz -s

* Hand-written attacks, each with its documented outcome: shell metacharacters and newlines in
  every string setting, ``#SBATCH`` / ``#$`` injection in settings, input paths and the
  correlation id, URLs to other hosts (through the real download code and a second loopback
  server that records Authorization headers), path traversal, huge numbers, deep nesting,
  enormous bodies, and messages without reply_to / correlation_id through the real intake.

Terminal job states are covered elsewhere (tests/test_e2e.py, tests/test_reconcile.py).
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any, cast

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bridge.config import BridgeConfig, load_config
from bridge.errors import InvalidRequest, PermanentError
from bridge.intake import Intake
from bridge.ledger import Ledger
from bridge.protocol import (
    MAX_BODY_BYTES,
    MAX_NEW_LAYERS,
    NEW_LAYER_PREFIX,
    OLD_LAYERS,
    SETTING_FIELDS,
    JobRequest,
    parse_request,
)
from bridge.replies import ReplyBox
from bridge.rodan import RodanClient
from bridge.schedulers import GridEngineScheduler, Scheduler, SlurmScheduler
from bridge.spool import Spool, safe_key
from bridge.testing.rodan import RodanStandin, User, token_for_email
from tests.fuzz_messages import NASTY_CHARS, NASTY_NAMES, nasty_urls
from tests.support.bridge import FAST_SETTINGS, RODAN_EMAIL, RODAN_PASSWORD, bridge_environ, run_bridge
from tests.support.broker import Queues, Rodan

FUZZ_EXAMPLES = int(os.environ.get("HPC_FUZZ_EXAMPLES", "2000"))

#: Every option a backend may render, whatever the request (the allow-list).
ALLOWED_OPTIONS = {
    "slurm": {
        "--job-name", "--comment", "--time", "--mem", "--nodes", "--ntasks", "--cpus-per-task", "--output",
        "--open-mode", "--requeue", "--signal", "--dependency", "--gres", "--account", "--partition",
        "--mail-user", "--mail-type",
    },
    "gridengine": {
        "-N", "-S", "-o", "-j", "-wd", "-l", "-r", "-w", "-pe", "-P", "-q", "-M", "-m", "-notify", "-hold_jid",
    },
}  # fmt: skip
PREFIX = {"slurm": "#SBATCH", "gridengine": "#$"}
#: What the two fields designed to carry request data may hold (the job name from the correlation
#: id's key, and the validated e-mail): no white space, quote, control or shell character.
SAFE_KEY = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}|sha256-[0-9a-f]{64}")
SAFE_EMAIL = re.compile(r"[A-Za-z0-9._%+-]+@[A-Za-z0-9.-]+")
CLEAN_KEY = "cleanfuzzkey0123"
CLEAN_EMAIL = "clean.fuzz@example.org"

HOSTILE = [
    "#SBATCH --uid=0",
    "#$ -u root",
    "\n#SBATCH --wrap=id",
    "\n#$ -l h_rt=999:00:00",
    "x\n",
    "\r\n--uid=0",
    "$(id)",
    "`id`",
    "; rm -rf ~",
    "| sh",
    "&& id",
    "'",
    '"',
    "\\",
    "\x00",
    "\x1b[2J",
    "\u2028",
    "\x85",
    "..",
    "../../etc/passwd",
    "%2e%2e/%2e%2e",
    "%0a#SBATCH --uid=0",
    " --uid=0",
    "\t",
    "ünïcødé",
    "\ud800",
    "a@b.org",
    "0-06:00",
    "http://evil.example:81/x",
    "http://evil.example:81\\@127.0.0.1:80/x",
]

# --- the fuzz ----------------------------------------------------------------------------------

hostile_text = st.one_of(
    st.sampled_from(HOSTILE),
    st.text(max_size=30),
    # All of Unicode, with the characters that NFKC-normalise to '/', '@', ':' and the digits int() rejects.
    st.text(st.one_of(st.characters(), st.sampled_from(NASTY_CHARS)), max_size=30),
    st.tuples(st.text(max_size=8), st.sampled_from(HOSTILE), st.text(max_size=8)).map("".join),
)
valid_path = st.integers(0, 10**6).map(lambda i: f"/uploads/projects/p/resources/r{i}/original_file")
resource = st.one_of(
    valid_path,
    st.sampled_from(["http://127.0.0.1:8000", "https://rodan.example.org", "http://evil.example:81"]).flatmap(
        lambda base: st.text(max_size=20).map(lambda t: f"{base}/uploads/{t}")
    ),
    hostile_text.map(lambda t: f"/uploads/{t}"),
    hostile_text,
    # Malformed and bracketed hosts, bad ports, IDNA junk (tests/fuzz_messages.py).
    st.sampled_from(nasty_urls("127.0.0.1:8000")),
    st.sampled_from(["http://", "https://"]).flatmap(lambda scheme: hostile_text.map(lambda t: f"{scheme}{t}/x")),
)
junk_value = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(min_value=10**18, max_value=10**40),
    st.floats(allow_nan=True, allow_infinity=True),
    hostile_text,
    st.lists(st.integers(), max_size=2),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)
duration = st.tuples(st.integers(0, 999), st.integers(0, 25), st.integers(0, 61)).map(
    lambda t: f"{t[0]}-{t[1]:02d}:{t[2]:02d}"
)
VALID_SETTING: dict[str, st.SearchStrategy[Any]] = {
    "Maximum number of training epochs": st.integers(1, 100000),
    "Maximum number of samples per label": st.integers(100, 100_000_000),
    "Patch height": st.integers(16, 2048).map(lambda i: i * 4),
    "Patch width": st.integers(16, 2048).map(lambda i: i * 4),
    "Maximum time (D-HH:MM)": duration,
    "Maximum memory (MB)": st.integers(1024, 64_000_000),
    "CPUs": st.integers(1, 4096),
    "Slurm Notification Email": st.sampled_from(["", "a@b.org", "first.last+hpc@mail.ex-ample.co.uk", "x%y@h.io"]),
    "Batch size": st.integers(1, 4096),
    "Patience": st.integers(1, 1000),
}
assert set(VALID_SETTING) == set(SETTING_FIELDS)


@st.composite
def request_dicts(draw: st.DrawFn) -> Any:
    """Mostly well-formed requests of both generations, each with a few hostile mutations."""
    if draw(st.booleans()):
        names = ["Image", "Background", "Selected Regions", *OLD_LAYERS]
    else:
        n = draw(st.integers(0, MAX_NEW_LAYERS + 1))
        names = ["Image", "Background", "Selected Regions", *(f"{NEW_LAYER_PREFIX}{i}" for i in range(n))]
    names = list(dict.fromkeys(names))
    if draw(st.integers(0, 9)) == 0:
        names.remove(draw(st.sampled_from(names)))
    if draw(st.integers(0, 9)) == 0:
        names.append(draw(st.one_of(hostile_text, st.sampled_from(NASTY_NAMES))))
    if draw(st.integers(0, 19)) == 0:  # a numbered layer's name replaced by a look-alike ('Layer \u00b2')
        numbered = [n for n in names if n.startswith(NEW_LAYER_PREFIX)]
        if numbered:
            names[names.index(draw(st.sampled_from(numbered)))] = draw(st.sampled_from(NASTY_NAMES))
    inputs = {name: draw(resource) if draw(st.integers(0, 39)) >= 36 else draw(valid_path) for name in names}
    chosen: dict[str, Any] = {}
    for name, valid in VALID_SETTING.items():
        roll = draw(st.integers(0, 39))
        if roll < 20:
            chosen[name] = draw(valid)
        elif roll < 21:
            chosen[name] = draw(junk_value)
        elif roll < 22:
            chosen[name] = draw(hostile_text)
    if draw(st.integers(0, 19)) == 0:
        chosen[draw(hostile_text)] = draw(junk_value)
    body: dict[str, Any] = {"inputs": inputs, "settings": chosen}
    roll = draw(st.integers(0, 29))
    if roll == 0:
        body["settings"] = draw(junk_value)
    elif roll == 1:
        body["inputs"] = draw(junk_value)
    elif roll == 2:
        del body["settings"]
    elif roll == 3:
        body[draw(hostile_text)] = draw(junk_value)
    return body


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | hostile_text,
    lambda children: st.lists(children, max_size=3) | st.dictionaries(hostile_text, children, max_size=3),
    max_leaves=8,
)
bodies = st.one_of(
    request_dicts().map(lambda d: json.dumps(d).encode("utf-8")),
    request_dicts().map(lambda d: json.dumps(d).encode("utf-8")),
    request_dicts().map(lambda d: json.dumps(d).encode("utf-8")),
    request_dicts().map(lambda d: json.dumps(d, ensure_ascii=False).encode("utf-8", "surrogatepass")),
    json_values.map(lambda v: json.dumps(v).encode("utf-8")),
    st.binary(max_size=200),
)
# AMQP short strings (<= 255 bytes): a correlation id is usually a uuid, but anything can arrive.
amqp_strings = st.one_of(
    st.uuids().map(str),
    hostile_text,
    st.text(min_size=1, max_size=80),
    # A key the spool keeps as is, plus one trailing line break (what '$' in a pattern lets through).
    st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._-]{0,20}[\n\r]", fullmatch=True),
)


def make_config(spool: Path, scheduler: str, **extra: str) -> BridgeConfig:
    env = {
        "RABBITMQ_URL": "amqp://guest:guest@127.0.0.1:5672/%2F",
        "RODAN_HOST": "127.0.0.1:8000",
        "RODAN_SCHEME": "http",
        "RODAN_USER": RODAN_EMAIL,
        "RODAN_PASSWORD": RODAN_PASSWORD,
        "HPC_SPOOL_DIR": str(spool),
        "HPC_WORKER_PYTHON": sys.executable,
        "HPC_SCHEDULER": scheduler,
        "HPC_GPU_RULES": "gpu:1",
        # Every optional directive a site may turn on, so that all of them are exercised.
        "HPC_SLURM_ACCOUNT": "def-lab",
        "HPC_SLURM_PARTITION": "gpu",
        "HPC_SGE_PROJECT": "lab",
        "HPC_SGE_QUEUE": "all.q",
        "HPC_WARN_SECONDS": "300",
    }
    env.update(extra)
    return load_config(environ=env)


class Renderer:
    """The production path from an accepted request to its batch script, for one backend."""

    def __init__(self, spool: Path, name: str) -> None:
        self.name = name
        self.config = make_config(spool, name)
        self.scheduler: Scheduler = SlurmScheduler() if name == "slurm" else GridEngineScheduler()
        self.intake = Intake(self.config, Spool(spool), cast(Ledger, None), self.scheduler, cast(RodanClient, None),
                             cast(ReplyBox, None))  # fmt: skip

    def script(self, request: JobRequest) -> str:
        return self.scheduler.render(self.intake.job_spec(request, safe_key(request.correlation_id)))

    def clean_script(self, request: JobRequest, *, keep_placeholders: bool = False) -> str:
        """The script of a clean request of the same shape, with the key and e-mail put back."""
        email = request.settings.notification_email
        clean = replace(
            request,
            correlation_id=CLEAN_KEY,
            settings=replace(request.settings, notification_email=CLEAN_EMAIL if email else ""),
        )
        text = self.scheduler.render(self.intake.job_spec(clean, CLEAN_KEY))
        if keep_placeholders:
            return text
        return text.replace(CLEAN_KEY, safe_key(request.correlation_id)).replace(CLEAN_EMAIL, email)


def check_script(renderer: Renderer, request: JobRequest, script: str) -> None:
    """The assertions every rendered script must pass."""
    # No control character, nothing but ASCII: no newline of the request's can split a line.
    assert script.isascii(), "non-ASCII text reached the batch script"
    assert not [c for c in script if (ord(c) < 32 and c != "\n") or c == "\x7f"], "control character in the script"
    # The script of a clean request of the same shape, byte for byte, but for the two fields
    # designed to carry request data: no request string anywhere else, no injected line.
    assert script == renderer.clean_script(request)
    assert len(script.splitlines()) == len(renderer.clean_script(request, keep_placeholders=True).splitlines())
    prefix = PREFIX[renderer.name]
    key = safe_key(request.correlation_id)
    assert SAFE_KEY.fullmatch(key), key
    email = request.settings.notification_email
    assert not email or SAFE_EMAIL.fullmatch(email), email
    directives = [line for line in script.splitlines() if line.startswith(prefix)]
    for line in directives:
        words = line[len(prefix) + 1 :].split(" ")
        option = words[0].split("=", 1)[0]
        assert option in ALLOWED_OPTIONS[renderer.name], line
        if renderer.name == "slurm":
            assert len(words) == 1, line  # --option=value, one word
        else:
            assert len(words) <= (3 if option == "-pe" else 2), line
    # Every '#SBATCH' / '#$' text in the script is one of those directive lines.
    assert sum(line.lstrip().startswith(("#SBATCH", "#$")) for line in script.splitlines()) == len(directives)


@pytest.mark.slow  # HPC_FUZZ_EXAMPLES generated requests (2 000: 5 s alone on 2 cores)
def test_fuzzed_requests_never_crash_nor_inject(tmp_path: Path) -> None:
    renderers = [Renderer(tmp_path / "spool", "slurm"), Renderer(tmp_path / "spool", "gridengine")]
    stats: Counter[str] = Counter()

    @settings(
        max_examples=FUZZ_EXAMPLES,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
    )
    @given(body=bodies, correlation_id=amqp_strings, reply_to=amqp_strings)
    def one(body: bytes, correlation_id: str, reply_to: str) -> None:
        stats["generated"] += 1
        try:
            request = parse_request(body, correlation_id=correlation_id, reply_to=reply_to)
        except InvalidRequest as exc:
            assert str(exc)
            stats["refused"] += 1
            return
        stats["accepted"] += 1
        for renderer in renderers:
            try:
                script = renderer.script(request)
            except ValueError as exc:
                # Documented: a value that must never reach a script is refused (Intake: an error reply).
                # Only a correlation id that its key keeps as is may hold such a value.
                assert "refusing unsafe value" in str(exc)
                assert not SAFE_KEY.fullmatch(safe_key(correlation_id))
                stats[f"{renderer.name}_refused_at_render"] += 1
                continue
            check_script(renderer, request, script)
            stats[f"{renderer.name}_rendered"] += 1

    started = time.monotonic()
    one()
    elapsed = time.monotonic() - started
    print(f"\nfuzz: {dict(stats)} in {elapsed:.1f} s")
    assert stats["generated"] >= FUZZ_EXAMPLES
    # The fuzz reaches the renderers, not only the validator.
    assert stats["slurm_rendered"] >= FUZZ_EXAMPLES // 20 and stats["gridengine_rendered"] >= FUZZ_EXAMPLES // 20


# --- hand-written attacks ------------------------------------------------------------------------

PAGE = {
    "Image": "/uploads/projects/p/resources/img/original_file",
    "Background": "/uploads/projects/p/resources/bg/original_file",
    "Selected Regions": "/uploads/projects/p/resources/sel/original_file",
    "rgba PNG - Layer 0": "/uploads/projects/p/resources/l0/original_file",
}


def body(inputs: dict[str, str] | None = None, settings: dict[str, Any] | None = None) -> bytes:
    return json.dumps({"inputs": inputs or PAGE, "settings": {**FAST_SETTINGS, **(settings or {})}}).encode()


def parse(data: bytes, correlation_id: str = "corr-1") -> JobRequest:
    return parse_request(data, correlation_id=correlation_id, reply_to="replies")


@pytest.fixture
def renderers(tmp_path: Path) -> list[Renderer]:
    return [Renderer(tmp_path / "spool", "slurm"), Renderer(tmp_path / "spool", "gridengine")]


SHELL_PAYLOADS = [
    "$(id)",
    "`id`",
    "; id",
    "| id",
    "&& id",
    "a'b",
    'a"b',
    "a\\b",
    "a b",
    "x\n",
    "x\n#SBATCH --uid=0",
    "x\n#$ -u root",
    "x\r",
    "#SBATCH --uid=0",
    "#$ -u root",
    "x\x00",
]
STRING_SETTINGS = {
    "Maximum time (D-HH:MM)": ("0-06:00", "must look like 0-06:00"),
    "Slurm Notification Email": ("a@b.org", "is not an e-mail address"),
}


@pytest.mark.parametrize("payload", SHELL_PAYLOADS)
@pytest.mark.parametrize("setting", sorted(STRING_SETTINGS))
def test_shell_metacharacters_and_newlines_in_string_settings_are_refused(setting: str, payload: str) -> None:
    good, message = STRING_SETTINGS[setting]
    for value in (payload, good + payload, payload + good):
        with pytest.raises(InvalidRequest, match=f"{re.escape(message)}|is too long"):
            parse(body(settings={setting: value}))


@pytest.mark.parametrize("payload", SHELL_PAYLOADS)
def test_strings_in_number_settings_are_refused(payload: str) -> None:
    for setting, (_attr, schema) in SETTING_FIELDS.items():
        if schema["type"] == "integer":
            with pytest.raises(InvalidRequest, match="must be of type integer"):
                parse(body(settings={setting: "8" + payload}))


def test_trailing_newline_never_passes_validation() -> None:
    """Regression: '$' in the e-mail and duration patterns accepted a trailing newline, which went
    into '#SBATCH --mail-user=...' / '#$ -M ...'."""
    with pytest.raises(InvalidRequest, match="e-mail"):
        parse(body(settings={"Slurm Notification Email": "a@b.org\n"}))
    with pytest.raises(InvalidRequest, match="0-06:00"):
        parse(body(settings={"Maximum time (D-HH:MM)": "0-06:00\n"}))
    with pytest.raises(InvalidRequest, match="0-06:00"):
        parse(body(settings={"Maximum time (D-HH:MM)": "\u0660-\u0660\u0666:\u0660\u0660"}))  # Arabic-Indic digits


def test_directive_injection_in_input_paths_and_correlation_id(renderers: list[Renderer]) -> None:
    # A path may hold such text (it only ever goes to the job's parameter file, never to the script).
    odd_path = "/uploads/#SBATCH --uid=0 $(id) `id`; #$ -u root/original_file"
    for corr in ("#SBATCH --uid=0", "#$ -u root", "a\n#SBATCH --uid=0", "$(id)", "../../etc/cron.d/x", "ok-id-1"):
        request = parse(body({**PAGE, "Image": odd_path}), correlation_id=corr)
        for renderer in renderers:
            script = renderer.script(request)
            check_script(renderer, request, script)
            assert "--uid" not in script and "-u root" not in script and "(id)" not in script
    # A newline in a path is refused before anything is written.
    with pytest.raises(InvalidRequest, match="control characters"):
        parse(body({**PAGE, "Image": "/uploads/x\n#SBATCH --uid=0"}))
    # An injection attempt as an input *name* is an unknown input.
    with pytest.raises(InvalidRequest, match="unknown input"):
        parse(body({**PAGE, "#SBATCH --uid=0": "/uploads/x"}))


def test_correlation_id_with_a_trailing_newline_is_hashed_into_a_safe_key(renderers: list[Renderer]) -> None:
    """Regression: keys were checked with '$', so 'abc\\n' was its own key and 'rodan-abc\\n' reached
    '#SBATCH --job-name=' with its newline (then refused at render). The key is now a hash of it."""
    request = parse(body(), correlation_id="abc\n")
    key = safe_key("abc\n")
    assert key.startswith("sha256-") and key.isascii() and "\n" not in key
    for renderer in renderers:
        script = renderer.script(request)
        check_script(renderer, request, script)
        assert f"rodan-{key}" in script and "abc\n" not in script


def test_correlation_id_with_a_trailing_newline_keeps_a_safe_ledger_file(tmp_path: Path) -> None:
    """The same through the real ledger: the file name is the hashed key, the id is kept inside."""
    spool = Spool(tmp_path / "spool").ensure()
    ledger = Ledger(spool)
    record = ledger.open("abc\n", "replies")
    ledger.save(record)
    (path,) = (spool.root / "ledger").iterdir()
    assert path.name == safe_key("abc\n") + ".json" and record.correlation_id == "abc\n"


def test_path_traversal_in_input_names_and_paths_is_refused() -> None:
    for path in (
        "/uploads/../etc/passwd",
        "/uploads/projects/../../x",
        "/uploads/%2e%2e/etc/passwd",
        "/uploads/%2E%2E/%2e%2E/x",
        "/uploads/..\\..\\etc/passwd",
        "http://127.0.0.1:8000/uploads/../x",
        "http://127.0.0.1:8000/uploads/%2e%2e/x",
    ):
        with pytest.raises(InvalidRequest, match=r"'\.\.' path segment"):
            parse(body({**PAGE, "Image": path}))
    for name in ("../Image", "Image/../Image", "rgba PNG - Layer ../0", "rgba PNG - Layer 0/.."):
        with pytest.raises(InvalidRequest, match="unknown input"):
            parse(body({**PAGE, name: "/uploads/x"}))
    # Dots that are not a segment are just names.
    assert parse(body({**PAGE, "Image": "/uploads/a..b/..."})).inputs["Image"] == "/uploads/a..b/..."


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b"1" * 5000, "not valid JSON"),  # more digits than Python converts (was a ValueError crash)
        (b"-" + b"9" * 4400, "not valid JSON"),
        (b"1" * 4000, "must be <= 4096"),
        (b"100000000000000000000000000000", "must be <= 4096"),
        (b"1e308", "must be <= 4096"),  # an integral float is an integer to JSON Schema
        (b"1e999", "must be of type integer"),  # Infinity
        (b"NaN", "must be of type integer"),
        (b"-Infinity", "must be of type integer"),
        (b"-1", "must be >= 1"),
        (b"4.5", "must be of type integer"),
        (b"true", "must be of type integer"),
    ],
)
def test_huge_and_odd_numbers_are_refused(raw: bytes, message: str) -> None:
    data = b'{"inputs": ' + json.dumps(PAGE).encode() + b', "settings": {"CPUs": ' + raw + b"}}"
    with pytest.raises(InvalidRequest, match=message):
        parse(data)


def test_integral_floats_become_integers() -> None:
    request = parse(body(settings={"CPUs": 2.0, "Maximum number of training epochs": 1e3}))
    assert request.settings.cpus == 2 and type(request.settings.cpus) is int
    assert request.settings.epochs == 1000 and type(request.settings.epochs) is int


def test_deep_nesting_and_enormous_bodies_are_refused() -> None:
    for data in (b"[" * 100_000 + b"]" * 100_000, b'{"a":' * 100_000 + b"1" + b"}" * 100_000):
        with pytest.raises(InvalidRequest, match="nested too deeply"):  # was a RecursionError crash
            parse(data)
    with pytest.raises(InvalidRequest, match=f"more than the {MAX_BODY_BYTES} allowed"):
        parse(body() + b" " * MAX_BODY_BYTES)
    head, tail = b'{"inputs": {}, "pad": "', b'"}'
    exactly = head + b"x" * (MAX_BODY_BYTES - len(head) - len(tail)) + tail
    with pytest.raises(InvalidRequest, match="missing inputs"):  # 1 MiB exactly is read, and judged on its content
        parse(exactly)
    with pytest.raises(InvalidRequest, match="not valid JSON"):
        parse(b"\xff\xfe{}")


@pytest.mark.parametrize("name", NASTY_NAMES, ids=lambda name: ascii(name)[:40])
def test_look_alike_input_names_are_refused_never_crash(name: str) -> None:
    """Regression: 'rgba PNG - Layer \u00b2' passed str.isdigit() and crashed int() with a
    ValueError that no layer of the pass caught (so did a 5,000-digit layer number). Parsing raises
    nothing but InvalidRequest; none of these names is one of Rodan's."""
    inputs = dict(PAGE)
    if name.startswith(NEW_LAYER_PREFIX):
        inputs[name] = inputs.pop(f"{NEW_LAYER_PREFIX}0")
    else:
        inputs[name] = "/uploads/x"
    with pytest.raises(InvalidRequest):
        parse(json.dumps({"inputs": inputs, "settings": FAST_SETTINGS}).encode())


@pytest.mark.parametrize("url", nasty_urls("127.0.0.1:8000"), ids=lambda url: ascii(url)[:60])
def test_malformed_urls_never_crash_the_parser(url: str) -> None:
    """Regression: 'http://[::1', 'http://[zz]/x' and hosts with characters that NFKC-normalise
    to '/', '@' or ':' (U+FF0F, U+FF20, U+FF1A...) made urlsplit raise ValueError out of check_resource.
    Whatever the resource value, parsing accepts it or raises InvalidRequest, nothing else."""
    try:
        request = parse(body({**PAGE, "Image": url}))
    except InvalidRequest as exc:
        assert str(exc)
    else:
        assert request.inputs["Image"] == url


# --- URLs to other hosts: the token goes to the Rodan host only --------------------------------------


@pytest.fixture
def two_hosts(tmp_path: Path) -> Any:
    (tmp_path / "rodan" / "projects").mkdir(parents=True)
    (tmp_path / "rodan" / "projects" / "f.bin").write_bytes(b"rodan" * 100)
    (tmp_path / "other" / "projects").mkdir(parents=True)
    (tmp_path / "other" / "projects" / "f.bin").write_bytes(b"other" * 100)
    with RodanStandin(tmp_path / "rodan", users=[User(RODAN_EMAIL, "hpc", RODAN_PASSWORD)]) as rodan:
        with RodanStandin(tmp_path / "other") as other:
            yield rodan, other


def test_urls_to_other_hosts_never_get_the_token(two_hosts: Any, tmp_path: Path) -> None:
    """Inputs come only from Rodan: a URL whose host is not Rodan's, by any
    parser's reading, is refused by ``parse_request`` given Rodan's origin, and by the real download
    client (as the worker uses it); a second loopback server records that it received nothing at all,
    so never the token. Regression: 'http://OTHER\\@RODAN/' passed urlsplit's origin check as Rodan,
    and urllib3 connected to OTHER with the token; before that, URLs to other hosts were fetched
    (without the token)."""
    rodan, other = two_hosts
    client = RodanClient(rodan.url, user="hpc", email=RODAN_EMAIL, password=RODAN_PASSWORD, retries=0)
    token = client.get_token()
    assert token == token_for_email(RODAN_EMAIL)
    port = rodan.port
    foreign = [
        f"{other.url}/uploads/projects/f.bin",
        f"http://localhost:{other.port}/uploads/projects/f.bin",
        f"http://{other.host_port}/uploads/projects/f.bin#@127.0.0.1:{port}",
        f"http://{other.host_port}/uploads/projects/f.bin?@127.0.0.1:{port}/",
        f"//{other.host_port}/uploads/projects/f.bin",  # a network-path reference: another host
        f"http://{other.host_port}\\@127.0.0.1:{port}/uploads/projects/f.bin",
        f"http://127.0.0.1:{port}\\@{other.host_port}/uploads/projects/f.bin",
        f"http://127.0.0.1:{port}@{other.host_port}/uploads/projects/f.bin",
        f"http://user:pw@{other.host_port}/uploads/projects/f.bin",
        f"http://{other.host_port} @127.0.0.1:{port}/uploads/projects/f.bin",
        f"http://{other.host_port}\t/uploads/projects/f.bin",
        f"http://{other.host_port}\uff0f@127.0.0.1:{port}/uploads/projects/f.bin",
        f"http://127.0.0.1:{port}\uff20{other.host_port}/uploads/projects/f.bin",
        f"ftp://{other.host_port}/uploads/projects/f.bin",
        "http:///uploads/projects/f.bin",
        f"http://[::1]:{other.port}/uploads/projects/f.bin",
        f"http://127.0.0.1:{other.port}/uploads/projects/f.bin",
    ]
    for url in foreign:
        with pytest.raises(InvalidRequest):
            parse_request(body({**PAGE, "Image": url}), correlation_id="c", reply_to="r", rodan_origin=rodan.url)
        other.clear_requests()
        rodan.clear_requests()
        with pytest.raises(PermanentError):
            client.download(url, tmp_path / "dl", max_bytes=1 << 20)
        assert not other.requests and not rodan.requests, url
    # The Rodan host itself, by path or by its own URL, does get the token.
    for resource in ("/uploads/projects/f.bin", f"{rodan.url}/uploads/projects/f.bin"):
        parse_request(body({**PAGE, "Image": resource}), correlation_id="c", reply_to="r", rodan_origin=rodan.url)
        rodan.clear_requests()
        client.download(resource, tmp_path / "dl", max_bytes=1 << 20)
        assert [r.authorization for r in rodan.requests] == [f"Token {token}"]
    assert not other.requests


# --- through the real intake with the broker ----------------------------------------------------------


@pytest.mark.broker
def test_unanswerable_and_enormous_messages_through_the_real_intake(
    broker_url: str, standin: RodanStandin, queues: Queues, rodan: Rodan, tmp_path: Path
) -> None:
    """No correlation_id (or neither property): dead-lettered, no reply (there is nobody to reply to).
    A body over 1 MiB with both properties: one error reply, and a dead-lettered copy.
    (No reply_to alone is covered by tests/test_e2e.py::test_invalid_requests_get_one_error_and_are_dead_lettered.)
    Nothing is submitted: the worker is one that cannot exist."""
    env = bridge_environ(
        broker_url, standin, queues, tmp_path / "spool", HPC_WORKER_PYTHON="/nonexistent/python3",
        HPC_LOG_FILE=str(tmp_path / "bridge.log"),
    )  # fmt: skip
    rodan.publish(body(), correlation_id="")
    rodan.publish(body(), correlation_id="", reply_to=None)
    enormous = rodan.publish(b'{"inputs": {}, "pad": "' + b"#SBATCH --uid=0\n" * (MAX_BODY_BYTES // 16 + 1) + b'"}')
    result = run_bridge(env, "check")
    assert result.returncode == 0, result.stderr[-2000:]
    replies = rodan.drain()
    assert [corr for corr, _data, _headers in replies] == [enormous]
    assert f"more than the {MAX_BODY_BYTES} allowed" in json.loads(replies[0][1])["error"]
    dead = rodan.drain(queues.dead)
    reasons = sorted(headers["x-hpc-bridge-reason"] for _corr, _body, headers in dead)
    assert len(dead) == 3
    assert sum(bool(re.search(r"no (usable )?correlation_id", r)) for r in reasons) == 2
    assert sum("more than" in r for r in reasons) == 1
    assert rodan.depth(queues.request) == 0
    ledger = tmp_path / "spool" / "ledger"
    assert [json.loads(p.read_text())["job_id"] for p in ledger.glob("*.json")] == [""]
