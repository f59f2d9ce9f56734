"""The few exception types of the project, named by what the caller should do.

Every failure the bridge or the worker meets is turned into one of these at the
boundary where it happens, so the code that decides (retry, reply with an error,
dead-letter) only has to look at the type:

* :class:`TransientError`  - try the same thing again later (5xx, connection
  refused, slurmctld unreachable). Bounded by the caller.
* :class:`PermanentError`  - retrying cannot help (4xx, invalid settings, the
  scheduler rejected the job). The request gets an error reply.
* :class:`ConfigError`     - the operator's configuration is wrong; the process
  refuses to start and names the setting.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence


class BridgeError(Exception):
    """Base of every error this project raises on purpose."""


class ConfigError(BridgeError):
    """A setting is missing or malformed. The message names the setting.

    ``problems`` lists every problem when there were several (one line each). ``settings`` maps
    each setting a problem is about (``HPC_SCHEDULER``) to its problems, so that a caller can tell
    what still works (``doctor`` runs every check that needs none of them); a problem about no one
    setting is filed under ``""``. ``setting`` names the one setting of an error raised about one
    (a parser's), ``""`` when it does not know which."""

    def __init__(
        self,
        message: str,
        problems: list[str] | None = None,
        *,
        setting: str = "",
        settings: Mapping[str, Sequence[str]] | None = None,
    ) -> None:
        super().__init__(message)
        self.problems = problems or [message]
        self.setting = setting
        self.settings: dict[str, list[str]] = (
            {name: list(found) for name, found in settings.items()}
            if settings is not None
            else {setting: list(self.problems)}
        )

    @classmethod
    def listing(cls, problems: list[str], settings: Mapping[str, Sequence[str]] | None = None) -> ConfigError:
        """One error for every problem found (``settings``: the same problems by setting)."""
        if len(problems) == 1:
            return cls(problems[0], settings=settings)
        return cls(f"{len(problems)} problems: " + "; ".join(problems), problems, settings=settings)


class TransientError(BridgeError):
    """Worth retrying later: the cause is outside the request."""


class PermanentError(BridgeError):
    """Never worth retrying: the request (or its target) must change first."""


class InvalidRequest(PermanentError):
    """The request body or its settings break the protocol."""


class RodanAuthError(PermanentError):
    """Rodan refused the credentials (401/403). An operator must fix them."""


class SchedulerRejected(PermanentError):
    """The scheduler refused the job for good (e.g. impossible memory)."""


class SchedulerUnavailable(TransientError):
    """The scheduler did not answer (controller down, timeout)."""


class SubmitLimitReached(SchedulerUnavailable):
    """The scheduler took no job only because a submit limit is reached (Slurm's MaxSubmitJobs of a
    QOS or association, Grid Engine's max_u_jobs / max_jobs): it takes the job once earlier ones end.
    The request waits in the queue (``HPC_MAX_ACTIVE_JOBS`` below the limit avoids the refusals)."""


class BrokerUnavailable(TransientError):
    """The message broker could not be reached or dropped the connection."""


class NoRoute(PermanentError):
    """No queue by that name: the message was returned unrouted.

    Permanent for this publish, but the queue's owner may declare it again (a broker's restart drops
    Rodan's non-durable reply queue until Rodan reconnects): a staged reply waits for it, unchanged.
    """
