#!/usr/bin/env python3
"""Follow docs/operator-guide.md exactly, as a newcomer would, on this machine (development only).

Run as root on a machine set up by deploy/dev/setup.sh (RabbitMQ, Slurm, cron)::

    python3 deploy/dev/follow_guide.py --settings settings.json [--user hpcguide] [--section Install]

It makes a fresh unprivileged account (deleting an old one of that name and everything it owns),
starts cron if it is not running, builds a wheel of this working tree (uncommitted and untracked
files included, ignored ones not) where the account can read it, and then runs every ```bash block
of the guide's chosen sections, in order, as that account in a login shell, with
``set -euo pipefail``. A failing block stops the run (exit 1) with its output.

What the guide leaves to the reader is given here:

- ``HPC_BRIDGE_SOURCE``: the wheel's path (what the reader downloads from a release);
- with ``--wheelhouse DIR``, a site's pip configuration (``~/.config/pip/pip.conf``: no index,
  find links in DIR, no byte-compiling at install), as on a cluster whose login node installs from
  a local wheelhouse: the guide's ``pip install`` lines run unchanged and copy local wheels instead
  of downloading (Python compiles the modules it imports when it first imports them: TensorFlow's
  install takes half the CPU time, 6 s instead of 13 s on 2 cores of an Intel Xeon);
- ``EDITOR``: a non-interactive editor that types the settings of ``--settings`` (a JSON object
  NAME -> value) into credentials.env the way a person would: a ``NAME=`` or ``# NAME=`` line is
  replaced, anything else is appended.

``--cleanup`` removes the account, its crontab, its processes and its scheduler jobs instead.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GUIDE = ROOT / "docs" / "operator-guide.md"
STATE = Path("/var/lib/hpc-bridge-dev/follow-guide")
FENCE = re.compile(r"^```bash\n(.*?)^```$", re.MULTILINE | re.DOTALL)

EDITOR = '''#!/usr/bin/env python3
"""Types the settings in $GUIDE_SETTINGS into the file given (what a person does in an editor)."""
import json, os, re, sys
path = sys.argv[-1]
settings = json.load(open(os.environ["GUIDE_SETTINGS"]))
lines = open(path).read().splitlines()
for name, value in settings.items():
    pattern = re.compile(r"^#? ?" + re.escape(name) + "=")
    for i, line in enumerate(lines):
        if pattern.match(line):
            lines[i] = f"{name}={value}"
            break
    else:
        lines.append(f"{name}={value}")
open(path, "w").write("\\n".join(lines) + "\\n")
'''


def say(text: str) -> None:
    print(f"[follow_guide {time.strftime('%H:%M:%S')}] {text}", flush=True)


def run(argv: list[str], timeout: float = 120, check: bool = True, **kw: object) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, **kw)  # type: ignore[call-overload]
    if check and result.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed ({result.returncode}):\n{result.stdout}{result.stderr}")
    return result  # type: ignore[no-any-return]


def blocks(guide: Path, sections: list[str]) -> list[tuple[str, str]]:
    """(section title, code) of every ```bash block under the '## ' sections named (all if none)."""
    out: list[tuple[str, str]] = []
    parts = re.split(r"^## (.+)$", guide.read_text(), flags=re.MULTILINE)
    for title, body in zip(parts[1::2], parts[2::2], strict=True):
        if not sections or title.strip() in sections:
            out.extend((title.strip(), match.group(1)) for match in FENCE.finditer(body))
    return out


def build_wheel(dest: Path) -> Path:
    """A wheel of the working tree (tracked and untracked files, not ignored ones) in ``dest``."""
    listed = run(["git", "-C", str(ROOT), "ls-files", "-z", "--cached", "--others", "--exclude-standard"])
    for old in dest.glob("*.whl"):
        old.unlink()
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "tree"
        for name in filter(None, listed.stdout.split("\0")):
            source = ROOT / name
            if source.is_file():  # a deleted file is still listed until committed
                (tree / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(source, tree / name)  # links followed: the wheel holds their content
        run(
            [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(dest), "."],
            cwd=tree,
            timeout=600,
        )
    [wheel] = dest.glob("*.whl")
    return wheel


def given_dir(user: str) -> Path:
    """Where the reader's inputs for ``user`` live (a root-owned parent, so nobody else can plant them)."""
    return STATE / user


def user_exists(user: str) -> bool:
    return run(["id", "-u", user], check=False).returncode == 0


def cleanup(user: str) -> None:
    """Remove ``user``'s crontab, jobs, processes and account; its home goes in the background.

    The home holds two or three environments with TensorFlow (tens of thousands of files):
    deleting them took over two minutes once on a loaded CI machine. So the home is renamed
    aside (one rename, same directory) and deleted by a detached ``rm``; a later clean-up
    also removes what an interrupted one left.
    """
    if user_exists(user):
        home = Path(run(["getent", "passwd", user]).stdout.split(":")[5])
        run(["crontab", "-r", "-u", user], check=False)
        for cancel in (["scancel", "-u", user], ["qdel", "-u", user]):
            if shutil.which(cancel[0]):
                run(cancel, check=False)
        run(["pkill", "-KILL", "-u", user], check=False)
        time.sleep(0.5)
        if home.is_dir() and home != Path("/"):
            home.rename(home.parent / f".{home.name}.removing-{time.time_ns()}")
        run(["userdel", "-f", user], check=False)
        Path(f"/var/mail/{user}").unlink(missing_ok=True)
        say(f"account {user} removed")
    shutil.rmtree(given_dir(user), ignore_errors=True)
    leftovers = [str(p) for p in Path("/home").glob(f".{user}.removing-*")]
    if leftovers:
        subprocess.Popen(
            ["rm", "-rf", "--", *leftovers],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        say(f"deleting {len(leftovers)} old home(s) in the background")


def write_pip_conf(home: Path, user: str, wheelhouse: Path) -> None:
    """The site's pip configuration in ``user``'s home: every pip run installs from ``wheelhouse`` alone."""
    if not any(wheelhouse.glob("*.whl")):
        raise SystemExit(f"--wheelhouse {wheelhouse}: no wheel there (deploy/dev/setup.sh fills var/wheelhouse)")
    conf = home / ".config" / "pip" / "pip.conf"
    conf.parent.mkdir(parents=True, exist_ok=True)
    # pip reads "compile", not "no-compile" (which it would take the other way round).
    conf.write_text(f"[global]\nno-index = true\nfind-links = {wheelhouse}\n[install]\ncompile = false\n")
    run(["chown", "-R", f"{user}:{user}", str(home / ".config")])
    say(f"pip of {user} installs from {wheelhouse} only")


def ensure_cron() -> None:
    if shutil.which("cron") is None and not Path("/usr/sbin/cron").exists():
        say("installing cron")
        run(
            ["apt-get", "install", "-y", "-qq", "cron"],
            timeout=600,
            env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"},
        )
    if run(["pgrep", "-x", "cron"], check=False).returncode != 0:
        run(["/usr/sbin/cron"])  # no systemd here: it daemonizes itself
        say("cron started")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--user", default="hpcguide", help="the account to create (default hpcguide)")
    parser.add_argument("--settings", type=Path, help="JSON object of credentials.env settings to type in")
    parser.add_argument(
        "--section", action="append", default=[], help="a '## ' section to follow (repeatable; default all)"
    )
    parser.add_argument(
        "--wheelhouse", type=Path, help="the account's pip installs from this folder only (a site's pip.conf)"
    )
    parser.add_argument("--cleanup", action="store_true", help="remove the account and everything it left, then exit")
    parser.add_argument(
        "--keep-account",
        action="store_true",
        help="follow on the account as a previous run left it (e.g. --section Upgrade after Install); "
        "the working tree becomes a new wheel to upgrade to",
    )
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("follow_guide.py: run as root (it creates the account the guide is followed as)", file=sys.stderr)
        return 2
    if args.cleanup:
        cleanup(args.user)
        return 0
    if args.settings is None:
        parser.error("--settings is required")

    given = given_dir(args.user)  # what the reader brings: the wheel to install, an editor
    if args.keep_account:
        if not user_exists(args.user):
            parser.error(f"--keep-account: there is no account {args.user}")
    else:
        cleanup(args.user)
        shutil.rmtree(given, ignore_errors=True)
        run(["useradd", "--create-home", "--shell", "/bin/bash", args.user])
    home = Path(run(["getent", "passwd", args.user]).stdout.split(":")[5])
    say(f"{'the' if args.keep_account else 'fresh'} account {args.user} ({home})")
    ensure_cron()

    STATE.mkdir(mode=0o755, parents=True, exist_ok=True)
    given.mkdir(mode=0o700, exist_ok=True)
    wheel = build_wheel(given)
    (given / "editor").write_text(EDITOR)
    (given / "editor").chmod(0o755)
    shutil.copy(args.settings, given / "settings.json")
    (given / "settings.json").chmod(0o600)
    run(["chown", "-R", f"{args.user}:{args.user}", str(given)])
    if args.wheelhouse is not None:
        write_pip_conf(home, args.user, args.wheelhouse.resolve())

    reader = f"export HPC_BRIDGE_SOURCE={wheel} EDITOR={given / 'editor'} GUIDE_SETTINGS={given / 'settings.json'}\n"
    steps = blocks(GUIDE, args.section)
    if not steps:
        say(f"no ```bash blocks in the sections {args.section}")
        return 1
    for number, (section, code) in enumerate(steps, 1):
        first = code.strip().splitlines()[0]
        say(f"block {number}/{len(steps)} ({section}): {first}{' ...' if code.strip().count(chr(10)) else ''}")
        started = time.monotonic()
        # A login shell, as the reader has: HOME, USER and the login PATH, nothing of root's.
        result = subprocess.run(
            ["runuser", "-l", args.user, "-c", "bash -euo pipefail"],
            input=reader + "cd ~\n" + code,
            capture_output=True,
            text=True,
            timeout=1200,
        )
        output = (result.stdout + result.stderr).rstrip()
        if output:
            print("    " + output.replace("\n", "\n    "), flush=True)
        if result.returncode != 0:
            say(f"block {number} failed with exit {result.returncode} after {time.monotonic() - started:.0f} s")
            return 1
        say(f"block {number} done in {time.monotonic() - started:.0f} s")
    say(f"followed {len(steps)} blocks of {GUIDE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
