"""A fast stand-in for ``python -m worker run PARAMS``: no download, no TensorFlow.

For the fault tests, which need many requests through a real scheduler: it reads the
parameter file with the real worker code (``bridge.handoff.JobParameters``), drops it as the
real worker does, and delivers a small valid models reply (one entry per reply key)
through the real reply path (``worker.job.deliver``: stage in the outbox, publish with
confirms, write the replied marker). A request already answered gets nothing more,
as with the real worker. A correlation id that starts with ``0`` only has its reply staged, as
when the worker cannot reach the broker: the bridge publishes it once the job has ended.
A generation-3 request (whose layers only the real worker learns, from its sample zips) gets
:func:`rodan3_models`: the size of a 9-layer page's reply (10 models of 5.8 MB and a Log File,
about 78 MB in base64), published in parts as the real worker's reply would be.

``install(dir)`` writes an executable ``python`` wrapper to use as HPC_WORKER_PYTHON: the batch
script runs ``WRAPPER -m worker run PARAMS``; the wrapper execs this file for that and the real
interpreter for anything else. It also drops ``HPC_FAULT_*`` (sbatch exports the submitting
environment: the bridge's crash plan must not kill the job).
"""

from __future__ import annotations

import random
import shlex
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
#: One model of the standard network without optimizer state (docs/protocol.md §3.4).
RODAN3_MODEL_BYTES = 5_800_000
RODAN3_LAYERS = 9


def rodan3_models(correlation_id: str) -> dict[str, bytes]:
    """Generation 3's reply entries for a 9-layer page: ``Background Model``, ``Model 1`` ...
    ``Model 9`` (random bytes, the same for the same correlation id) and the ``Log File``."""
    rng = random.Random(correlation_id)
    names = ["Background Model"] + [f"Model {i}" for i in range(1, RODAN3_LAYERS + 1)]
    models = {name: rng.randbytes(RODAN3_MODEL_BYTES) for name in names}
    models["Log File"] = f"stub training log for {correlation_id}\n".encode()
    return models


def install(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    wrapper = directory / "python"
    here = shlex.quote(str(Path(__file__).resolve()))
    python = shlex.quote(sys.executable)
    wrapper.write_text(
        "#!/bin/sh\n"
        "unset HPC_FAULT_KILL HPC_FAULT_SEED HPC_FAULT_LOG\n"
        f'if [ "$1" = "-m" ] && [ "$2" = "worker" ] && [ "$3" = "run" ]; then\n'
        f'  shift 3; PYTHONPATH={shlex.quote(str(REPO))} exec {python} {here} "$@"\n'
        "fi\n"
        f'exec {python} "$@"\n'
    )
    wrapper.chmod(0o755)
    return wrapper


def main(argv: list[str]) -> int:
    import structlog

    from bridge.handoff import JobParameters
    from bridge.logs import configure_logging
    from bridge.protocol import Generation, success_reply
    from bridge.replies import ReplyBox
    from bridge.spool import Spool, read_json
    from worker.job import deliver

    configure_logging(level="INFO", stream=sys.stdout, component="worker")
    params_path = Path(argv[0])
    params = JobParameters.from_json(read_json(params_path))
    params_path.unlink(missing_ok=True)  # the real worker drops the token-bearing file too
    structlog.contextvars.bind_contextvars(correlation_id=params.correlation_id)
    replies = ReplyBox(Spool(params.spool), max_bytes=params.max_reply_bytes)
    if replies.already_replied(params.correlation_id):
        structlog.get_logger("worker").warning("already_replied")
        return 0
    models = {key: f"stub model {key} for {params.correlation_id}".encode() for _, key in params.layers}
    if params.generation is Generation.RODAN3:
        models = rodan3_models(params.correlation_id)
    if params.correlation_id.startswith("0"):
        # As a worker that cannot reach the broker: the reply stays in the outbox for the bridge.
        replies.stage(
            params.correlation_id,
            params.reply_to,
            success_reply(models),
            origin="worker",
            part_bytes=params.reply_part_bytes,
        )
        return 0
    deliver(replies, params, success_reply(models))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
