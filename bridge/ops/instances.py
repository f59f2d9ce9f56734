"""What two instances under one account must not share (``doctor``'s ``instances`` check).

bridge/instance.py keys every file, unit and queue the bridge names itself. What the operator names
can still collide: two instances reading the same request queue on the same broker vhost would take
each other's requests, and two sharing a spool, a log file or a metrics file would overwrite each
other's. :func:`collisions` reads every other instance's settings (``~/.config/hpc-bridge/*/``) and
says what this one shares with which.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from bridge.config import SETTING_PREFIXES, BridgeConfig, load_config
from bridge.errors import ConfigError
from bridge.instance import Instance, installed_instances


@dataclass(frozen=True)
class Other:
    """Another instance's settings, or why they could not be read."""

    name: str
    config: BridgeConfig | None
    problem: str = ""


def broker_target(url: str) -> tuple[str, int, str]:
    """Host, port and vhost of a broker URL: two instances on the same target share its queues."""
    parts = urlsplit(url)
    port = parts.port or (5671 if parts.scheme == "amqps" else 5672)
    vhost = parts.path[1:] if len(parts.path) > 1 else "/"
    return (parts.hostname or "", port, vhost.replace("%2F", "/").replace("%2f", "/"))


def other_instances(config: BridgeConfig, environ: Mapping[str, str] | None = None) -> list[Other]:
    """Every other instance with a settings folder, read as its own commands would read it."""
    env = dict(os.environ if environ is None else environ)
    home = Instance.from_environment(config.instance, env)
    bare = {k: v for k, v in env.items() if not k.startswith(SETTING_PREFIXES)}  # this one's overrides are not theirs
    others = []
    for name in installed_instances(home.config_home):
        if name == config.instance:
            continue
        theirs = Instance.from_environment(name, env)
        try:
            others.append(Other(name, load_config(theirs.credentials, bare, name)))
        except ConfigError as exc:
            others.append(Other(name, None, exc.problems[0] if exc.problems else str(exc)))
    return others


def collisions(config: BridgeConfig, others: list[Other]) -> list[str]:
    """What ``config`` shares with the other instances' settings, in words (empty: nothing)."""
    found = []
    mine = broker_target(config.broker_url)
    for other in others:
        theirs = other.config
        if theirs is None:
            continue
        if broker_target(theirs.broker_url) == mine:
            for what, a, b in (
                ("request queue", config.request_queue, theirs.request_queue),
                ("dead-letter queue", config.dead_letter_queue, theirs.dead_letter_queue),
                ("status queue", config.status_queue, theirs.status_queue),
            ):
                if a and a == b:
                    found.append(
                        f"the {what} {a} on the same broker vhost as instance {other.name}: give one of them its "
                        "own vhost (RABBITMQ_URL) or queue names"
                    )
        for what, path_a, path_b in (
            ("spool", config.spool_dir, theirs.spool_dir),
            ("log file", config.log_file, theirs.log_file),
            ("metrics file", config.metrics_file, theirs.metrics_file),
        ):
            if path_a is not None and path_b is not None and where(config, path_a) == where(theirs, path_b):
                found.append(f"the {what} {where(config, path_a)} is instance {other.name}'s too: give each its own")
    return found


def where(config: BridgeConfig, path: Path) -> Path:
    """``path`` as a pass of that instance sees it: relative to its credentials file's folder, where
    cron and systemd run it."""
    path = path.expanduser()
    if not path.is_absolute() and config.credentials_file is not None:
        path = config.credentials_file.parent / path
    return Path(os.path.abspath(path))
