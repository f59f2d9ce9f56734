"""Rodan 3.x job: train Paco's patchwise models on an HPC cluster through hpc-bridge.

It stands in for Rodan's FastPacoTrainer with exactly its ports, publishes one generation-3
request per run to RabbitMQ and waits for the reply without holding a worker slot: each call
polls the run's own reply queue once and ends with Celery's ``self.retry`` while the reply is
not complete (README.md beside this package says why and how).
"""

import os
import uuid

from celery.exceptions import Retry
from django.conf import settings as django_settings
from rodan.jobs.base import RodanTask
from rodan.jobs.hpc_paco_trainer import hpc_relay, selftest

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

    def run_my_task(self, inputs, settings, outputs):
        config = hpc_relay.config_from_env(os.environ, str(django_settings.MEDIA_ROOT or ""))
        correlation_id, url_inputs = self._request_identity(inputs)
        bound_s = hpc_relay.silence_bound_s(settings, config)
        hpc_relay.check_layers(inputs, outputs)
        files = hpc_relay.step(config, correlation_id, lambda: hpc_relay.build_request(url_inputs, settings), bound_s)
        if files is None:
            raise self.retry(countdown=config.poll_seconds, max_retries=None)
        written = hpc_relay.write_outputs(files, outputs, inputs)
        hpc_relay.LOG.info("HPC run %s wrote %s", correlation_id, ", ".join(written))
        return True

    def _request_identity(self, inputs):
        """The correlation id (the RunJob's uuid, the task's argument) and the inputs with their
        Rodan URLs (``_inputs(runjob, with_urls=True)``; inputs that carry URLs already are used
        as they are)."""
        args = getattr(self.request, "args", None) or ()
        if not args:
            raise hpc_relay.HPCJobError("The job runs only as a Rodan task (no RunJob id)")
        correlation_id = str(uuid.UUID(str(args[0])))
        connected = [entries[0] for entries in inputs.values() if entries]
        if connected and all(entry.get("resource_url") for entry in connected):
            return correlation_id, inputs
        from rodan.models import RunJob

        runjob = RunJob.objects.get(uuid=args[0])
        return correlation_id, self._inputs(runjob, with_urls=True)

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
            self.push_request(args=[run.correlation_id])
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
