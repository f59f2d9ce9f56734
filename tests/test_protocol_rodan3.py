"""The wire contract of generation 3 (Rodan 3.x through our job package, docs/protocol.md §2.5):
recognition, inputs and their roles, settings with FastPacoTrainer's defaults, every kind of
invalid request; and that the older generations' settings are untouched by it."""

from __future__ import annotations

import json
from typing import Any

import pytest

from bridge.errors import InvalidRequest
from bridge.handoff import DEFAULT_REPLY_PART_BYTES
from bridge.protocol import (
    Generation,
    InputRole,
    JobRequest,
    generation_hint,
    parse_request,
)
from bridge.replies import part_bytes_for
from bridge.rodan import IMAGE_KINDS, sniff, wrong_kind

P = "/uploads/projects/0123456789abcdef0123456789abcdef/resources/{}/original_file"


def res(i: int) -> str:
    return P.format(f"{i:032x}")


def parse(inputs: dict[str, str], settings: dict[str, Any] | None = None) -> JobRequest:
    body = json.dumps({"inputs": inputs, "settings": settings or {}}).encode()
    return parse_request(body, correlation_id="c", reply_to="hpc-results.c")


def test_samples_and_starting_models_are_generation_3_with_roles_in_the_workers_order() -> None:
    # Given in a scrambled order: the roles come back samples by number, the multi-sample zip,
    # then the starting models, Background first.
    inputs = {
        "Model 2": res(1),
        "Sample 10": res(2),
        "Background Model": res(3),
        "Multi-Sample Zip": res(4),
        "Sample 2": res(5),
        "Model 1": res(6),
    }
    req = parse(inputs)
    assert req.generation is Generation.RODAN3 and req.generation.replies_in_parts
    assert list(req.roles.items()) == [
        ("Sample 2", InputRole.SAMPLE),
        ("Sample 10", InputRole.SAMPLE),
        ("Multi-Sample Zip", InputRole.MULTI_SAMPLE),
        ("Background Model", InputRole.MODEL),
        ("Model 1", InputRole.MODEL),
        ("Model 2", InputRole.MODEL),
    ]
    assert req.inputs == inputs
    assert req.layers == () and req.reply_keys == []  # only the worker knows them, from the zips
    # request_valid's fields: no "layers": 0 (catches a log_fields that counts req.layers here)
    assert req.log_fields() == {"sample_zips": 3, "starting_models": 3}


@pytest.mark.parametrize(
    "inputs",
    [
        {"Sample 1": res(1)},
        {"Multi-Sample Zip": res(1)},
        {f"Sample {i}": res(i) for i in range(1, 21)},
        {
            **{f"Sample {i}": res(i) for i in range(1, 21)},
            "Multi-Sample Zip": res(21),
            "Background Model": res(22),
            **{f"Model {i}": res(22 + i) for i in range(1, 10)},
        },
    ],
    ids=["one sample", "only the multi-sample zip", "20 samples", "every input (31)"],
)
def test_every_input_is_optional_but_one_sample(inputs: dict[str, str]) -> None:
    req = parse(inputs)
    assert req.generation is Generation.RODAN3
    assert set(req.roles) == set(inputs)


def test_older_generations_get_their_roles_and_keep_their_layers() -> None:
    old = {
        n: res(i)
        for i, n in enumerate(["Image", "Background", "Music Layer", "Staff Layer", "Text", "Selected Regions"])
    }
    req = parse(old)
    assert req.generation is Generation.OLD and not req.generation.replies_in_parts
    assert set(req.roles.values()) == {InputRole.IMAGE} and set(req.roles) == set(old)
    assert req.reply_keys == ["Background Model", "Music Symbol Model", "Staff Lines Model", "Text Model"]
    assert req.log_fields() == {"layers": 4}  # request_valid's fields stay as they were for them


def test_fast_paco_trainers_defaults_apply() -> None:
    s = parse({"Sample 1": res(1)}).settings
    assert (s.batch_size, s.epochs, s.max_samples_per_label, s.patience) == (8, 50, 1000, 15)
    assert (s.patch_height, s.patch_width) == (256, 256)
    assert (s.max_time, s.max_memory_mb, s.cpus, s.notification_email) == ("1-00:00", 16000, 4, "")
    assert s.max_time_minutes == 1440


def test_generation_3_settings_are_taken_with_their_own_names() -> None:
    s = parse(
        {"Sample 1": res(1)},
        {
            "Batch Size": 64,
            "Maximum number of training epochs": 3.0,
            "Maximum number of samples per label": 100,
            "Patience": 2,
            "Patch height": 32,
            "Patch width": 36,
            "Maximum time (D-HH:MM)": "0-02:30",
            "Maximum memory (MB)": 8000,
            "CPUs": 2,
            "Slurm Notification Email": "me@example.org",
            "Batch size": 99,  # the older generations' name: not generation 3's, ignored
        },
    ).settings
    assert (s.batch_size, s.epochs, s.max_samples_per_label, s.patience) == (64, 3, 100, 2)
    assert isinstance(s.epochs, int)
    assert (s.patch_height, s.patch_width, s.max_time, s.max_memory_mb, s.cpus) == (32, 36, "0-02:30", 8000, 2)
    assert s.notification_email == "me@example.org"


def test_the_older_generations_ignore_generation_3s_batch_size_and_keep_their_bounds() -> None:
    new = {n: res(i) for i, n in enumerate(["Image", "Background", "Selected Regions", "rgba PNG - Layer 0"])}
    s = parse(new, {"Batch Size": 2}).settings
    assert s.batch_size == 16  # 'Batch Size' is not theirs: the default stays
    with pytest.raises(InvalidRequest, match=r"'settings/Patch height' must be >= 64"):
        parse(new, {"Patch height": 32})


@pytest.mark.parametrize(
    ("settings", "fragment"),
    [
        ({"Batch Size": 65}, "'settings/Batch Size' must be <= 64"),
        ({"Batch Size": 0}, "'settings/Batch Size' must be >= 1"),
        ({"Batch Size": "8"}, "'settings/Batch Size' must be of type integer"),
        ({"Batch Size": None}, "'settings/Batch Size' must be of type integer"),
        ({"Patch height": 28}, "'settings/Patch height' must be >= 32"),
        ({"Patch width": 34}, "'settings/Patch width' must be a multiple of 4, not 34"),
        ({"Maximum number of samples per label": 99}, "must be >= 100"),
        ({"Patience": 0}, "'settings/Patience' must be >= 1"),
        ({"Maximum time (D-HH:MM)": "24:00"}, "must look like 0-06:00"),
        ({"Maximum memory (MB)": 100}, "'settings/Maximum memory (MB)' must be >= 1024"),
        ({"CPUs": 0}, "'settings/CPUs' must be >= 1"),
        ({"Slurm Notification Email": "-x@y.org"}, "is not an e-mail address"),
    ],
)
def test_a_bad_setting_is_refused_by_name(settings: dict[str, Any], fragment: str) -> None:
    with pytest.raises(InvalidRequest) as caught:
        parse({"Sample 1": res(1)}, settings)
    assert fragment in str(caught.value)


@pytest.mark.parametrize(
    "name",
    [
        "Sample 0",
        "Sample 21",
        "Sample 01",
        "Sample 1a",
        "Sample \u0661",  # an Arabic-Indic digit one: isdigit(), but not a plain ASCII digit
        "Sample -1",
        "Sample  1",
        "Model 0",
        "Model 10",
        "Model 01",
        "Sample 1 ",
        "sample 2",
        "Multi-sample Zip",
        "Log File",
    ],
)
def test_an_unknown_input_is_refused_with_the_names_a_request_takes(name: str) -> None:
    with pytest.raises(InvalidRequest) as caught:
        parse({"Sample 1": res(1), name: res(2)})
    message = str(caught.value)
    assert message.startswith(f"unknown inputs: [{name!r}]"), message
    assert "'Sample 1'...'Sample 20', 'Multi-Sample Zip', 'Background Model' and 'Model 1'...'Model 9'" in message


@pytest.mark.parametrize("older", ["Image", "Background", "Selected Regions", "Music Layer", "rgba PNG - Layer 0"])
def test_mixing_with_an_older_generations_inputs_is_refused(older: str) -> None:
    with pytest.raises(InvalidRequest) as caught:
        parse({"Sample 1": res(1), older: res(2)})
    assert str(caught.value).startswith(f"request mixes Rodan job generations: [{older!r}] (Rodan 2 job)")


def test_starting_models_without_a_sample_are_refused_as_generation_3() -> None:
    with pytest.raises(InvalidRequest, match="a Rodan 3 request needs at least one 'Sample N' or 'Multi-Sample Zip'"):
        parse({"Background Model": res(1), "Model 1": res(2)})


def test_a_sample_alone_as_sample_0_is_refused_not_taken_for_an_older_generation() -> None:
    with pytest.raises(InvalidRequest, match=r"unknown inputs: \['Sample 0'\]"):
        parse({"Sample 0": res(1)})


def test_resources_are_checked_as_for_the_other_generations() -> None:
    with pytest.raises(InvalidRequest, match=r"contains a '\.\.' path segment"):
        parse({"Sample 1": "/uploads/../etc/passwd"})
    body = json.dumps({"inputs": {"Sample 1": "https://elsewhere.example/x"}}).encode()
    with pytest.raises(InvalidRequest, match="inputs are only downloaded from Rodan"):
        parse_request(body, correlation_id="c", reply_to="r", rodan_origin="https://rodan.example")


@pytest.mark.parametrize(
    ("body", "hint"),
    [
        (b'{"inputs": {"Sample 0": "/u"}}', Generation.RODAN3),
        (b'{"inputs": {"Multi-Sample Zip": 5}, "settings": 1}', Generation.RODAN3),
        (b'{"inputs": {"Model 1": "/u"}}', Generation.RODAN3),
        (b'{"inputs": {"rgba PNG - Layer 0": "/u"}}', Generation.NEW),
        (b'{"inputs": {"Image": "/u"}}', Generation.OLD),
        (b'{"inputs": []}', None),
        (b"[1]", None),
        (b"{not json", None),
        (b"\xff\xfe", None),
        (b"[" * 100_000, None),
    ],
)
def test_the_generation_hint_of_any_body(body: bytes, hint: Generation | None) -> None:
    """What shape an error reply takes (parts or not) for a body that may not even parse."""
    assert generation_hint(body) is hint


def test_only_generation_3_is_answered_in_parts() -> None:
    assert part_bytes_for(Generation.RODAN3, DEFAULT_REPLY_PART_BYTES) == DEFAULT_REPLY_PART_BYTES == 8 << 20
    assert part_bytes_for("rodan3", 1234) == 1234
    for generation in (Generation.OLD, Generation.NEW, "old", "new", "", "nonsense"):
        assert part_bytes_for(generation, 1234) is None


def test_the_first_bytes_decide_an_inputs_kind_and_the_older_text_stays() -> None:
    zip_head = b"PK\x03\x04\x14\x00\x00\x00\x08\x00" + bytes(6)
    hdf5_head = b"\x89HDF\r\n\x1a\n" + bytes(8)
    assert (sniff(zip_head), sniff(hdf5_head), sniff(b"PK\x05\x06" + bytes(12))) == ("zip", "hdf5", None)
    assert (sniff(b"\x89PNG\r\n\x1a\n"), sniff(b"\xff\xd8\xff\xe0")) == ("png", "jpeg")
    # The older generations' reason, word for word as before generation 3, for a zip too.
    assert wrong_kind("Image", zip_head, IMAGE_KINDS) == (
        f"input 'Image' is not a PNG or JPEG file (it starts with {zip_head.hex()})"
    )
    assert wrong_kind("Image", b"", IMAGE_KINDS) == "input 'Image' is not a PNG or JPEG file (it is empty)"
    assert wrong_kind("Sample 3", b"PK\x05\x06" + bytes(12), ("zip",)) == (
        "input 'Sample 3' is not a zip file (a sample as Pixel.js writes it) (it is an empty zip archive)"
    )
    assert wrong_kind("Model 1", zip_head, ("hdf5",)).startswith(
        "input 'Model 1' is not an HDF5 file (a Keras model) (it starts with 504b0304"
    )
