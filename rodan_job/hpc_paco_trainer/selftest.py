"""What the job's ``test_my_task`` (Rodan's ``manage.py test rodan.test.test_all_jobs``) needs to
play the bridge against the real broker: Pixel.js-shaped sample zips, a request queue of the
test's own, a reply in parts. Also used by ``rodan_job/tests``. No Django, no Rodan."""

from __future__ import annotations

import base64
import contextlib
import json
import math
import os
import shutil
import struct
import time
import uuid
import zipfile
import zlib
from typing import Any, Callable, Iterator, Mapping, NamedTuple, Sequence

import pika

from . import hpc_relay

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
HDF5_MAGIC = b"\x89HDF\r\n\x1a\n"


def png_bytes(width: int = 4, height: int = 4, rgba: Sequence[int] = (0, 0, 0, 255)) -> bytes:
    """A small, valid RGBA PNG of one colour."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    row = b"\x00" + bytes(rgba) * width
    header = struct.pack(">IIBBBBB", width, height, 8, 6, 0, 0, 0)
    return PNG_MAGIC + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(row * height)) + chunk(b"IEND", b"")


def sample_member_names(layers: int) -> list[str]:
    """The files of a Pixel.js sample with a background and ``layers`` more layers."""
    names = ["Image.png", "rgba PNG - Selected regions.png", "rgba PNG - Layer 0 (Background).png"]
    return names + [f"rgba PNG - Layer {n}.png" for n in range(1, layers + 1)]


def write_sample_zip(path: str, layers: int, seed: int = 0) -> dict[str, bytes]:
    """A Pixel.js sample zip; returns its members."""
    members = {
        name: png_bytes(4 + seed, 4, (seed % 256, i * 40 % 256, 7, 255))
        for i, name in enumerate(sample_member_names(layers))
    }
    with zipfile.ZipFile(path, "w") as archive:
        for name, data in members.items():
            archive.writestr(name, data)
    return members


def reply_parts(body: bytes, parts: int) -> list[bytes]:
    """``body`` cut into ``parts`` pieces, as the bridge's outbox cuts it."""
    size = max(1, math.ceil(len(body) / parts))
    pieces = [body[i * size : (i + 1) * size] for i in range(parts)]
    assert b"".join(pieces) == body and all(pieces)
    return pieces


def publish_reply(
    channel: Any, reply_to: str, correlation_id: str, body: bytes, parts: int, order: Sequence[int] | None = None
) -> None:
    """Publish ``body`` as the bridge does: ``parts`` persistent messages with part headers, in
    ``order`` (1-based part numbers; a number twice publishes that part twice)."""
    pieces = reply_parts(body, parts)
    channel.confirm_delivery()
    for number in order or range(1, parts + 1):
        channel.basic_publish(
            exchange="",
            routing_key=reply_to,
            body=pieces[number - 1],
            properties=pika.BasicProperties(
                correlation_id=correlation_id,
                delivery_mode=2,
                headers={hpc_relay.PART_HEADER: number, hpc_relay.PARTS_HEADER: parts},
            ),
            mandatory=True,
        )


def success_body(files: Mapping[str, bytes]) -> bytes:
    return json.dumps({k: base64.encodebytes(v).decode("ascii") for k, v in files.items()}).encode("utf-8")


class Request(NamedTuple):
    correlation_id: str
    reply_to: str
    delivery_mode: int
    body: dict[str, Any]


class SelfTest:
    """One run of the job against the real broker: two samples of two layers (and a background),
    the outputs Log File, Background Model, Model 1, Model 2 and Multi-Sample Zip."""

    def __init__(self, url: str, state_dir: str, new_path: Callable[[], str], layers: int = 2) -> None:
        if not url:
            raise RuntimeError("no broker: set HPC_RABBITMQ_URL (or Rodan's RABBITMQ_URL)")
        self.url = url
        self.state_dir = state_dir
        self.correlation_id = str(uuid.uuid4())
        self.request_queue = "hpc-jobs.selftest-" + uuid.uuid4().hex
        self.layers = layers
        self.inputs: dict[str, list[dict[str, Any]]] = {}
        for n in (1, 2):
            path = new_path()
            write_sample_zip(path, layers, seed=n)
            self.inputs[f"Sample {n}"] = [
                {
                    "resource_path": path,
                    "resource_type": "application/zip",
                    "resource_name": f"sample{n}.zip",
                    "resource_url": f"/uploads/projects/{uuid.uuid4().hex}/resources/{uuid.uuid4().hex}/original_file",
                }
            ]
        ports = ["Log File", "Background Model", "Multi-Sample Zip"] + [f"Model {n}" for n in range(1, layers + 1)]
        self.outputs = {
            port: [{"resource_path": new_path(), "resource_type": "application/octet-stream"}] for port in ports
        }
        self.settings: dict[str, Any] = {
            "Batch Size": 8,
            "Maximum number of training epochs": 2,
            "Maximum number of samples per label": 100,
            "Patience": 15,
            "Patch height": 64,
            "Patch width": 64,
            "Maximum time (D-HH:MM)": "0-00:01",
            "Maximum memory (MB)": 2000,
            "CPUs": 1,
            "Slurm Notification Email": "",
        }
        self.files = {"Log File": b"epoch 1\nepoch 2\n"}
        for port in ["Background Model"] + [f"Model {n}" for n in range(1, layers + 1)]:
            self.files[port] = HDF5_MAGIC + os.urandom(3000)

    @contextlib.contextmanager
    def environment(self, **extra: str) -> Iterator[None]:
        """The job's settings in os.environ for the test's run (restored afterwards)."""
        values = {
            "HPC_RABBITMQ_URL": self.url,
            "HPC_REQUEST_QUEUE": self.request_queue,
            "HPC_STATE_DIR": self.state_dir,
            "HPC_POLL_SECONDS": "1",
            "HPC_BRIDGE_MAX_CONTINUATIONS": "0",
            "HPC_BRIDGE_MAX_PENDING": "30",
            "HPC_SILENCE_SLACK": "30",
            "HPC_BROKER_RETRY_LIMIT": "30",
        }
        values.update(extra)
        saved = {name: os.environ.get(name) for name in values}
        os.environ.update(values)
        try:
            yield
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value

    def _channel(self) -> Any:
        config = hpc_relay.RelayConfig(self.url, self.state_dir, ca_file=os.environ.get("HPC_RABBITMQ_CA_FILE"))
        connection = pika.BlockingConnection(hpc_relay.connection_parameters(config))
        return connection, connection.channel()

    def take_request(self, timeout_s: float = 10.0) -> Request:
        """The request the job published to the test's request queue (acknowledged)."""
        connection, channel = self._channel()
        try:
            deadline = time.monotonic() + timeout_s
            while True:
                method, properties, body = channel.basic_get(queue=self.request_queue, auto_ack=False)
                if method is not None:
                    channel.basic_ack(method.delivery_tag)
                    return Request(
                        properties.correlation_id,
                        properties.reply_to,
                        properties.delivery_mode,
                        json.loads(body.decode("utf-8")),
                    )
                if time.monotonic() > deadline:
                    raise AssertionError(f"no request in {self.request_queue}")
                time.sleep(0.1)
        finally:
            connection.close()

    def answer(self, reply_to: str, parts_order: Sequence[int], body: bytes | None = None) -> None:
        """Reply as the bridge does, in ``len(set(parts_order))`` parts published in that order."""
        connection, channel = self._channel()
        try:
            publish_reply(
                channel,
                reply_to,
                self.correlation_id,
                body if body is not None else success_body(self.files),
                len(set(parts_order)),
                parts_order,
            )
        finally:
            connection.close()

    def expected_request_inputs(self) -> dict[str, str]:
        return {port: entries[0]["resource_url"] for port, entries in self.inputs.items()}

    def expected_files(self) -> dict[str, bytes]:
        return {port: data for port, data in self.files.items() if port in self.outputs}

    def output_zip_folders(self) -> list[str]:
        """The folders of the Multi-Sample Zip output, after checking each holds its sample's files."""
        with zipfile.ZipFile(self.outputs["Multi-Sample Zip"][0]["resource_path"]) as archive:
            names = archive.namelist()
            folders = sorted({name.split("/")[0] for name in names})
            for folder in folders:
                port = folder
                with zipfile.ZipFile(self.inputs[port][0]["resource_path"]) as sample:
                    for member in sample.namelist():
                        if archive.read(folder + "/" + member) != sample.read(member):
                            raise AssertionError(f"{folder}/{member} differs from its input")
            return folders

    def cleanup(self) -> None:
        with contextlib.suppress(Exception):
            connection, channel = self._channel()
            try:
                channel.queue_delete(queue=self.request_queue)
                channel.queue_delete(queue=hpc_relay.reply_queue_name(self.correlation_id))
            finally:
                connection.close()
        shutil.rmtree(self.state_dir, ignore_errors=True)
