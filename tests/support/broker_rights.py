"""RabbitMQ accounts with exactly the rights the guides give, for the tests.

The rights are read from the guides themselves (:func:`documented_rights`): the ```sh blocks of
``docs/rodan-guide.md`` and ``rodan_job/README.md`` that hold
``rabbitmqctl set_permissions -p VHOST USER 'CONFIGURE' 'WRITE' 'READ'`` for the bridge's account
(:data:`BRIDGE_USER`) and the Rodan 3.x job's (:data:`JOB_USER`), so a guide that changes its rights
changes what the tests run under. :func:`rights_vhost` makes a vhost of the test's own with both
accounts in it (unique names, random passwords, never on a command line) and removes them afterwards.
``rabbitmqctl`` must work on this machine (the tests' broker is the local one). Each ``rabbitmqctl``
starts an Erlang VM (about 0.6 s of CPU), so the vhost, the accounts and their rights are made in one
call, ``import_definitions`` of definitions that hold the passwords only as RabbitMQ stores them
(salted SHA-256) and go on its standard input, instead of six.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import json
import re
import secrets
import subprocess
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import ModuleType
from urllib.parse import quote, urlsplit, urlunsplit

import pika

from tests.support.wait import wait_until

REPO = Path(__file__).resolve().parents[2]
#: The guides that give the rights, each both accounts' line.
GUIDES = (REPO / "docs" / "rodan-guide.md", REPO / "rodan_job" / "README.md")
BRIDGE_USER = "hpc-bridge"
JOB_USER = "rodan-hpc"
RIGHTS = ("configure", "write", "read")
_SET_PERMISSIONS = re.compile(r"rabbitmqctl set_permissions -p (\S+) (\S+) '([^']*)' '([^']*)' '([^']*)'\s*$")
_SH_BLOCK = re.compile(r"^[ \t]*```sh\n(.*?)^[ \t]*```", re.MULTILINE | re.DOTALL)


@dataclass(frozen=True)
class Rights:
    """One account's rights on a vhost: the configure, write and read patterns."""

    configure: str
    write: str
    read: str

    def with_right(self, right: str, pattern: str) -> Rights:
        """These rights with ``right`` (configure, write or read) set to ``pattern``."""
        if right not in RIGHTS:
            raise ValueError(right)
        return replace(self, **{right: pattern})


@dataclass(frozen=True)
class Documented:
    """What a guide's block says: the vhost, and each account's rights."""

    vhost: str
    rights: dict[str, Rights]


def documented_rights(path: Path) -> Documented:
    """The ``set_permissions`` lines of ``path``'s ```sh blocks; fails, naming the guide, unless
    there is exactly one line for each of the two accounts, on one vhost."""
    text = path.read_text(encoding="utf-8")
    found: dict[str, tuple[str, Rights]] = {}
    for block in _SH_BLOCK.findall(text):
        for line in block.splitlines():
            match = _SET_PERMISSIONS.search(line)
            if match is None:
                continue
            vhost, user, configure, write, read = match.groups()
            if user in found:
                raise AssertionError(f"{path.relative_to(REPO)}: two set_permissions lines for {user!r}")
            found[user] = (vhost, Rights(configure, write, read))
    wanted = {BRIDGE_USER, JOB_USER}
    if set(found) != wanted:
        raise AssertionError(
            f"{path.relative_to(REPO)}: expected a ```sh block with one line "
            "`rabbitmqctl set_permissions -p VHOST USER 'CONFIGURE' 'WRITE' 'READ'` for each of "
            f"{sorted(wanted)}; found lines for {sorted(found)}"
        )
    vhosts = {vhost for vhost, _ in found.values()}
    if len(vhosts) != 1:
        raise AssertionError(f"{path.relative_to(REPO)}: the two accounts are on different vhosts {sorted(vhosts)}")
    return Documented(vhosts.pop(), {user: rights for user, (_, rights) in found.items()})


def ctl(*args: str, stdin: str | None = None, allow_missing: bool = False) -> None:
    """``rabbitmqctl -q ARGS`` (a secret goes on ``stdin``, never in ``args``); with ``allow_missing``,
    deleting what does not exist is no failure."""
    done = subprocess.run(
        ["rabbitmqctl", "-q", *args], input=stdin, capture_output=True, text=True, timeout=120, check=False
    )
    if allow_missing and done.returncode != 0 and "does not exist" in done.stdout + done.stderr:
        return
    if done.returncode != 0:
        raise AssertionError(f"rabbitmqctl {args[0]} failed: {done.stdout[-500:]} {done.stderr[-500:]}")


def password_hash(password: str) -> str:
    """``password`` as RabbitMQ stores it (``rabbit_password_hashing_sha256``, its default): a 4-byte
    salt, then SHA-256 of the salt and the password, in base64."""
    salt = secrets.token_bytes(4)
    return base64.b64encode(salt + hashlib.sha256(salt + password.encode()).digest()).decode()


def import_definitions(definitions: dict[str, object]) -> None:
    """``rabbitmqctl import_definitions`` of ``definitions``, given on its standard input."""
    ctl("import_definitions", "--format", "json", stdin=json.dumps(definitions))


def can_log_in(url: str) -> bool:
    """Whether ``url``'s account can open a connection."""
    try:
        pika.BlockingConnection(pika.URLParameters(url)).close()
    except pika.exceptions.AMQPError:
        return False
    return True


def account_url(base_url: str, user: str, password: str, vhost: str) -> str:
    """``base_url``'s host and port with this user, password and vhost."""
    parts = urlsplit(base_url)
    netloc = f"{quote(user, safe='')}:{quote(password, safe='')}@{parts.hostname}"
    if parts.port:
        netloc += f":{parts.port}"
    return urlunsplit((parts.scheme, netloc, "/" + quote(vhost, safe=""), "", ""))


@dataclass
class RightsVhost:
    """A vhost of the test's own with the bridge's and the job's accounts (and the admin's)."""

    vhost: str
    admin_url: str = field(repr=False)
    bridge_url: str = field(repr=False)
    job_url: str = field(repr=False)
    bridge_user: str
    job_user: str

    def grant(self, user: str, rights: Rights) -> None:
        ctl("set_permissions", "-p", self.vhost, user, rights.configure, rights.write, rights.read)


@contextmanager
def rights_vhost(base_url: str, bridge: Rights, job: Rights, *, tag: str = "rights") -> Iterator[RightsVhost]:
    """A fresh vhost where the admin (``base_url``'s user) may do anything and two new accounts
    have ``bridge``'s and ``job``'s rights; vhost and accounts are deleted at the end."""
    suffix = uuid.uuid4().hex[:10]
    vhost = f"hpcb-{tag}-{suffix}"
    admin = urlsplit(base_url).username or "guest"
    users = {BRIDGE_USER: f"{BRIDGE_USER}-{suffix}", JOB_USER: f"{JOB_USER}-{suffix}"}
    passwords = {name: secrets.token_urlsafe(18) for name in users.values()}
    granted = {admin: Rights(".*", ".*", ".*"), users[BRIDGE_USER]: bridge, users[JOB_USER]: job}
    try:
        import_definitions(
            {
                "vhosts": [{"name": vhost}],
                "users": [
                    {
                        "name": name,
                        "password_hash": password_hash(password),
                        "hashing_algorithm": "rabbit_password_hashing_sha256",
                        "tags": [],
                    }
                    for name, password in passwords.items()
                ],
                "permissions": [
                    {"user": user, "vhost": vhost, **{right: getattr(rights, right) for right in RIGHTS}}
                    for user, rights in granted.items()
                ],
            }
        )
        box = RightsVhost(
            vhost,
            account_url(base_url, admin, urlsplit(base_url).password or "guest", vhost),
            account_url(base_url, users[BRIDGE_USER], passwords[users[BRIDGE_USER]], vhost),
            account_url(base_url, users[JOB_USER], passwords[users[JOB_USER]], vhost),
            users[BRIDGE_USER],
            users[JOB_USER],
        )
        for url in (box.bridge_url, box.job_url):  # the CLI says an import "can take some time"
            wait_until(lambda url=url: can_log_in(url), 30, 0.2, what="an imported account's first login")
        yield box
    finally:
        # Whatever the import made (all or nothing, but a failed one is not trusted to have made nothing).
        for name in passwords:
            ctl("delete_user", name, allow_missing=True)
        ctl("delete_vhost", vhost, allow_missing=True)


def load_relay() -> ModuleType:
    """The job package's ``hpc_relay`` (Python 3.7 code that runs here as well: pika is in the
    .venv), loaded from its file as Rodan's worker imports it, without Rodan."""
    name = "hpc_relay_under_test"
    if name in sys.modules:
        return sys.modules[name]
    path = REPO / "rodan_job" / "hpc_paco_trainer" / "hpc_relay.py"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
