"""Inputs come only from Rodan, are bounded, and are checked before a job waits.

Against the Rodan stand-in on loopback (a second one plays another host): the download cap on raw
bytes (a chunked body of unknown length, a declared length over the cap, a gzip bomb), the origin
rule (no request reaches another server, also through a redirect), ``RodanClient.check_input`` (what
the bridge asks at intake: exists, size, PNG or JPEG, with one ranged GET), and the page opener
(PNG and JPEG only, a pixel limit). The worker's error replies for the same, in process, at the end.
"""

from __future__ import annotations

import io
import json
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import EpsImagePlugin, Image

from bridge.errors import PermanentError, RodanAuthError, TransientError
from bridge.handoff import DEFAULT_MAX_INPUT_BYTES, DEFAULT_MAX_INPUT_PIXELS
from bridge.rodan import InputInfo, RodanClient
from bridge.testing.rodan import PNG_SIGNATURE, RodanStandin, User
from tests.support.bridge import job_parameters_json
from worker.trainer import TrainingInputError, load_page

EMAIL, PASSWORD = "hpc@example.org", "pw-bounded"
MIB = 1 << 20
CAP = 1 * MIB
HUGE = 256 * MIB  # what a generated resource sends: far past the cap, never stored anywhere


def image_bytes(fmt: str, size: tuple[int, int] = (30, 20), mode: str = "RGB") -> bytes:
    buffer = io.BytesIO()
    Image.new(mode, size, (200, 10, 10) if mode == "RGB" else None).save(buffer, fmt)
    return buffer.getvalue()


FILES: dict[str, bytes] = {
    "page.png": image_bytes("PNG"),
    "page.jpg": image_bytes("JPEG"),
    "page.gif": image_bytes("GIF"),
    "page.tif": image_bytes("TIFF"),
    "page.bmp": image_bytes("BMP"),
    "page.eps": image_bytes("EPS"),
    "page.html": b"<html><body>Rodan's login page</body></html>",
    "empty": b"",
    "big.png": PNG_SIGNATURE + bytes(2 * MIB - len(PNG_SIGNATURE)),
    "exact.png": PNG_SIGNATURE + bytes(CAP - len(PNG_SIGNATURE)),
}


@pytest.fixture
def srv(tmp_path: Path) -> Iterator[RodanStandin]:
    uploads = tmp_path / "rodan"
    (uploads / "p").mkdir(parents=True)
    for name, data in FILES.items():
        (uploads / "p" / name).write_bytes(data)
    with RodanStandin(uploads, users=[User(EMAIL, "hpc", PASSWORD)]) as server:
        yield server


@pytest.fixture
def other(tmp_path: Path) -> Iterator[RodanStandin]:
    """Another host, serving the same files: it must never see a request."""
    uploads = tmp_path / "other"
    (uploads / "p").mkdir(parents=True)
    (uploads / "p" / "page.png").write_bytes(FILES["page.png"])
    with RodanStandin(uploads) as server:
        yield server


class Sleeps(list[float]):
    def __call__(self, seconds: float) -> None:
        self.append(seconds)


def client(server: RodanStandin, **kw: Any) -> RodanClient:
    values: dict[str, Any] = {"email": EMAIL, "password": PASSWORD, "retries": 2, "sleep": Sleeps()}
    values.update(kw)
    c = RodanClient(server.url, **values)
    c.get_token()
    server.clear_requests()
    return c


def leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


# --- the download cap, on raw bytes -------------------------------------------------------------------


def test_a_chunked_body_without_length_stops_at_the_cap(srv: RodanStandin, tmp_path: Path) -> None:
    out = tmp_path / "dl"
    out.mkdir()
    srv.serve_generated("/uploads/p/stream", HUGE, chunked=True)  # no Content-Length
    with pytest.raises(PermanentError) as caught:
        client(srv).download("/uploads/p/stream", out / "input-0", max_bytes=CAP)
    assert str(caught.value) == (
        f"download of {srv.host_port}/uploads/p/stream stopped: it is larger than the limit of "
        f"{CAP} bytes (HPC_MAX_INPUT_BYTES)"
    )
    assert leftovers(out) == [], "the partial file is removed"
    (get,) = srv.requests
    assert get.header("Accept-Encoding") == "identity"
    assert get.sent < HUGE, "the client hung up: the server could not send it all"


def test_a_declared_length_over_the_cap_is_refused_before_reading(srv: RodanStandin, tmp_path: Path) -> None:
    c = client(srv)
    srv.serve_generated("/uploads/p/huge", HUGE, chunked=False)  # Content-Length: 256 MiB
    with pytest.raises(
        PermanentError, match=rf"refused: Rodan says it is {HUGE} bytes, larger than the limit of {CAP}"
    ):
        c.download("/uploads/p/huge", tmp_path / "o", max_bytes=CAP)
    with pytest.raises(PermanentError, match=rf"says it is {2 * MIB} bytes.*\(HPC_MAX_INPUT_BYTES\)"):
        c.download("/uploads/p/big.png", tmp_path / "o", max_bytes=CAP)
    assert leftovers(tmp_path) == ["rodan"], "no file, no partial file"
    huge, big = srv.requests
    assert (huge.status, big.status) == (200, 200), "permanent: not retried"
    assert huge.sent < HUGE, "the client hung up without reading the body"


def test_a_file_of_exactly_the_cap_is_fine(srv: RodanStandin, tmp_path: Path) -> None:
    result = client(srv).download("/uploads/p/exact.png", tmp_path / "o", max_bytes=CAP)
    assert result.bytes == CAP and (tmp_path / "o").read_bytes() == FILES["exact.png"]
    with pytest.raises(PermanentError, match="larger than the limit of"):
        client(srv).download("/uploads/p/exact.png", tmp_path / "o2", max_bytes=CAP - 1)


def test_a_gzip_bomb_is_refused_unopened(srv: RodanStandin, tmp_path: Path) -> None:
    srv.serve_gzip_bomb("/uploads/p/bomb", 64 * MIB)  # 64 MiB of zeros in about 64 KiB
    with pytest.raises(PermanentError, match=r"refused: Rodan sent it compressed \(Content-Encoding: gzip\)"):
        client(srv).download("/uploads/p/bomb", tmp_path / "o", max_bytes=CAP)
    assert leftovers(tmp_path) == ["rodan"], "nothing was written"
    assert [r.header("Accept-Encoding") for r in srv.requests] == ["identity"]
    with pytest.raises(PermanentError, match="compressed"):
        client(srv).check_input("/uploads/p/bomb", name="Image", max_bytes=CAP)


# --- only Rodan's origin ------------------------------------------------------------------------------


def foreign_resources(srv: RodanStandin, other: RodanStandin) -> list[str]:
    here = f"127.0.0.1:{srv.port}"
    return [
        f"{other.url}/uploads/p/page.png",  # another host
        f"http://localhost:{other.port}/uploads/p/page.png",
        f"http://localhost:{srv.port}/uploads/p/page.png",  # the same server by another name
        f"https://{here}/uploads/p/page.png",  # another scheme
        f"//{other.host_port}/uploads/p/page.png",  # a network-path reference
        f"http://{other.host_port}\\@{here}/uploads/p/page.png",  # urllib3 and urlsplit disagree
        f"http://{here}@{other.host_port}/uploads/p/page.png",
        f"http://user:pw@{other.host_port}/uploads/p/page.png",
        f"ftp://{other.host_port}/uploads/p/page.png",
        f"http://{other.host_port}\t/uploads/p/page.png",
        "uploads/p/page.png",  # relative: would glue onto the port
        f"http://127.0.0.1:{srv.port}\uff10/uploads/p/page.png",  # a full-width digit zero
    ]


def test_other_origins_are_refused_without_a_request(srv: RodanStandin, other: RodanStandin, tmp_path: Path) -> None:
    c = client(srv)
    for resource in foreign_resources(srv, other):
        with pytest.raises(PermanentError, match=r"is not a file on Rodan \(http://127\.0\.0\.1:\d+\)"):
            c.download(resource, tmp_path / "o", max_bytes=CAP)
        with pytest.raises(PermanentError, match=r"^input 'Image' is .* which is not a file on Rodan"):
            c.check_input(resource, name="Image", max_bytes=CAP)
    assert other.requests == [], "no request reached the other server"
    assert srv.requests == [], "nor Rodan, for a URL that only looks like it"
    assert not (tmp_path / "o").exists()
    # Rodan's own origin, by path or absolute URL (any case of the scheme), is fine.
    for resource in (
        "/uploads/p/page.png",
        f"{srv.url}/uploads/p/page.png",
        f"HTTP://{srv.host_port}/uploads/p/page.png",
    ):
        assert c.download(resource, tmp_path / "o", max_bytes=CAP).bytes == len(FILES["page.png"])
    assert all(r.authorization == f"Token {c.token}" for r in srv.requests)


def test_redirects_are_followed_only_within_rodan(srv: RodanStandin, other: RodanStandin, tmp_path: Path) -> None:
    c = client(srv)
    srv.redirect_next(1, f"{other.url}/uploads/p/page.png", paths="/uploads/p/page.png")
    with pytest.raises(PermanentError, match=r"refused: Rodan redirected it to .* which is not a file on Rodan"):
        c.download("/uploads/p/page.png", tmp_path / "o", max_bytes=CAP)
    assert other.requests == []
    srv.redirect_next(1, "/uploads/p/page.jpg", paths="/uploads/p/page.png", status=301)
    assert c.download("/uploads/p/page.png", tmp_path / "o", max_bytes=CAP).bytes == len(FILES["page.jpg"])
    assert [r.path for r in srv.requests][-2:] == ["/uploads/p/page.png", "/uploads/p/page.jpg"]
    srv.redirect_next(10, "/uploads/p/page.png", paths="/uploads/p/page.png")
    with pytest.raises(PermanentError, match="more than 5 redirects"):
        c.check_input("/uploads/p/page.png", name="Image", max_bytes=CAP)


# --- check_input: what the bridge asks before a job is submitted -------------------------------------


@pytest.mark.parametrize(("name", "kind"), [("page.png", "png"), ("page.jpg", "jpeg")])
def test_check_input_accepts_png_and_jpeg_in_one_ranged_get(srv: RodanStandin, name: str, kind: str) -> None:
    c = client(srv)
    info = c.check_input(f"/uploads/p/{name}", name="Image", max_bytes=CAP)
    assert info == InputInfo(f"{srv.url}/uploads/p/{name}", len(FILES[name]), kind)  # type: ignore[arg-type]
    (get,) = srv.requests
    assert (get.method, get.status, get.header("Range")) == ("GET", 206, "bytes=0-15")
    assert get.sent == 16 and get.authorization == f"Token {c.token}"


def test_check_input_when_rodan_ignores_the_range(srv: RodanStandin) -> None:
    srv.ignore_range()
    info = client(srv).check_input("/uploads/p/page.png", name="Image", max_bytes=CAP)
    assert (info.kind, info.bytes) == ("png", len(FILES["page.png"]))
    assert [(r.method, r.status) for r in srv.requests] == [("GET", 200)]
    with pytest.raises(PermanentError, match=rf"^input 'Image' is {2 * MIB} bytes, larger than the limit of {CAP} "):
        client(srv).check_input("/uploads/p/big.png", name="Image", max_bytes=CAP)
    srv.serve_generated("/uploads/p/huge", HUGE, chunked=False)  # a generated file ignores ranges too
    with pytest.raises(PermanentError, match=rf"^input 'Image' is {HUGE} bytes, larger than the limit of {CAP} "):
        client(srv).check_input("/uploads/p/huge", name="Image", max_bytes=CAP)
    (get,) = srv.requests
    assert (get.status, get.header("Range")) == (200, "bytes=0-15")
    assert get.sent < HUGE, "16 bytes were read, then the connection closed"


def test_check_input_asks_head_when_no_length_is_given(srv: RodanStandin) -> None:
    srv.serve_generated("/uploads/p/stream", None, chunked=True)  # without end, without length
    info = client(srv).check_input("/uploads/p/stream", name="Image", max_bytes=CAP)
    assert (info.kind, info.bytes) == ("png", None), "size unknown: the download's cap will hold"
    assert [r.method for r in srv.requests] == ["GET", "HEAD"]


def test_check_input_size_from_content_range(srv: RodanStandin) -> None:
    with pytest.raises(PermanentError) as caught:
        client(srv).check_input("/uploads/p/big.png", name="rgba PNG - Layer 0", max_bytes=CAP)
    assert str(caught.value) == (
        f"input 'rgba PNG - Layer 0' is {2 * MIB} bytes, larger than the limit of {CAP} bytes (HPC_MAX_INPUT_BYTES)"
    )
    assert [(r.status, r.sent) for r in srv.requests] == [(206, 16)]


@pytest.mark.parametrize("status", [404, 410])
def test_check_input_missing_file(srv: RodanStandin, status: int) -> None:
    if status == 410:
        srv.fail_next(1, 410, paths="/uploads/p/gone")
    with pytest.raises(PermanentError) as caught:
        client(srv).check_input("/uploads/p/gone", name="Image", max_bytes=CAP)
    assert str(caught.value) == f"input 'Image': Rodan has no file at /uploads/p/gone ({status})"
    assert len(srv.requests) == 1, "never retried"


@pytest.mark.parametrize(
    ("name", "start"),
    [
        ("page.gif", "47494638"),  # GIF8
        ("page.tif", "49492a00"),  # II*\0
        ("page.bmp", "424d"),
        ("page.eps", "252150532d41646f6265"),  # %!PS-Adobe
        ("page.html", "3c68746d6c3e"),  # <html>
    ],
)
def test_check_input_refuses_other_types(srv: RodanStandin, name: str, start: str) -> None:
    with pytest.raises(PermanentError) as caught:
        client(srv).check_input(f"/uploads/p/{name}", name="Background", max_bytes=CAP)
    message = str(caught.value)
    assert message.startswith(f"input 'Background' is not a PNG or JPEG file (it starts with {start}")
    assert message.endswith(f"{FILES[name][:16].hex()})")


def test_check_input_refuses_an_empty_file(srv: RodanStandin) -> None:
    with pytest.raises(PermanentError, match=r"^input 'Image' is not a PNG or JPEG file \(it is empty\)$"):
        client(srv).check_input("/uploads/p/empty", name="Image", max_bytes=CAP)
    assert [r.status for r in srv.requests] == [416]


@pytest.mark.parametrize("status", [500, 502, 503, 408, 429])
def test_check_input_retries_later_answers_then_gives_up_transient(srv: RodanStandin, status: int) -> None:
    srv.fail_next(100, status, paths="/uploads/")
    with pytest.raises(
        TransientError, match=rf"^checking input 'Image' \(.*/uploads/p/page.png\): server answered {status}$"
    ):
        client(srv, retries=2).check_input("/uploads/p/page.png", name="Image", max_bytes=CAP)
    assert len(srv.requests) == 3
    srv.clear_faults()
    srv.fail_next(2, status, paths="/uploads/", retry_after=5)
    sleeps = Sleeps()
    assert client(srv, sleep=sleeps).check_input("/uploads/p/page.png", name="Image", max_bytes=CAP).kind == "png"
    assert sleeps == [5, 5]


def test_check_input_unreachable_is_transient() -> None:
    c = RodanClient("http://127.0.0.1:9", retries=1, sleep=Sleeps())
    with pytest.raises(
        TransientError, match=r"^checking input 'Image' \(127\.0\.0\.1:9/uploads/x\) failed: ConnectionError$"
    ):
        c.check_input("/uploads/x", name="Image", max_bytes=CAP)


def test_check_input_refused_token_does_not_echo_the_body(srv: RodanStandin) -> None:
    srv.fail_next(1, 403, paths="/uploads/", detail="ask bob@example.org for the secret handshake")
    with pytest.raises(RodanAuthError) as caught:
        client(srv).check_input("/uploads/p/page.png", name="Image", max_bytes=CAP)
    assert "refused (403)" in str(caught.value) and "bob@" not in str(caught.value)


# --- opening images: PNG and JPEG only, with a pixel limit -----------------------------------------------


@pytest.fixture
def ghostscript(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Records any call of Pillow's Ghostscript runner (there must be none)."""
    calls: list[Any] = []

    def record(*args: Any, **kwargs: Any) -> Any:
        calls.append(args)
        raise OSError("Ghostscript was asked to run")

    monkeypatch.setattr(EpsImagePlugin, "Ghostscript", record)
    return calls


@pytest.mark.parametrize(
    ("name", "start"),
    [("page.eps", "252150532d"), ("page.tif", "49492a00"), ("page.bmp", "424d"), ("page.gif", "4749")],
)
def test_the_page_opener_refuses_other_formats(tmp_path: Path, ghostscript: list[Any], name: str, start: str) -> None:
    path = tmp_path / name
    path.write_bytes(FILES[name])
    with pytest.raises(TrainingInputError) as caught:
        load_page(path, {}, None)
    assert str(caught.value).startswith(
        f"the image ({name}) is not a readable image: not a PNG or JPEG file (it starts with {start}"
    )
    good = tmp_path / "page.png"
    good.write_bytes(FILES["page.png"])
    with pytest.raises(TrainingInputError, match=rf"^layer 'L' \({name}\) is not a readable image: not a PNG or JPEG"):
        load_page(good, {"L": path}, None)
    assert ghostscript == [], "Ghostscript never runs"


def test_the_page_opener_has_a_pixel_limit(tmp_path: Path) -> None:
    page = tmp_path / "page.png"
    page.write_bytes(FILES["page.png"])  # 30x20 = 600 pixels
    jpeg = tmp_path / "page.jpg"
    jpeg.write_bytes(FILES["page.jpg"])
    layer = tmp_path / "layer.png"
    alpha = np.full((20, 30, 4), 255, np.uint8)
    Image.fromarray(alpha, "RGBA").save(layer)
    default = Image.MAX_IMAGE_PIXELS
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a DecompressionBombWarning would fail the test
        assert load_page(page, {"L": layer}, None, max_pixels=600).image.shape == (20, 30, 3)
        assert load_page(jpeg, {}, None, max_pixels=600).image.shape == (20, 30, 3)
        with pytest.raises(TrainingInputError) as caught:
            load_page(page, {"L": layer}, None, max_pixels=599)
        assert str(caught.value) == (
            "the image (page.png) is larger (30x20 pixels) than the limit of 599 pixels per image "
            "(HPC_MAX_INPUT_PIXELS)"
        )
        with pytest.raises(
            TrainingInputError, match=r"^the image \(page.jpg\) is larger \(30x20 pixels\) than the limit of 200 "
        ):
            load_page(jpeg, {}, None, max_pixels=200)  # over twice the limit (where Pillow's check would raise)
        small = tmp_path / "small.png"
        Image.new("RGB", (15, 20)).save(small)  # 300 pixels: within the limit, but not its layer
        with pytest.raises(TrainingInputError, match=r"^layer 'L' \(layer.png\) is larger \(30x20 pixels\) than the"):
            load_page(small, {"L": layer}, None, max_pixels=300)
    assert Image.MAX_IMAGE_PIXELS == default, "Pillow's global is left as it was"


def test_the_pixel_limit_is_the_callers_not_pillows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An image within max_pixels opens, whatever Pillow's global limit says (its default, about 89
    million pixels, would refuse pages that HPC_MAX_INPUT_PIXELS' 400 million allows)."""
    page = tmp_path / "page.png"
    page.write_bytes(FILES["page.png"])  # 600 pixels
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100)  # Pillow would warn above 100, refuse above 200
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load_page(page, {}, None, max_pixels=600).image.shape == (20, 30, 3)
    assert Image.MAX_IMAGE_PIXELS == 100


# --- the worker: limits from the parameter file, and its error replies ------------------------------------


def test_the_parameter_file_carries_the_limits() -> None:
    from bridge.handoff import JobParameters

    raw = job_parameters_json()
    default = JobParameters.from_json(raw).limits
    assert (default.max_input_bytes, default.max_input_pixels) == (DEFAULT_MAX_INPUT_BYTES, DEFAULT_MAX_INPUT_PIXELS)
    new = JobParameters.from_json({**raw, "limits": {"max_input_bytes": 5000, "max_input_pixels": 7000}}).limits
    assert (new.max_input_bytes, new.max_input_pixels) == (5000, 7000)
    with pytest.raises(ValueError, match=r"missing field 'limits\.max_input_pixels'"):
        JobParameters.from_json({**raw, "limits": {"max_input_bytes": 5000}})  # no default of the worker's own


@pytest.mark.broker
@pytest.mark.parametrize(
    ("case", "expected"),
    [
        (
            "bytes",
            "the training job failed while downloading 'Image': download of {host}{image} stopped: it is larger "
            "than the limit of 1048576 bytes (HPC_MAX_INPUT_BYTES)",
        ),
        (
            "pixels",
            "the training job failed while reading the input images: the image (input-1) is larger "
            "({w}x{h} pixels) than the limit of 1024 pixels per image (HPC_MAX_INPUT_PIXELS)",
        ),
        (
            "eps",
            "the training job failed while reading the input images: layer 'Model 0' (input-3) is not a readable "
            "image: not a PNG or JPEG file (it starts with {eps})",
        ),
    ],
)
def test_the_worker_replies_naming_the_limit(
    tmp_path: Path,
    broker_url: str,
    queues: Any,
    standin: RodanStandin,
    sample_inputs: Any,
    rodan: Any,
    ghostscript: list[Any],
    monkeypatch: pytest.MonkeyPatch,
    case: str,
    expected: str,
) -> None:
    from bridge.spool import Spool, atomic_write_json
    from worker.job import run_job

    monkeypatch.setenv("TF_ENABLE_ONEDNN_OPTS", "0")  # no oneDNN measurement (and no cache file) for this

    spool = Spool(tmp_path / "spool").ensure()
    rodan.publish(b"{}")  # Rodan's queues exist
    rodan.drain(queues.request)
    inputs = sample_inputs("new", n_layers=1, height=64, width=96)
    limits = {"max_input_bytes": 1 << 30, "max_input_pixels": 1 << 30}
    if case == "bytes":
        standin.serve_generated(inputs["Image"], HUGE, chunked=True)  # the file changed since the intake's check
        limits["max_input_bytes"] = CAP
    elif case == "pixels":
        limits["max_input_pixels"] = 1024
    else:
        (standin.uploads_dir / "page.eps").write_bytes(FILES["page.eps"])
        inputs["rgba PNG - Layer 0"] = "/uploads/page.eps"
    params = job_parameters_json(
        correlation_id=f"corr-{case}",
        reply_to=queues.reply,
        inputs=inputs,
        layers=[["Background", "Background Model"], ["rgba PNG - Layer 0", "Model 0"]],
        settings={"epochs": 1, "max_samples_per_label": 100, "patch_height": 32, "patch_width": 32},
        rodan={"base_url": standin.url, "token": standin.user("hpc@example.org").token},
        broker={"url": broker_url},
        spool=str(spool.root),
        limits=limits,
    )
    atomic_write_json(spool.params_path(f"corr-{case}"), params)
    assert run_job(spool.params_path(f"corr-{case}")) == 1
    (reply,) = rodan.drain()
    assert reply[0] == f"corr-{case}"
    error = json.loads(reply[1])["error"]
    assert error == expected.format(
        host=standin.host_port, image=inputs["Image"], w=96, h=64, eps=FILES["page.eps"][:16].hex()
    )
    assert ghostscript == []
