"""Rodan 3.x job: train Paco's patchwise models on an HPC cluster through hpc-bridge.

It stands in for Rodan's FastPacoTrainer with exactly its ports, publishes one generation-3
request per run to RabbitMQ and waits for the reply without holding a worker slot: each call
polls the run's own reply queue once and ends with Celery's ``self.retry`` while the reply is
not complete (README.md beside this package says why and how).
"""

import os
import time
import uuid

from celery.exceptions import Retry
from celery.signals import task_revoked
from django.conf import settings as django_settings
from rodan.constants import task_status
from rodan.jobs.base import RodanTask
from rodan.jobs.hpc_paco_trainer import hpc_relay, selftest

#: RunJob statuses by number, for the log line of a poll that ends because Rodan ended its RunJob.
_STATUS_NAMES = {
    task_status.SCHEDULED: "SCHEDULED",
    task_status.PROCESSING: "PROCESSING",
    task_status.FINISHED: "FINISHED",
    task_status.FAILED: "FAILED",
    task_status.CANCELLED: "CANCELLED",
    task_status.WAITING_FOR_INPUT: "WAITING_FOR_INPUT",
}
#: How long a call whose RunJob names another Celery task id looks again: Rodan's master_task
#: records a dispatched task's id just after dispatching it, so a new attempt may see the old one.
_TASK_ID_SETTLE_S = 5.0

_SAMPLE_INPUTS = tuple(
    {"name": port, "minimum": 0, "maximum": 1, "resource_types": ["application/zip"]} for port in hpc_relay.SAMPLE_PORTS
)
_MODEL_INPUTS = tuple(
    {"name": port, "minimum": 0, "maximum": 1, "resource_types": ["keras/model+hdf5"]}
    for port in hpc_relay.INPUT_MODEL_PORTS
)


class HPCFastPacoTrainer(RodanTask):
    name = "Training model for Patchwise Analysis of Music Document, HPC"
    author = "hpc-bridge"
    description = (
        "Trains one Selectional Auto-Encoder per layer of the samples, as 'Training model for "
        "Patchwise Analysis of Music Document, Training' does, on an HPC cluster through "
        "hpc-bridge (Slurm or Grid Engine). The run waits for the cluster without holding a worker."
    )
    enabled = True
    category = "OMR - Layout analysis"
    interactive = False

    # Celery: retry for ever (the silence bound ends a run), acknowledge a call only once it ended,
    # so a worker killed in the middle of a poll gets the message again.
    max_retries = None
    acks_late = True

    settings = {
        "title": "Training parameters",
        "type": "object",
        "properties": {
            "Batch Size": {"type": "integer", "minimum": 1, "default": 8, "maximum": 64},
            "Maximum number of training epochs": {"type": "integer", "minimum": 1, "default": 50},
            "Maximum number of samples per label": {"type": "integer", "minimum": 100, "default": 1000},
            "Patience": {"type": "integer", "minimum": 0, "default": 15},
            "Patch height": {"type": "integer", "minimum": 32, "default": 256, "multipleOf": 4},
            "Patch width": {"type": "integer", "minimum": 32, "default": 256, "multipleOf": 4},
            "Maximum time (D-HH:MM)": {
                "type": "string",
                "default": "1-00:00",
                "pattern": "^[0-9]{1,3}-([01][0-9]|2[0-3]):[0-5][0-9]$",
            },
            "Maximum memory (MB)": {"type": "integer", "minimum": 1, "default": 16000},
            "CPUs": {"type": "integer", "minimum": 1, "default": 4},
            "Slurm Notification Email": {"type": "string", "default": ""},
        },
        "job_queue": "Python3",
    }

    input_port_types = (
        *_SAMPLE_INPUTS,
        {"name": "Multi-Sample Zip", "minimum": 0, "maximum": 1, "resource_types": ["application/zip"]},
        *_MODEL_INPUTS,
    )

    output_port_types = (
        {"name": "Log File", "minimum": 1, "maximum": 1, "resource_types": ["text/plain"]},
        {"name": "Background Model", "minimum": 0, "maximum": 1, "resource_types": ["keras/model+hdf5"]},
        {"name": "Model 1", "minimum": 1, "maximum": 1, "resource_types": ["keras/model+hdf5"]},
        *tuple(
            {"name": f"Model {n}", "minimum": 0, "maximum": 1, "resource_types": ["keras/model+hdf5"]}
            for n in range(2, 10)
        ),
        {"name": "Multi-Sample Zip", "minimum": 0, "maximum": 1, "resource_types": ["application/zip"]},
    )

    def run(self, runjob_id):
        """One poll, as Celery calls it. Before Rodan's ``run`` (which reads the RunJob, its inputs
        and outputs, then saves the outputs after ``run_my_task``): a poll whose RunJob is no longer
        PROCESSING (Cancel, a failure, gone) or runs as another Celery task (a newer attempt) ends
        quietly after removing its attempt's reply queue and state; and a poll of a run that has
        published and whose reply queue is empty only waits again (one database query, one
        passive queue declaration)."""
        config = hpc_relay.config_from_env(os.environ, str(django_settings.MEDIA_ROOT or ""))
        runjob_id = str(uuid.UUID(str(runjob_id)))
        task_id = getattr(self.request, "id", None)
        ended = self._attempt_ended(runjob_id, task_id)
        if ended:
            hpc_relay.end_attempt(config, runjob_id, task_id, ended)
            return "HPC poll ended: " + ended
        swept = hpc_relay.maybe_sweep(config.state_dir, time.time(), over=_runjobs_ended)
        if swept:
            hpc_relay.delete_reply_queues(config, swept)
        if hpc_relay.nothing_new(config, runjob_id, task_id, time.time()):
            raise self.retry(countdown=hpc_relay.next_poll_s(config, runjob_id, time.time()), max_retries=None)
        return super().run(runjob_id)

    def _attempt_ended(self, runjob_id, task_id):
        """Why this call's attempt is over (``None`` while its RunJob is PROCESSING as this task)."""
        from rodan.models import RunJob

        def row():
            return RunJob.objects.filter(uuid=runjob_id).values_list("status", "celery_task_id").first()

        found = row()
        if found is None:
            return "its RunJob is gone"
        if found[0] != task_status.PROCESSING:
            return "its RunJob is " + _STATUS_NAMES.get(found[0], str(found[0]))
        deadline = time.monotonic() + _TASK_ID_SETTLE_S
        while found[1] and task_id and str(found[1]) != task_id and time.monotonic() < deadline:
            time.sleep(0.5)
            found = row()
            if found is None or found[0] != task_status.PROCESSING:
                return self._attempt_ended(runjob_id, task_id)
        if found[1] and task_id and str(found[1]) != task_id:
            return f"its RunJob runs as Celery task {found[1]} now (a newer attempt)"
        return None

    def run_my_task(self, inputs, settings, outputs):
        config = hpc_relay.config_from_env(os.environ, str(django_settings.MEDIA_ROOT or ""))
        runjob_id, url_inputs = self._request_identity(inputs)
        bound_s = hpc_relay.silence_bound_s(settings, config)
        hpc_relay.check_layers(inputs, outputs)
        try:
            files = hpc_relay.step(
                config,
                runjob_id,
                lambda: hpc_relay.build_request(url_inputs, settings),
                bound_s,
                task_id=getattr(self.request, "id", None),
                time_limit_s=hpc_relay.parse_time_limit(settings.get("Maximum time (D-HH:MM)", "1-00:00")),
            )
        except hpc_relay.AttemptOver as over:
            # Rodan's run() then checks the outputs, which this call did not write: raised as an
            # error it would fail the RunJob. This only happens when the state went between run()'s
            # check and here (a clean-up in the same instant); the RunJob is ended already.
            raise hpc_relay.HPCJobError("This attempt of the run was ended in Rodan", str(over)) from None
        if files is None:
            raise self.retry(countdown=hpc_relay.next_poll_s(config, runjob_id, time.time()), max_retries=None)
        written = hpc_relay.write_outputs(files, outputs, inputs)
        hpc_relay.LOG.info("HPC run of RunJob %s wrote %s", runjob_id, ", ".join(written))
        return True

    def _request_identity(self, inputs):
        """The RunJob's uuid (the task's argument) and the inputs with their Rodan URLs
        (``_inputs(runjob, with_urls=True)``; inputs that carry URLs already are used as they are)."""
        args = getattr(self.request, "args", None) or ()
        if not args:
            raise hpc_relay.HPCJobError("The job runs only as a Rodan task (no RunJob id)")
        runjob_id = str(uuid.UUID(str(args[0])))
        connected = [entries[0] for entries in inputs.values() if entries]
        if connected and all(entry.get("resource_url") for entry in connected):
            return runjob_id, inputs
        from rodan.models import RunJob

        runjob = RunJob.objects.get(uuid=args[0])
        return runjob_id, self._inputs(runjob, with_urls=True)

    def my_error_information(self, exc, traceback):
        url = os.environ.get("HPC_RABBITMQ_URL", "")
        if isinstance(exc, hpc_relay.HPCJobError):
            return {
                "error_summary": hpc_relay.redact(exc.summary, url),
                "error_details": hpc_relay.redact(exc.details or exc.summary, url),
            }
        return {
            "error_summary": hpc_relay.redact(f"{type(exc).__name__}: {exc}", url),
            "error_details": hpc_relay.redact(str(traceback or ""), url),
        }

    def test_my_task(self, testcase):
        """Publish against the real broker (HPC_RABBITMQ_URL, else Rodan's own RABBITMQ_URL) to a
        request queue of the test's own, answer as the bridge would (two parts, out of order) and
        check every output file."""
        url = os.environ.get("HPC_RABBITMQ_URL") or getattr(django_settings, "BROKER_URL", "")
        run = selftest.SelfTest(url, state_dir=testcase.new_available_path(), new_path=testcase.new_available_path)
        with run.environment():
            self.push_request(args=[run.correlation_id], id=str(uuid.uuid4()))
            try:
                try:
                    self.run_my_task(run.inputs, run.settings, run.outputs)
                except Retry:
                    pass
                else:
                    testcase.fail("the first call did not wait for the reply")
                request = run.take_request()
                testcase.assertEqual(request.correlation_id, run.correlation_id)
                testcase.assertEqual(request.reply_to, "hpc-results." + run.correlation_id)
                testcase.assertEqual(request.delivery_mode, 2)
                testcase.assertEqual(request.body["inputs"], run.expected_request_inputs())
                testcase.assertEqual(request.body["settings"], run.settings)
                run.answer(request.reply_to, parts_order=[2, 1])
                testcase.assertTrue(self.run_my_task(run.inputs, run.settings, run.outputs))
                for port, expected in run.expected_files().items():
                    with open(run.outputs[port][0]["resource_path"], "rb") as handle:
                        testcase.assertEqual(handle.read(), expected, port)
                testcase.assertEqual(run.output_zip_folders(), ["Sample 1", "Sample 2"])
            finally:
                self.pop_request()
                run.cleanup()


def _runjobs_ended(runjob_ids):
    """Of these RunJob ids (the state folders of runs still waiting), those whose RunJob is not
    SCHEDULED or PROCESSING (cancelled, failed, finished) or no longer exists: ``sweep_state``'s
    ``over``."""
    from rodan.models import RunJob

    valid = []
    for name in runjob_ids:
        try:
            valid.append(str(uuid.UUID(name)))
        except ValueError:
            continue
    live = {
        str(value)
        for value in RunJob.objects.filter(
            uuid__in=valid, status__in=(task_status.SCHEDULED, task_status.PROCESSING)
        ).values_list("uuid", flat=True)
    }
    return [name for name in valid if name not in live]


@task_revoked.connect
def _on_revoked(sender=None, request=None, **_kwargs):
    """Celery drops a revoked poll (Rodan's Cancel revokes the RunJob's task id) and sends this in
    the worker's main process: remove that attempt's reply queue and state at once. Kept short (one
    connection attempt of at most 5 s); a failure only logs, the next sweep retries."""
    if getattr(sender, "name", None) != HPCFastPacoTrainer.name:
        return
    url = os.environ.get("HPC_RABBITMQ_URL", "")
    try:
        args = getattr(request, "args", None) or ()
        runjob_id = str(uuid.UUID(str(args[0])))
        config = hpc_relay.config_from_env(os.environ, str(django_settings.MEDIA_ROOT or ""))
        hpc_relay.end_attempt(
            config, runjob_id, getattr(request, "id", None), "its Celery task was revoked (Rodan's Cancel)"
        )
    except Exception as exc:  # the worker's main process must go on whatever happens here
        hpc_relay.LOG.warning("clean-up of a revoked HPC poll failed: %s", hpc_relay.redact(repr(exc), url))
