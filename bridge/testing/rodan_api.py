"""What a Rodan 3.x user does in Rodan's web client, through its REST API: make a project, upload
files, build a workflow of one job with the ports wanted, run it, wait for it and read its outputs.

The demo (deploy/dev/demo.py) and the tests that drive the real Rodan 3.1.0 of
``deploy/dev/rodan.sh`` use it; nothing in the bridge's own path does. Rodan's API answers HTML to
``Accept: */*`` and its runserver closes every connection after its answer without saying so: each
call here asks for JSON on a connection of its own.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import requests

#: WorkflowRun and RunJob statuses (Rodan's rodan/constants.py).
FINISHED, FAILED, PROCESSING, CANCELLED = 4, -1, 1, 9
#: What the web client's Cancel and Retry buttons PATCH into a workflow run's status.
REQUEST_CANCELLING, REQUEST_RETRYING = 29, 31
REQUEST_TIMEOUT_S = 60.0


class RodanApiError(RuntimeError):
    """Rodan answered a call with something other than what it answers when the call works."""


@dataclass(frozen=True)
class Upload:
    """A file to upload for an input port: its name, bytes and Rodan resource type."""

    name: str
    data: bytes = field(repr=False)
    resource_type: str = "application/zip"


class Api:
    """Rodan's REST API at ``url`` with a token (``POST /api/auth/token/`` with e-mail and password)."""

    def __init__(self, url: str, token: str) -> None:
        self.url = url.rstrip("/")
        self.headers = {"Accept": "application/json", "Connection": "close", "Authorization": f"Token {token}"}

    @classmethod
    def login(cls, url: str, email: str, password: str) -> Api:
        response = requests.post(
            f"{url.rstrip('/')}/api/auth/token/",
            data={"email": email, "password": password},
            headers={"Accept": "application/json", "Connection": "close"},
            timeout=REQUEST_TIMEOUT_S,
        )
        if response.status_code != 200:
            raise RodanApiError(f"Rodan refused the token for {email}: {response.status_code} {response.text[:300]}")
        return cls(url, str(response.json()["token"]))

    def request(self, method: str, url: str, **kwargs: Any) -> requests.Response:
        """``url`` absolute or relative to Rodan's root (``/api/...``)."""
        if url.startswith("/"):
            url = self.url + url
        timeout = kwargs.pop("timeout", REQUEST_TIMEOUT_S)
        return requests.request(method, url, headers=self.headers, timeout=timeout, **kwargs)

    def get(self, url: str, **kwargs: Any) -> requests.Response:
        return self.request("GET", url, **kwargs)

    def post(self, url: str, **kwargs: Any) -> requests.Response:
        return self.request("POST", url, **kwargs)

    def patch(self, url: str, **kwargs: Any) -> requests.Response:
        return self.request("PATCH", url, **kwargs)

    def json(self, url: str, **kwargs: Any) -> dict[str, Any]:
        """``GET url`` as JSON; a status other than 200 is an error."""
        response = self.get(url, **kwargs)
        if response.status_code != 200:
            raise RodanApiError(f"GET {response.url}: {response.status_code} {response.text[:300]}")
        return dict(response.json())

    def created(self, url: str, **kwargs: Any) -> dict[str, Any]:
        """``POST url``, which must answer 201 Created; the object (the first, for a list)."""
        response = self.post(url, **kwargs)
        if response.status_code != 201:
            raise RodanApiError(f"POST {response.url}: {response.status_code} {response.text[:500]}")
        body = response.json()
        return dict(body[0] if isinstance(body, list) else body)

    # --- what a user does ---------------------------------------------------------------------

    def create_project(self, name: str | None = None) -> str:
        """A new project; its API URL."""
        return str(self.created("/api/projects/", data={"name": name or f"hpc-job-{uuid.uuid4().hex[:8]}"})["url"])

    def post_resource(self, project: str, file: Upload) -> dict[str, Any]:
        """``POST /api/resources/`` (multipart): the new resource's JSON (``url``,
        ``resource_file``), its file served at once, its type not yet set (see :meth:`upload`)."""
        return self.created(
            "/api/resources/",
            data={"project": project, "type": file.resource_type},
            files={"files": (file.name, file.data, file.resource_type)},
        )

    def upload(self, project: str, file: Upload, timeout_s: float = 180) -> dict[str, Any]:
        """:meth:`post_resource`, then wait until Rodan has given the resource its type: Rodan
        files it as ``application/octet-stream`` and its Celery task ``rodan.core.create_resource``
        sets the claimed type later (a workflow run refuses the resource before that). The
        resource's JSON (``url``, ``resource_file``)."""
        resource = self.post_resource(project, file)
        deadline = time.monotonic() + timeout_s
        while True:
            resource = self.json(resource["url"])
            if self.json(resource["resource_type"])["mimetype"] == file.resource_type:
                return resource
            if time.monotonic() > deadline:
                raise RodanApiError(f"Rodan did not make {file.name!r} a {file.resource_type} in {timeout_s} s")
            time.sleep(1)

    def job(self, name: str) -> dict[str, Any]:
        """The installed job called ``name``."""
        jobs = self.json("/api/jobs/", params={"name": name})["results"]
        for job in jobs:
            if job["name"] == name:
                return dict(job)
        raise RodanApiError(f"Rodan has no job named {name!r}")

    def start_workflow(
        self,
        job_name: str,
        inputs: dict[str, Upload],
        outputs: list[str],
        settings: dict[str, Any],
        *,
        project: str | None = None,
        name: str = "hpc run",
    ) -> tuple[str, dict[str, str]]:
        """Upload each input, build a workflow of the job alone (those input ports, the
        ``outputs`` ports) in ``project`` (a new one by default), make it valid and run it:
        (workflow run URL, the inputs' ``/uploads/`` paths by port)."""
        project = project or self.create_project()
        job = self.job(job_name)
        in_types = {p["name"]: p["url"] for p in job["input_port_types"]}
        out_types = {p["name"]: p["url"] for p in job["output_port_types"]}
        workflow = self.created("/api/workflows/", data={"project": project, "name": name})
        wfjob = self.created(
            "/api/workflowjobs/", json={"workflow": workflow["url"], "job": job["url"], "job_settings": settings}
        )
        assignments: dict[str, list[str]] = {}
        paths: dict[str, str] = {}
        for port_name, file in inputs.items():
            resource = self.upload(project, file)
            port = self.created(
                "/api/inputports/", data={"workflow_job": wfjob["url"], "input_port_type": in_types[port_name]}
            )
            assignments[port["url"]] = [resource["url"]]
            paths[port_name] = urlsplit(resource["resource_file"]).path
        for port_name in outputs:
            self.created(
                "/api/outputports/", data={"workflow_job": wfjob["url"], "output_port_type": out_types[port_name]}
            )
        valid = self.patch(workflow["url"], json={"valid": True})
        if valid.status_code != 200:
            raise RodanApiError(f"Rodan refused the workflow as valid: {valid.status_code} {valid.text[:500]}")
        run = self.created(
            "/api/workflowruns/", json={"workflow": workflow["url"], "resource_assignments": assignments, "name": name}
        )
        return str(run["url"]), paths

    def wait_run(self, run_url: str, timeout_s: float, poll_s: float = 1.0) -> dict[str, Any]:
        """Poll the workflow run until it finished or failed; its JSON."""
        deadline = time.monotonic() + timeout_s
        run: dict[str, Any] = {}
        while time.monotonic() < deadline:
            run = self.json(run_url)
            if run["status"] in (FINISHED, FAILED):
                return run
            time.sleep(poll_s)
        raise RodanApiError(f"the workflow run did not end within {timeout_s:.0f} s (status {run.get('status')})")

    def cancel_run(self, run_url: str) -> None:
        """The web client's Cancel: PATCH the workflow run's status to REQUEST_CANCELLING (Rodan then
        sets its RunJobs CANCELLED and revokes their Celery tasks)."""
        self._set_status(run_url, REQUEST_CANCELLING, "cancel")

    def retry_run(self, run_url: str) -> None:
        """The web client's Retry of a FAILED or CANCELLED run: PATCH its status to REQUEST_RETRYING
        (Rodan schedules its failed and cancelled RunJobs again, the same RunJobs)."""
        self._set_status(run_url, REQUEST_RETRYING, "retry")

    def _set_status(self, run_url: str, status: int, what: str) -> None:
        answer = self.patch(run_url, json={"status": status})
        if answer.status_code != 200:
            raise RodanApiError(f"Rodan refused to {what} the run: {answer.status_code} {answer.text[:500]}")

    def run_jobs(self, run: dict[str, Any]) -> list[dict[str, Any]]:
        """The RunJobs of a workflow run."""
        return [dict(r) for r in self.json("/api/runjobs/", params={"workflow_run": run["uuid"]})["results"]]

    def output_files(self, runjob: dict[str, Any]) -> dict[str, bytes]:
        """Each output port's file of a RunJob, downloaded."""
        files = {}
        for output_url in runjob["outputs"]:
            output = self.json(output_url)
            resource = self.json(output["resource"])
            download = self.get(resource["resource_file"])
            download.raise_for_status()
            files[str(output["output_port_type_name"])] = download.content
        return files
