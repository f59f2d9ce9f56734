"""The wire contract: both generations, defaults, and every kind of invalid request."""

from __future__ import annotations

import base64
import json

import pytest

from bridge.errors import InvalidRequest
from bridge.protocol import (
    Generation,
    error_reply,
    parse_duration_minutes,
    parse_request,
    reply_is_error,
    success_reply,
)
from bridge.schedulers.base import format_duration

P = "/uploads/projects/0123456789abcdef0123456789abcdef/resources/{}/original_file"
OLD_INPUTS = {
    n: P.format(i)
    for i, n in enumerate(["Image", "Background", "Music Layer", "Staff Layer", "Text", "Selected Regions"])
}
NEW_INPUTS = {
    n: P.format(i)
    for i, n in enumerate(
        ["Image", "Background", "Selected Regions", "rgba PNG - Layer 0", "rgba PNG - Layer 1", "rgba PNG - Layer 2"]
    )
}


def parse(inputs: dict[str, str], settings: dict[str, object] | None = None) -> object:
    body = json.dumps({"inputs": inputs, "settings": settings or {}}).encode()
    return parse_request(body, correlation_id="c", reply_to="r")


def test_old_generation_reply_keys_in_training_order() -> None:
    req = parse(OLD_INPUTS)
    assert req.generation is Generation.OLD
    assert req.reply_keys == ["Background Model", "Music Symbol Model", "Staff Lines Model", "Text Model"]
    assert [layer.input_name for layer in req.layers] == ["Background", "Music Layer", "Staff Layer", "Text"]


def test_new_generation_numbered_layers() -> None:
    req = parse(NEW_INPUTS)
    assert req.generation is Generation.NEW
    assert req.reply_keys == ["Background Model", "Model 0", "Model 1", "Model 2"]


def test_defaults_apply_for_missing_settings() -> None:
    s = parse(NEW_INPUTS).settings
    assert (s.epochs, s.max_samples_per_label, s.patch_height, s.patch_width) == (15, 10000, 256, 256)
    assert (s.max_time, s.max_memory_mb, s.cpus, s.notification_email) == ("0-06:00", 257000, 6, "")
    assert (s.batch_size, s.patience) == (16, 3)


def test_settings_are_taken_and_integral_floats_become_int() -> None:
    s = parse(
        NEW_INPUTS,
        {
            "Maximum number of training epochs": 3.0,
            "CPUs": 2,
            "Maximum time (D-HH:MM)": "1-02:30",
            "Slurm Notification Email": "a.b@example.org",
        },
    ).settings
    assert s.epochs == 3 and isinstance(s.epochs, int)
    assert s.max_time_minutes == 1 * 1440 + 2 * 60 + 30
    assert s.notification_email == "a.b@example.org"


@pytest.mark.parametrize(
    ("settings", "fragment"),
    [
        ({"CPUs": "6"}, "'settings/CPUs' must be of type integer"),
        ({"CPUs": True}, "must be of type integer"),
        ({"CPUs": 0}, "must be >= 1"),
        ({"Patch height": 32}, "must be >= 64"),
        ({"Patch height": 65}, "'settings/Patch height' must be a multiple of 4, not 65"),
        ({"Patch width": 130}, "'settings/Patch width' must be a multiple of 4, not 130"),
        ({"Maximum number of samples per label": 99}, ">= 100"),
        ({"Maximum memory (MB)": 512}, ">= 1024"),
        ({"Maximum number of training epochs": 10**12}, "<="),
        ({"Maximum time (D-HH:MM)": "6:00"}, "must look like 0-06:00"),
        ({"Maximum time (D-HH:MM)": "0-24:00"}, "hours > 23"),
        ({"Maximum time (D-HH:MM)": "0-00:00"}, "at least one minute"),
        ({"Maximum time (D-HH:MM)": "0-01:00\n#SBATCH --uid=0"}, "Maximum time"),
        ({"Slurm Notification Email": "not-an-address"}, "not an e-mail address"),
        ({"Slurm Notification Email": "a@b.org --uid=0"}, "not an e-mail address"),
        ({"Slurm Notification Email": "a@b.org\n#SBATCH -A x"}, "not an e-mail address"),
        # An address is an argument of sbatch --mail-user / qsub -M: it must never read as an option.
        ({"Slurm Notification Email": "-oProxyCommand@b.org"}, "not an e-mail address"),
        ({"Slurm Notification Email": "a@-b.org"}, "not an e-mail address"),
    ],
)
def test_invalid_settings_are_rejected_with_the_setting_named(settings: dict[str, object], fragment: str) -> None:
    with pytest.raises(InvalidRequest) as err:
        parse(NEW_INPUTS, settings)
    assert fragment in str(err.value)


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        (b"{not json", "not valid JSON"),
        (b"\xff\xfe", "not valid JSON"),
        (b"[1, 2]", "JSON object"),
        (b'{"settings": {}}', "'inputs' is a required property"),
        (b'{"inputs": {"Image": 3}, "settings": {}}', "must be of type string"),
        (b" " * (2 << 20), "more than"),
    ],
)
def test_malformed_bodies(body: bytes, fragment: str) -> None:
    with pytest.raises(InvalidRequest) as err:
        parse_request(body, correlation_id="c", reply_to="r")
    assert fragment in str(err.value)


def test_missing_unknown_and_mixed_inputs() -> None:
    with pytest.raises(InvalidRequest, match="missing inputs"):
        parse({k: v for k, v in OLD_INPUTS.items() if k != "Text"})
    with pytest.raises(InvalidRequest, match="missing inputs"):
        parse({k: v for k, v in NEW_INPUTS.items() if k != "Selected Regions"})
    with pytest.raises(InvalidRequest, match="mixes the two Rodan job generations"):
        parse({**NEW_INPUTS, "Music Layer": P.format(9)})
    with pytest.raises(InvalidRequest, match="unknown inputs"):
        parse({**NEW_INPUTS, "Surprise": P.format(9)})
    with pytest.raises(InvalidRequest, match="contiguous"):
        parse({k: v for k, v in NEW_INPUTS.items() if k != "rgba PNG - Layer 1"})
    with pytest.raises(InvalidRequest, match="unknown input"):
        parse({**NEW_INPUTS, "rgba PNG - Layer 03": P.format(9)})
    with pytest.raises(InvalidRequest, match="missing inputs"):
        parse({"Image": P.format(1)})


@pytest.mark.parametrize(
    ("value", "fragment"),
    [
        ("/uploads/../../etc/passwd", "'..' path segment"),
        ("file:///etc/passwd", "path on the Rodan host or an http"),
        ("uploads/relative", "path on the Rodan host or an http"),
        ("/uploads/a\nb", "control characters"),
    ],
)
def test_bad_resource_values(value: str, fragment: str) -> None:
    with pytest.raises(InvalidRequest) as err:
        parse({**NEW_INPUTS, "Image": value})
    assert fragment in str(err.value)


def test_absolute_urls_are_accepted_as_resources() -> None:
    req = parse({**NEW_INPUTS, "Image": "https://rodan.example.org/uploads/x/original_file"})
    assert req.inputs["Image"].startswith("https://")


def test_durations_round_trip() -> None:
    for text in ["0-00:01", "0-06:00", "2-23:59", "365-00:00"]:
        assert format_duration(parse_duration_minutes(text)) == text


def test_replies_use_standard_base64_that_rodan_decodes() -> None:
    payload = bytes(range(256)) * 300
    body = success_reply({"Model 0": payload})
    data = json.loads(body)
    assert "\n" in data["Model 0"]  # encodebytes style, like the original HPC side
    assert base64.decodebytes(data["Model 0"].encode()) == payload
    assert not reply_is_error(body)
    assert reply_is_error(error_reply("boom"))
    assert json.loads(error_reply("boom")) == {"error": "boom"}
