"""The wire contract with Rodan (docs/protocol.md): request parsing, validation, replies.

Two generations of Rodan's own job are in the field, and a third (Rodan 3.x, our job package:
docs/design-rodan3.md); all are accepted, each recognised per request from its input names, and
each is answered with its own reply keys. Everything here is pure (no I/O) so it is cheap to test
exhaustively.
"""

from __future__ import annotations

import base64
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Any
from urllib.parse import unquote, urlsplit

import jsonschema

from bridge.errors import InvalidRequest

MAX_BODY_BYTES = 1 << 20  # a request is a few hundred bytes; anything this big is not Rodan's
#: An error reason is cut to this many characters wherever it goes (reply, ledger, log, dead letter).
MAX_REASON_CHARS = 1000


class Generation(str, Enum):
    OLD = "old"  # 4 named layers (Rodan's first HPC job)
    NEW = "new"  # N numbered layers
    RODAN3 = "rodan3"  # Rodan 3.x through our job package: sample zips, starting models (§2.5)

    @property
    def replies_in_parts(self) -> bool:
        """Whether this generation's reply goes out in parts (docs/protocol.md §3.5)."""
        return self is Generation.RODAN3


class InputRole(str, Enum):
    """What an input holds, hence which first bytes it must have (checked at intake)."""

    IMAGE = "image"  # the older generations' image and masks: PNG or JPEG
    SAMPLE = "sample"  # generation 3: one Pixel.js sample zip
    MULTI_SAMPLE = "multi-sample"  # generation 3: a zip of sample folders
    MODEL = "model"  # generation 3: a starting model, Keras HDF5


IMAGE = "Image"
BACKGROUND = "Background"
SELECTED_REGIONS = "Selected Regions"
NEW_LAYER_PREFIX = "rgba PNG - Layer "
MAX_NEW_LAYERS = 10

# Old generation: input name -> reply key, in training order.
OLD_LAYERS: dict[str, str] = {
    BACKGROUND: "Background Model",
    "Music Layer": "Music Symbol Model",
    "Staff Layer": "Staff Lines Model",
    "Text": "Text Model",
}
OLD_ONLY_INPUTS = frozenset(OLD_LAYERS) - {BACKGROUND}

# Generation 3 (Rodan 3.x, FastPacoTrainer's ports): every input optional, at least one sample.
SAMPLE_PREFIX = "Sample "
MAX_SAMPLES = 20
MULTI_SAMPLE_ZIP = "Multi-Sample Zip"
BACKGROUND_MODEL = "Background Model"
MODEL_PREFIX = "Model "
MAX_STARTING_MODELS = 9


@dataclass(frozen=True)
class RequestSettings:
    """A request's settings, Rodan's defaults applied (docs/protocol.md §2.4): the only copy of those defaults.

    The scheduler's (``max_time``, ``max_memory_mb``, ``cpus``, ``notification_email``) go into the
    job spec; the trainer's reach it through the parameter file (``bridge.handoff``), where the
    worker builds its ``worker.trainer.TrainSettings`` from them.
    """

    epochs: int = 15
    max_samples_per_label: int = 10000
    patch_height: int = 256
    patch_width: int = 256
    max_time: str = "0-06:00"
    max_memory_mb: int = 257000
    cpus: int = 6
    notification_email: str = ""
    batch_size: int = 16
    patience: int = 3

    @property
    def max_time_minutes(self) -> int:
        return parse_duration_minutes(self.max_time)


# Rodan's setting name -> (attribute, JSON schema fragment). Upper bounds keep
# absurd values out of scheduler arguments; they are far above any real job.
SETTING_FIELDS: dict[str, tuple[str, dict[str, Any]]] = {
    "Maximum number of training epochs": ("epochs", {"type": "integer", "minimum": 1, "maximum": 100000}),
    "Maximum number of samples per label": (
        "max_samples_per_label",
        {"type": "integer", "minimum": 100, "maximum": 100_000_000},
    ),
    # The network halves a patch twice and doubles it back: a side that is not a multiple of 4
    # would fail in the trainer after the job had waited and downloaded; refuse it here.
    "Patch height": ("patch_height", {"type": "integer", "minimum": 64, "maximum": 8192, "multipleOf": 4}),
    "Patch width": ("patch_width", {"type": "integer", "minimum": 64, "maximum": 8192, "multipleOf": 4}),
    "Maximum time (D-HH:MM)": ("max_time", {"type": "string", "maxLength": 16}),
    "Maximum memory (MB)": ("max_memory_mb", {"type": "integer", "minimum": 1024, "maximum": 64_000_000}),
    "CPUs": ("cpus", {"type": "integer", "minimum": 1, "maximum": 4096}),
    "Slurm Notification Email": ("notification_email", {"type": "string", "maxLength": 254}),
    # Optional settings a newer Rodan job may send; the defaults are the original trainer's values.
    "Batch size": ("batch_size", {"type": "integer", "minimum": 1, "maximum": 4096}),
    "Patience": ("patience", {"type": "integer", "minimum": 1, "maximum": 1000}),
}

# Generation 3's settings: FastPacoTrainer's names and bounds (note 'Batch Size', capital S) and the
# cluster's. RODAN3_SETTINGS is the only copy of its defaults (docs/protocol.md §2.5).
RODAN3_SETTING_FIELDS: dict[str, tuple[str, dict[str, Any]]] = {
    "Batch Size": ("batch_size", {"type": "integer", "minimum": 1, "maximum": 64}),
    "Maximum number of training epochs": ("epochs", {"type": "integer", "minimum": 1, "maximum": 100000}),
    "Maximum number of samples per label": (
        "max_samples_per_label",
        {"type": "integer", "minimum": 100, "maximum": 100_000_000},
    ),
    "Patience": ("patience", {"type": "integer", "minimum": 1, "maximum": 1000}),
    "Patch height": ("patch_height", {"type": "integer", "minimum": 32, "maximum": 8192, "multipleOf": 4}),
    "Patch width": ("patch_width", {"type": "integer", "minimum": 32, "maximum": 8192, "multipleOf": 4}),
    "Maximum time (D-HH:MM)": ("max_time", {"type": "string", "maxLength": 16}),
    "Maximum memory (MB)": ("max_memory_mb", {"type": "integer", "minimum": 1024, "maximum": 64_000_000}),
    "CPUs": ("cpus", {"type": "integer", "minimum": 1, "maximum": 4096}),
    "Slurm Notification Email": ("notification_email", {"type": "string", "maxLength": 254}),
}
RODAN3_SETTINGS = RequestSettings(
    epochs=50,
    max_samples_per_label=1000,
    patch_height=256,
    patch_width=256,
    max_time="1-00:00",
    max_memory_mb=16000,
    cpus=4,
    notification_email="",
    batch_size=8,
    patience=15,
)


def _request_schema(setting_fields: Mapping[str, tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    return {
        "type": "object",
        "required": ["inputs"],
        "properties": {
            "inputs": {
                "type": "object",
                "maxProperties": 32,
                "propertyNames": {"maxLength": 64},
                "additionalProperties": {"type": "string", "minLength": 1, "maxLength": 4096},
            },
            "settings": {
                "type": "object",
                "properties": {name: schema for name, (_, schema) in setting_fields.items()},
            },
        },
    }


REQUEST_SCHEMA: dict[str, Any] = _request_schema(SETTING_FIELDS)
RODAN3_REQUEST_SCHEMA: dict[str, Any] = _request_schema(RODAN3_SETTING_FIELDS)
_validator = jsonschema.Draft202012Validator(REQUEST_SCHEMA)
_rodan3_validator = jsonschema.Draft202012Validator(RODAN3_REQUEST_SCHEMA)

# Matched with fullmatch: a '$' would also accept a trailing newline (into a batch-script directive).
_DURATION = re.compile(r"([0-9]{1,3})-([0-9]{2}):([0-9]{2})")
# Neither part may begin with '-': the address is an argument of sbatch --mail-user / qsub -M.
_EMAIL = re.compile(r"[A-Za-z0-9._%+][A-Za-z0-9._%+-]{0,63}@[A-Za-z0-9][A-Za-z0-9-]{0,62}(\.[A-Za-z0-9-]{1,63})+")


@dataclass(frozen=True)
class LayerSpec:
    """One model to train: which input holds its mask and which reply key carries it."""

    input_name: str
    reply_key: str


@dataclass(frozen=True)
class JobRequest:
    """A valid request. ``roles``: every input's role, in the order the worker takes them
    (generation 3: samples by number, the Multi-Sample Zip, then the starting models by number).
    ``layers``: the models to train, for the older generations; empty for generation 3, whose
    layers are only known once the worker has opened the sample zips."""

    correlation_id: str
    reply_to: str
    generation: Generation
    inputs: dict[str, str]
    settings: RequestSettings
    layers: tuple[LayerSpec, ...] = field(default_factory=tuple)
    roles: dict[str, InputRole] = field(default_factory=dict)

    @property
    def reply_keys(self) -> list[str]:
        return [layer.reply_key for layer in self.layers]

    def log_fields(self) -> dict[str, int]:
        """What the ``request_valid`` log event says of the request's size: ``layers`` for the older
        generations; for generation 3, whose layers are inside the sample zips, ``sample_zips`` (the
        Sample inputs and the Multi-Sample Zip) and ``starting_models``, never a ``layers`` of 0."""
        if self.generation is not Generation.RODAN3:
            return {"layers": len(self.layers)}
        roles = list(self.roles.values())
        zips = roles.count(InputRole.SAMPLE) + roles.count(InputRole.MULTI_SAMPLE)
        return {"sample_zips": zips, "starting_models": roles.count(InputRole.MODEL)}


def parse_duration_minutes(text: str) -> int:
    """``D-HH:MM`` -> minutes. Raises InvalidRequest naming the setting."""
    match = _DURATION.fullmatch(text)
    if not match:
        raise InvalidRequest(f"'Maximum time (D-HH:MM)' must look like 0-06:00, got {text!r}")
    days, hours, minutes = (int(g) for g in match.groups())
    if hours > 23 or minutes > 59:
        raise InvalidRequest(f"'Maximum time (D-HH:MM)' has hours > 23 or minutes > 59: {text!r}")
    total = days * 1440 + hours * 60 + minutes
    if total < 1:
        raise InvalidRequest("'Maximum time (D-HH:MM)' must be at least one minute")
    return total


def bounded(reason: str, limit: int = MAX_REASON_CHARS) -> str:
    """``reason`` cut to ``limit`` characters (a request can make a reason as long as itself)."""
    return reason if len(reason) <= limit else reason[: limit - 13] + " (truncated)"


def without_private(text: str, paths: Mapping[str, str], names: Mapping[str, str]) -> str:
    """``text`` for Rodan's users: each of ``paths`` (a path prefix -> its placeholder, e.g. the
    spool -> ``<spool>``) and of ``names`` (a whole word such as an account -> ``<account>``)
    replaced. Error replies are shown to everyone who can open the Rodan job."""
    for path in sorted((p for p in paths if len(p) > 1), key=len, reverse=True):
        text = text.replace(path, paths[path])
    for name in sorted((n for n in names if n), key=len, reverse=True):
        text = re.sub(rf"(?<![\w.-]){re.escape(name)}(?![\w-])", names[name], text)
    return text


def decode_body(body: bytes) -> dict[str, Any]:
    if len(body) > MAX_BODY_BYTES:
        raise InvalidRequest(f"request body is {len(body)} bytes, more than the {MAX_BODY_BYTES} allowed")
    try:
        data = json.loads(body.decode("utf-8"))
    except ValueError as exc:  # UnicodeDecodeError, JSONDecodeError, an integer of more than 4300 digits
        raise InvalidRequest(f"request body is not valid JSON: {str(exc)[:200]}") from None
    except RecursionError:  # arrays or objects nested thousands deep
        raise InvalidRequest("request body is not valid JSON: nested too deeply") from None
    if not isinstance(data, dict):
        raise InvalidRequest("request body must be a JSON object with 'inputs' and 'settings'")
    try:  # JSON's \ud800 escapes decode to lone surrogates, which no file, log or reply can hold
        json.dumps(data, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidRequest("request body is not valid JSON: it holds an unpaired surrogate") from None
    return data


def parse_request(body: bytes, *, correlation_id: str, reply_to: str, rodan_origin: str = "") -> JobRequest:
    """Validate a raw request body; raise :class:`InvalidRequest` with every problem found.

    ``rodan_origin`` (``https://host[:port]``): absolute resource URLs must point there. Nothing but
    :class:`InvalidRequest` leaves this function, whatever the body holds.
    """
    try:
        return _parse_request(body, correlation_id=correlation_id, reply_to=reply_to, rodan_origin=rodan_origin)
    except InvalidRequest:
        raise
    except Exception as exc:  # a defect in the checks below must not become a crash of the pass
        raise InvalidRequest(f"request could not be read ({type(exc).__name__})") from exc


def _parse_request(body: bytes, *, correlation_id: str, reply_to: str, rodan_origin: str) -> JobRequest:
    data = decode_body(body)
    rodan3 = _names_rodan3(data.get("inputs"))
    validator = _rodan3_validator if rodan3 else _validator
    errors = sorted(validator.iter_errors(data), key=lambda e: list(e.absolute_path))
    if errors:
        raise InvalidRequest("invalid request: " + "; ".join(_describe(e) for e in errors[:5]))
    inputs: dict[str, str] = dict(data["inputs"])
    layers: list[LayerSpec] = []
    if rodan3:
        generation, roles = Generation.RODAN3, _identify_rodan3(inputs)
    else:
        generation, layers = _identify_layers(inputs)
        roles = {name: InputRole.IMAGE for name in inputs}
    for name, value in inputs.items():
        check_resource(name, value, rodan_origin)
    if rodan3:
        settings = _settings(data.get("settings") or {}, RODAN3_SETTING_FIELDS, RODAN3_SETTINGS)
    else:
        settings = _settings(data.get("settings") or {})
    return JobRequest(
        correlation_id=correlation_id,
        reply_to=reply_to,
        generation=generation,
        inputs=inputs,
        settings=settings,
        layers=tuple(layers),
        roles=roles,
    )


def generation_hint(body: bytes) -> Generation | None:
    """The generation a request body's input names point at, without judging it (None when the
    body is not even an object of inputs): which shape an error reply to it takes. Never raises."""
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if not isinstance(data, dict) or not isinstance(data.get("inputs"), dict):
        return None
    names = data["inputs"]
    if _names_rodan3(names):
        return Generation.RODAN3
    if any(isinstance(n, str) and n.startswith(NEW_LAYER_PREFIX) for n in names):
        return Generation.NEW
    return Generation.OLD


def _names_rodan3(inputs: object) -> bool:
    """Generation 3 is recognised by any input named ``Sample ...`` or ``Multi-Sample Zip``, or by
    inputs that are all starting models (which then lack a sample: refused as generation 3)."""
    if not isinstance(inputs, dict) or not inputs:
        return False
    names = [n for n in inputs if isinstance(n, str)]
    if any(n.startswith(SAMPLE_PREFIX) or n == MULTI_SAMPLE_ZIP for n in names):
        return True
    return len(names) == len(inputs) and all(n == BACKGROUND_MODEL or n.startswith(MODEL_PREFIX) for n in names)


def _number(name: str, prefix: str, highest: int) -> int | None:
    """N of ``<prefix>N`` with 1 <= N <= highest in plain ASCII digits without leading zeros, else None."""
    if not name.startswith(prefix):
        return None
    suffix = name[len(prefix) :]
    if not (suffix.isascii() and suffix.isdigit()) or str(int(suffix)) != suffix:
        return None
    number = int(suffix)
    return number if 1 <= number <= highest else None


def _identify_rodan3(inputs: Mapping[str, str]) -> dict[str, InputRole]:
    """Generation 3's inputs, each with its role, in the worker's order; InvalidRequest otherwise."""
    names = set(inputs)
    older = sorted(names & ({IMAGE, BACKGROUND, SELECTED_REGIONS} | OLD_ONLY_INPUTS))
    older += sorted(n for n in names if n.startswith(NEW_LAYER_PREFIX))
    if older:
        raise InvalidRequest(
            f"request mixes Rodan job generations: {older} (Rodan 2 job) with sample zips (Rodan 3 job: "
            f"'{SAMPLE_PREFIX}1'...'{SAMPLE_PREFIX}{MAX_SAMPLES}', {MULTI_SAMPLE_ZIP!r})"
        )
    samples: dict[int, str] = {}
    models: dict[int, str] = {}
    unknown: list[str] = []
    for name in names:
        if name in (MULTI_SAMPLE_ZIP, BACKGROUND_MODEL):
            continue
        sample = _number(name, SAMPLE_PREFIX, MAX_SAMPLES)
        model = _number(name, MODEL_PREFIX, MAX_STARTING_MODELS)
        if sample is not None:
            samples[sample] = name
        elif model is not None:
            models[model] = name
        else:
            unknown.append(name)
    if unknown:
        raise InvalidRequest(
            f"unknown inputs: {sorted(unknown)}; a Rodan 3 request takes '{SAMPLE_PREFIX}1'...'{SAMPLE_PREFIX}"
            f"{MAX_SAMPLES}', {MULTI_SAMPLE_ZIP!r}, {BACKGROUND_MODEL!r} and '{MODEL_PREFIX}1'...'{MODEL_PREFIX}"
            f"{MAX_STARTING_MODELS}' (numbers in plain digits, without leading zeros)"
        )
    roles = {samples[i]: InputRole.SAMPLE for i in sorted(samples)}
    if MULTI_SAMPLE_ZIP in names:
        roles[MULTI_SAMPLE_ZIP] = InputRole.MULTI_SAMPLE
    if not roles:  # starting models only
        raise InvalidRequest("a Rodan 3 request needs at least one 'Sample N' or 'Multi-Sample Zip'")
    if BACKGROUND_MODEL in names:
        roles[BACKGROUND_MODEL] = InputRole.MODEL
    roles.update({models[i]: InputRole.MODEL for i in sorted(models)})
    return roles


def _describe(error: jsonschema.ValidationError) -> str:
    return bounded(_describe_error(error), 200)


def _describe_error(error: jsonschema.ValidationError) -> str:
    where = "/".join(str(p) for p in error.absolute_path) or "body"
    if error.validator == "type":
        return f"{where!r} must be of type {error.validator_value}"
    if error.validator in {"minimum", "maximum"}:
        return f"{where!r} must be {'>=' if error.validator == 'minimum' else '<='} {error.validator_value}"
    if error.validator == "multipleOf":
        return f"{where!r} must be a multiple of {error.validator_value}, not {error.instance}"
    return f"{where!r}: {error.message}"


def _identify_layers(inputs: Mapping[str, str]) -> tuple[Generation, list[LayerSpec]]:
    names = set(inputs)
    numbered = sorted(n for n in names if n.startswith(NEW_LAYER_PREFIX))
    old_named = names & OLD_ONLY_INPUTS
    if numbered and old_named:
        raise InvalidRequest(
            "request mixes the two Rodan job generations: "
            f"{sorted(old_named)} (4-layer job) and {numbered} (numbered-layer job)"
        )
    common = [IMAGE, BACKGROUND, SELECTED_REGIONS]
    if numbered:
        indices: list[int] = []
        for name in numbered:
            suffix = name[len(NEW_LAYER_PREFIX) :]
            # ASCII digits only: '²' or '٣' pass str.isdigit() but not int()
            if not (suffix.isascii() and suffix.isdigit()) or str(int(suffix)) != suffix:
                raise InvalidRequest(f"unknown input {name!r}")
            indices.append(int(suffix))
        indices.sort()
        if indices != list(range(len(indices))) or len(indices) > MAX_NEW_LAYERS:
            raise InvalidRequest(
                f"numbered layers must be contiguous from 0 and at most {MAX_NEW_LAYERS}, got {indices}"
            )
        expected = set(common) | {f"{NEW_LAYER_PREFIX}{i}" for i in indices}
        _require_exact(names, expected)
        layers = [LayerSpec(BACKGROUND, "Background Model")]
        layers += [LayerSpec(f"{NEW_LAYER_PREFIX}{i}", f"Model {i}") for i in indices]
        return Generation.NEW, layers
    expected = set(common) | set(OLD_LAYERS)
    if not old_named:
        missing = sorted(expected - names)
        raise InvalidRequest(
            f"missing inputs {missing}: a request needs {IMAGE!r}, {BACKGROUND!r}, {SELECTED_REGIONS!r} "
            f"and either the 4-layer inputs {sorted(OLD_ONLY_INPUTS)} or '{NEW_LAYER_PREFIX}0'..."
        )
    _require_exact(names, expected)
    return Generation.OLD, [LayerSpec(name, key) for name, key in OLD_LAYERS.items()]


def _require_exact(names: set[str], expected: set[str]) -> None:
    missing, unknown = sorted(expected - names), sorted(names - expected)
    if missing:
        raise InvalidRequest(f"missing inputs: {missing}")
    if unknown:
        raise InvalidRequest(f"unknown inputs: {unknown}")


def check_resource(name: str, value: str, rodan_origin: str = "") -> None:
    """A resource is a path on the Rodan host (``/uploads/...``), or an absolute http(s) URL on
    Rodan's own origin (``rodan_origin``, ``scheme://host[:port]``; any origin when empty)."""
    if any(ord(c) < 32 or c == "\x7f" for c in value):
        raise InvalidRequest(f"input {name!r} contains control characters")
    if value.startswith("/") and not value.startswith("//"):
        path = value
    else:
        # Only Rodan gets the token, and which host that is must not depend on the parser: urllib3
        # (which connects) ends the authority at a backslash where urlsplit does not, IDNA folds
        # the full-width solidus (U+FF0F) into '/', and so on. Rodan's own URLs are plain ASCII without user info,
        # backslash or white space: anything else is refused.
        unusual = not value.isascii() or "@" in value or "\\" in value or any(c.isspace() for c in value)
        try:
            parts = urlsplit(value)
            origin = _origin(parts.scheme, parts.hostname or "", parts.port)
        except ValueError:  # '[::1', a port that is not a number or out of range
            origin = ""
        if unusual or parts.scheme not in {"http", "https"} or not origin:
            raise InvalidRequest(f"input {name!r} must be a path on the Rodan host or an http(s) URL on it")
        if rodan_origin and origin != _origin_of(rodan_origin):
            raise InvalidRequest(
                f"input {name!r} points to {parts.scheme}://{parts.netloc}, not to Rodan ({rodan_origin}): "
                "inputs are only downloaded from Rodan"
            )
        path = parts.path
    if ".." in unquote(path).replace("\\", "/").split("/"):
        raise InvalidRequest(f"input {name!r} contains a '..' path segment")


def _origin(scheme: str, host: str, port: int | None) -> str:
    if not host:
        return ""
    return f"{scheme}://{host.lower()}:{port or (443 if scheme == 'https' else 80)}"


def _origin_of(url: str) -> str:
    parts = urlsplit(url)
    return _origin(parts.scheme, parts.hostname or "", parts.port)


def _settings(
    raw: Mapping[str, Any],
    setting_fields: Mapping[str, tuple[str, dict[str, Any]]] = SETTING_FIELDS,
    defaults: RequestSettings | None = None,
) -> RequestSettings:
    values: dict[str, Any] = {}
    for name, (attr, schema) in setting_fields.items():
        if name in raw and raw[name] is not None:
            # JSON Schema counts 15.0 as an integer; hand the trainer a real int.
            values[attr] = int(raw[name]) if schema["type"] == "integer" else raw[name]
    settings = RequestSettings(**values) if defaults is None else replace(defaults, **values)
    settings.max_time_minutes  # noqa: B018 - validates the format, raising InvalidRequest
    email = settings.notification_email
    if email and not _EMAIL.fullmatch(email):
        raise InvalidRequest(f"'Slurm Notification Email' is not an e-mail address: {email!r}")
    return settings


# --- replies ---------------------------------------------------------------


def encode_model(data: bytes) -> str:
    """Standard base64 with newlines, as the original HPC side sent (Rodan uses decodebytes)."""
    return base64.encodebytes(data).decode("ascii")


def success_reply(models: Mapping[str, bytes]) -> bytes:
    return json.dumps({key: encode_model(data) for key, data in models.items()}).encode("utf-8")


def error_reply(reason: str) -> bytes:
    return json.dumps({"error": bounded(reason)}).encode("utf-8")


def reply_is_error(body: bytes) -> bool:
    """Whether a reply body is ``{"error": ...}``. A models reply (tens of MB) is not decoded: an
    error reply's only key comes first, so a large body without it near the start is models
    (decoding one costs time and a body-sized copy: benchmarks/README.md, "Reply publication")."""
    if len(body) > 1 << 20 and b'"error"' not in body[:64]:
        return False
    try:
        data = json.loads(body)
    except ValueError:
        return False
    return isinstance(data, dict) and set(data) == {"error"}


def settings_from_args(items: list[str]) -> dict[str, Any]:
    """Rodan settings from ``--setting NAME=VALUE`` arguments (a whole number becomes an int, as
    Rodan sends it). Raises ValueError for an item without ``=``."""
    settings: dict[str, Any] = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--setting expects NAME=VALUE, got {item!r}")
        settings[name] = int(value) if value.lstrip("-").isdigit() else value
    return settings


def build_request_body(inputs: Mapping[str, str], settings: Mapping[str, Any]) -> bytes:
    """The body Rodan's task publishes (used by ``hpc-bridge enqueue`` and tests)."""
    return json.dumps({"inputs": dict(inputs), "settings": dict(settings)}).encode("utf-8")
