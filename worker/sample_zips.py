"""Sample zips as Rodan's Pixel.js job writes them, read as hostile input (docs/design-rodan3.md).

A **sample zip** (input ``Sample 1`` ... ``Sample 20``) holds exactly these files at its top level:
``Image.png``, ``rgba PNG - Selected regions.png``, ``rgba PNG - Layer 0 (Background).png`` and
``rgba PNG - Layer 1.png`` ... ``rgba PNG - Layer N.png`` (DDMAL/pixel_wrapper ``wrapper.py``). A
**Multi-Sample Zip** holds sample folders, one level deep, each with exactly those files (what Rodan's
``FastPacoTrainer`` writes as its ``Multi-Sample Zip`` output: ``<folder>/<file>``, no folder entries;
folder entries ``<folder>/`` are accepted too). Every sample must have the same layers.

:func:`read_samples` returns one :class:`SamplePage` per sample: the samples in the order given, then
each Multi-Sample Zip's folders in sorted order. Each page is a ``worker.trainer.page.Page`` loaded by
``load_page`` (PNG only, pixel limit from the header before decoding, every layer ANDed with the
selected regions) whose masks are, in this order, ``Background`` (layer 0), ``Layer 1`` ...
``Layer N``: the layer number of the file name, not the file name itself. :func:`model_name` maps a
label to the Rodan output that carries its model (``Background Model``, ``Model 1`` ...).

At most :data:`MAX_LAYERS` layers besides the background: Rodan 3's ``FastPacoTrainer`` has outputs up
to ``Model 9`` only, Paco's ``getTrain`` orders the layers by sorting their names (``Layer 10`` would
sort before ``Layer 2``), and the bridge takes starting models up to ``Model 9``.

Every zip is hostile input. Before anything is unpacked, each zip is checked: its size, the size of its
central directory and its member count (read from its end record, before ``zipfile`` reads the
directory); every member's name (only the expected names; no absolute path, ``..``, backslash, drive
letter, control character, folder deeper than one level, or name given twice), type (no symlink or other
special file), flags (no encryption), compression (stored or deflate only), and the size its header
claims; and the sample's layer numbers (1 ... N without gaps, the same in every sample). Then each
sample's members are unpacked, one sample at a time, into files whose names this module chooses (never
the member's name) in a fresh folder under ``workdir``, counting the bytes while they are decompressed
(the per-member and the total limit stop the copy right there, whatever the header says), checking the
PNG signature and the pixel count of the PNG header first; the CRC is checked at the end of each member.
The folder is removed when the call returns, whether it succeeds or not. Every refusal is a
:class:`SampleZipError` (a ``TrainingInputError``) whose message names the input and the member and
says what to fix.
"""

from __future__ import annotations

import contextlib
import re
import shutil
import stat
import struct
import tempfile
import unicodedata
import zipfile
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from worker.trainer.errors import TrainingInputError
from worker.trainer.page import DEFAULT_MAX_PIXELS, Page, load_page

__all__ = [
    "BACKGROUND_FILE",
    "IMAGE_FILE",
    "MAX_LAYERS",
    "MULTI_SAMPLE_INPUT",
    "SAMPLE_INPUTS",
    "SELECTED_REGIONS_FILE",
    "SampleInputs",
    "SamplePage",
    "SampleZipError",
    "ZipLimits",
    "layer_file",
    "layer_label",
    "model_name",
    "read_sample_inputs",
    "read_samples",
]

IMAGE_FILE = "Image.png"
SELECTED_REGIONS_FILE = "rgba PNG - Selected regions.png"
BACKGROUND_FILE = "rgba PNG - Layer 0 (Background).png"
_LAYER_FILE = re.compile(r"rgba PNG - Layer ([1-9][0-9]{0,5})\.png", re.ASCII)
#: Layers besides the background: Rodan 3's trainer has outputs Background Model, Model 1 ... Model 9.
MAX_LAYERS = 9
#: Rodan 3's sample inputs, in their order, and its one Multi-Sample Zip input.
SAMPLE_INPUTS = tuple(f"Sample {n}" for n in range(1, 21))
MULTI_SAMPLE_INPUT = "Multi-Sample Zip"

_LAYOUT = (
    f"a sample holds exactly {IMAGE_FILE!r}, {SELECTED_REGIONS_FILE!r}, {BACKGROUND_FILE!r} and "
    "'rgba PNG - Layer 1.png' ... 'rgba PNG - Layer N.png', as Rodan's Pixel.js job writes them"
)
_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
#: What to do about a member that unpacks past ZipLimits.max_member_bytes (a fixed bound of the worker,
#: not a setting): far more often a damaged zip or a zip bomb than a page.
_TOO_LARGE_FIX = (
    "a page exported by Pixel.js is not expected to be that large: the zip is damaged, or was made to fill "
    "the node's disk (a zip bomb); export the sample again from Pixel.js and upload that zip. If the page "
    "really is that large, use a smaller scan of it: this bound on one file is fixed, and the operator's "
    "HPC_MAX_INPUT_PIXELS bounds each page's pixels as well"
)
_ZIP_SIGNATURES = (b"PK\x03\x04", b"PK\x05\x06", b"PK\x07\x08", b"PK\x01\x02")
_ARCHIVE_SUFFIXES = (".zip", ".7z", ".rar", ".tar", ".gz", ".tgz", ".bz2", ".xz", ".zst", ".jar")
_ACCEPTED_COMPRESSION = {zipfile.ZIP_STORED: "stored", zipfile.ZIP_DEFLATED: "deflate"}
_ENCRYPTED = 0x1 | 0x40  # general purpose flag bits: traditional and strong encryption
_CHUNK = 1 << 20
_MIB = 1 << 20
_GIB = 1 << 30

# The end records zipfile reads (APPNOTE 4.3.14-4.3.16), to bound its central directory first.
_END = struct.Struct("<4s4H2LH")
_END64_LOCATOR = struct.Struct("<4sLQL")
_END64 = struct.Struct("<4sQ2H2L4Q")
_END_SIGNATURE = b"PK\x05\x06"


class SampleZipError(TrainingInputError):
    """A sample zip or Multi-Sample Zip that cannot be used; the message says which and what to fix."""


@dataclass(frozen=True)
class ZipLimits:
    """Bounds on what the zips of one :func:`read_samples` call may hold (unpacked sizes counted while
    decompressing, never taken from the headers).

    ``max_zip_bytes``: one zip as stored; ``max_directory_bytes``: one zip's central directory;
    ``max_sample_members``: members of a sample zip; ``max_multi_folders`` / ``max_multi_members``:
    sample folders and members (folder entries included) of a Multi-Sample Zip; ``max_member_bytes``:
    one member unpacked; ``max_total_bytes``: all members of all zips unpacked.
    """

    max_zip_bytes: int = 8 * _GIB
    max_directory_bytes: int = 1 * _MIB
    max_sample_members: int = 64
    max_multi_folders: int = 20
    max_multi_members: int = 20 * 13
    max_member_bytes: int = 1 * _GIB
    max_total_bytes: int = 8 * _GIB


@dataclass(eq=False)
class SamplePage:
    """One sample's page and where it came from, e.g. ``Sample 2`` or ``Multi-Sample Zip, folder 'a'``
    (also the page's ``name``)."""

    page: Page
    source: str


#: What :func:`read_samples` reads: input name -> the zip file, in the order to read them.
SampleInputs = Mapping[str, Path]


def layer_file(number: int) -> str:
    """The Pixel.js file name of layer ``number`` (0 is the background)."""
    return BACKGROUND_FILE if number == 0 else f"rgba PNG - Layer {number}.png"


def layer_label(number: int) -> str:
    """The mask label of layer ``number`` in the pages :func:`read_samples` returns."""
    return "Background" if number == 0 else f"Layer {number}"


def model_name(label: str) -> str:
    """The Rodan 3 output (and starting-model input) of a layer's model: ``Background Model``, ``Model k``."""
    if label == "Background":
        return "Background Model"
    match = re.fullmatch(r"Layer ([1-9][0-9]*)", label, re.ASCII)
    if match is None:
        raise ValueError(f"{label!r} is not a layer label of a sample page")
    return f"Model {match.group(1)}"


# ---------------------------------------------------------------------------------------------------
# public entry points


def read_sample_inputs(
    files: Mapping[str, Path],
    workdir: Path,
    *,
    max_pixels: int = DEFAULT_MAX_PIXELS,
    limits: ZipLimits = ZipLimits(),
) -> list[SamplePage]:
    """:func:`read_samples` of a request's downloaded inputs (input name -> file): ``Sample 1`` ...
    ``Sample 20`` in number order, then ``Multi-Sample Zip``; other inputs (models) are ignored."""
    samples = {name: Path(files[name]) for name in SAMPLE_INPUTS if name in files}
    multi = {MULTI_SAMPLE_INPUT: Path(files[MULTI_SAMPLE_INPUT])} if MULTI_SAMPLE_INPUT in files else {}
    return read_samples(samples, multi, workdir, max_pixels=max_pixels, limits=limits)


def read_samples(
    sample_zips: SampleInputs,
    multi_sample_zips: SampleInputs,
    workdir: Path,
    *,
    max_pixels: int = DEFAULT_MAX_PIXELS,
    limits: ZipLimits = ZipLimits(),
) -> list[SamplePage]:
    """Load every sample of ``sample_zips`` (input name -> sample zip) and ``multi_sample_zips`` (input
    name -> Multi-Sample Zip), checked as the module docstring says.

    Returns the pages in order: the sample zips as given, then each Multi-Sample Zip's folders sorted
    by name. Every page has the masks ``Background``, ``Layer 1`` ... ``Layer N``, the same N for all.
    ``max_pixels`` bounds every image (the worker passes HPC_MAX_INPUT_PIXELS). All zips are checked
    before any member is unpacked. Members are unpacked only into a fresh folder under ``workdir``
    (created if missing), removed again before this returns or raises. Raises SampleZipError for
    anything wrong with the zips or the images in them (and when there is no sample at all); a zip
    file that does not exist raises FileNotFoundError.
    """
    with contextlib.ExitStack() as stack:
        samples: list[_Sample] = []
        for name, path in sample_zips.items():
            archive = stack.enter_context(_open_zip(Path(path), name, limits.max_sample_members, limits))
            samples.append(_single_sample(archive, name, limits))
        for name, path in multi_sample_zips.items():
            archive = stack.enter_context(_open_zip(Path(path), name, limits.max_multi_members, limits))
            samples.extend(_multi_samples(archive, name, limits))
        if not samples:
            raise SampleZipError("there is no sample: give at least one sample zip or a Multi-Sample Zip")
        _check_same_layers(samples)

        workdir = Path(workdir)
        workdir.mkdir(parents=True, exist_ok=True)
        folder = Path(tempfile.mkdtemp(prefix="samples-", dir=workdir))
        budget = _Budget(limits.max_total_bytes)
        try:
            return [
                _load(sample, folder / f"{index:03d}", budget, max_pixels, limits)
                for index, sample in enumerate(samples, 1)
            ]
        finally:
            shutil.rmtree(folder, ignore_errors=True)


# ---------------------------------------------------------------------------------------------------
# opening a zip and checking its members


@dataclass(frozen=True)
class _Sample:
    archive: zipfile.ZipFile
    source: str  # "Sample 2" or "Multi-Sample Zip, folder 'a'"
    members: dict[str, zipfile.ZipInfo]  # Pixel.js file name -> its member
    layers: int  # N: layers 1 ... N besides the background


class _Budget:
    """The unpacked bytes all zips of one call may still use."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.left = total


def _fail(where: str, problem: str, fix: str) -> SampleZipError:
    return SampleZipError(f"{where}: {problem}; {fix}")


def _start_of(path: Path) -> str:
    try:
        with path.open("rb") as handle:
            head = handle.read(8)
    except OSError:
        return "it cannot be read"
    if head.startswith(_PNG_SIGNATURE):
        return "it is a PNG image"
    return f"it starts with {head.hex()}" if head else "it is empty"


def _central_directory(path: Path, size: int) -> tuple[int, int] | None:
    """(entries, bytes) of the central directory as zipfile will read it; None without an end record.

    Mirrors zipfile's search: the end record right at the end of the file, else the last signature in
    its last 64 KiB, with the ZIP64 end record just before it where its locator is.
    """
    tail_size = min(size, _END.size + 0xFFFF + _END64_LOCATOR.size + _END64.size)
    with path.open("rb") as handle:
        handle.seek(size - tail_size)
        tail = handle.read(tail_size)
    if len(tail) >= _END.size and tail[-_END.size :][:4] == _END_SIGNATURE and tail[-2:] == b"\0\0":
        at = len(tail) - _END.size
    else:
        at = tail.rfind(_END_SIGNATURE, max(0, len(tail) - _END.size - 0xFFFF))
        if at < 0 or len(tail) - at < _END.size:
            return None
    fields = _END.unpack_from(tail, at)
    entries, directory = int(fields[4]), int(fields[5])
    locator = at - _END64_LOCATOR.size
    record = locator - _END64.size
    if record >= 0 and tail[locator : locator + 4] == b"PK\x06\x07" and tail[record : record + 4] == b"PK\x06\x06":
        fields64 = _END64.unpack_from(tail, record)
        entries, directory = int(fields64[7]), int(fields64[8])
    return entries, directory


def _open_zip(path: Path, name: str, max_members: int, limits: ZipLimits) -> zipfile.ZipFile:
    """Open one input as a zip, its size, directory and member count bounded before zipfile reads them."""
    remake = "make it again with Pixel.js or a zip tool, or upload it again"
    size = path.stat().st_size
    if size > limits.max_zip_bytes:
        raise _fail(
            name, f"the zip is {size} bytes, more than the limit of {limits.max_zip_bytes}", "give smaller samples"
        )
    directory = _central_directory(path, size)
    if directory is None:
        raise _fail(name, f"this is not a zip file, or it is cut short ({_start_of(path)})", remake)
    entries, directory_bytes = directory
    if entries > max_members:
        raise _fail(name, f"the zip has {entries} members, more than the limit of {max_members}", _LAYOUT)
    if directory_bytes > limits.max_directory_bytes:
        raise _fail(
            name,
            f"the zip's directory is {directory_bytes} bytes, more than the limit of {limits.max_directory_bytes}",
            _LAYOUT,
        )
    try:
        archive = zipfile.ZipFile(path)
    except FileNotFoundError:
        raise
    except (
        zipfile.BadZipFile,
        zipfile.LargeZipFile,
        OSError,
        EOFError,
        ValueError,  # UnicodeDecodeError of a name flagged UTF-8 among them
        struct.error,
        NotImplementedError,  # "zip file version 6.7"
    ) as exc:
        raise _fail(name, f"this is not a readable zip file ({exc})", remake) from exc
    if len(archive.infolist()) > max_members:
        count = len(archive.infolist())
        archive.close()
        raise _fail(name, f"the zip has {count} members, more than the limit of {max_members}", _LAYOUT)
    return archive


def _name_problem(info: zipfile.ZipInfo) -> str | None:
    """Why a member's name is unsafe, or None."""
    name = info.orig_filename
    if "\0" in name or info.filename != name:
        return "has a NUL character in its name"
    if name.startswith("/"):
        return "is an absolute path"
    if "\\" in name:
        return "has a backslash in its name"
    if re.match(r"[A-Za-z]:", name):
        return "starts with a drive letter"
    if ".." in name.split("/"):
        return "has '..' in its path"
    if any(unicodedata.category(char).startswith("C") for char in name):
        return "has a control or unassigned character in its name"
    if "//" in name or name in ("", "/") or "." in name.split("/")[:-1]:
        return "has an empty or '.' folder in its path"
    return None


def _member_problem(info: zipfile.ZipInfo, max_member_bytes: int) -> str | None:
    """Why a member cannot be a sample's file whatever its name, or None."""
    mode = info.external_attr >> 16
    kind = stat.S_IFMT(mode)
    if stat.S_ISLNK(mode):
        return "is a symbolic link"
    if kind not in (0, stat.S_IFREG, stat.S_IFDIR):
        return "is a special file (not a regular file)"
    if kind == stat.S_IFDIR and not info.filename.endswith("/"):
        return "is marked as a folder"
    if info.flag_bits & _ENCRYPTED:
        return "is encrypted"
    if info.compress_type not in _ACCEPTED_COMPRESSION:
        return f"is compressed with method {info.compress_type}, which is not accepted (only stored or deflate)"
    if info.file_size > max_member_bytes:
        return (
            f"would unpack to {info.file_size} bytes (its zip header says), more than the limit of "
            f"{max_member_bytes} bytes for one file of a sample"
        )
    return None


_FIXES = {
    "is encrypted": "zip the files again without a password",
    "is compressed with method": "zip the files again with the usual (deflate) compression or none",
    "would unpack to": _TOO_LARGE_FIX,
    "is an archive": "nested archives are not accepted: put the sample's files into the zip itself",
    "is a zip archive": "nested archives are not accepted: put the sample's PNG files into the zip itself",
}


def _member_fail(where: str, member: str, problem: str) -> SampleZipError:
    fix = next((text for start, text in _FIXES.items() if problem.startswith(start)), _LAYOUT)
    return _fail(where, f"member {member!r} {problem}", fix)


def _checked_members(archive: zipfile.ZipFile, name: str, limits: ZipLimits) -> list[zipfile.ZipInfo]:
    """The members, every one with a safe name, no duplicate, and readable by its flags and method."""
    seen: set[str] = set()
    for info in archive.infolist():
        problem = _name_problem(info) or _member_problem(info, limits.max_member_bytes)
        if problem is None and info.filename in seen:
            problem = "appears twice in the zip"
        if problem is None and not info.filename.endswith("/") and info.filename.lower().endswith(_ARCHIVE_SUFFIXES):
            problem = "is an archive"
        if problem is not None:
            raise _member_fail(name, info.orig_filename, problem)
        seen.add(info.filename)
    return archive.infolist()


def _layers_of(files: dict[str, zipfile.ZipInfo], where: str, show: str) -> int:
    """N of a sample whose file names (without folder) are ``files``; ``show`` prefixes member names."""
    numbers: list[int] = []
    for file in files:
        if file in (IMAGE_FILE, SELECTED_REGIONS_FILE, BACKGROUND_FILE):
            continue
        match = _LAYER_FILE.fullmatch(file)
        if match is None:
            raise _member_fail(where, show + file, "is not a file of a sample")
        number = int(match.group(1))
        if number > MAX_LAYERS:
            raise _fail(
                where,
                f"member {show + file!r} is layer {number}, but Rodan's trainer makes models for at most "
                f"{MAX_LAYERS} layers besides the background (Model 1 ... Model {MAX_LAYERS})",
                f"merge layers in Pixel.js so that there are at most {MAX_LAYERS}",
            )
        numbers.append(number)
    for required in (IMAGE_FILE, SELECTED_REGIONS_FILE, BACKGROUND_FILE):
        if required not in files:
            raise _fail(where, f"the sample has no {show + required!r}", _LAYOUT)
    if not numbers:
        raise _fail(where, f"the sample has no layer besides the background (no {show + layer_file(1)!r})", _LAYOUT)
    missing = sorted(set(range(1, max(numbers) + 1)) - set(numbers))
    if missing:
        raise _fail(
            where,
            f"the sample has layer {max(numbers)} but no {show + layer_file(missing[0])!r}",
            "layers are numbered 1, 2, 3 ... without gaps, as Pixel.js numbers them",
        )
    return len(numbers)


def _is_paco_cache(file: str) -> bool:
    """Whether ``file`` is the ``.npy`` copy Paco's trainer keeps beside a sample's PNG (``Image.png.npy``).

    Paco's ``preprocess`` writes one beside every PNG it unzipped, and a Multi-Sample Zip made from
    those folders carries them. They are skipped unread (the PNG is the sample); any other extra file
    is still refused.
    """
    if not file.endswith(".png.npy"):
        return False
    png = file[: -len(".npy")]
    return png in (IMAGE_FILE, SELECTED_REGIONS_FILE, BACKGROUND_FILE) or _LAYER_FILE.fullmatch(png) is not None


def _single_sample(archive: zipfile.ZipFile, name: str, limits: ZipLimits) -> _Sample:
    files: dict[str, zipfile.ZipInfo] = {}
    for info in _checked_members(archive, name, limits):
        if "/" in info.filename:
            folder = info.filename.split("/", 1)[0]
            raise _fail(
                name,
                f"member {info.filename!r} is in a folder ({folder!r})",
                "a sample zip holds its files at the top level, not in a folder; a zip of sample folders "
                f"is given as the {MULTI_SAMPLE_INPUT}",
            )
        files[info.filename] = info
    layers = _layers_of(files, name, "")
    return _Sample(archive=archive, source=name, members=files, layers=layers)


def _multi_samples(archive: zipfile.ZipFile, name: str, limits: ZipLimits) -> list[_Sample]:
    folders: dict[str, dict[str, zipfile.ZipInfo]] = {}
    one_level = "a Multi-Sample Zip holds sample folders one level deep, each with the files of one sample"
    for info in _checked_members(archive, name, limits):
        parts = info.filename.split("/")
        if info.filename.endswith("/"):  # a folder entry: "a/"
            if len(parts) != 2:
                raise _fail(name, f"member {info.filename!r} is a folder deeper than one level", one_level)
            folders.setdefault(parts[0], {})
            continue
        if len(parts) == 1:
            raise _fail(name, f"member {info.filename!r} is not in a sample folder", one_level)
        if len(parts) > 2:
            raise _fail(name, f"member {info.filename!r} is deeper than one folder", one_level)
        folder = folders.setdefault(parts[0], {})
        if _is_paco_cache(parts[1]):
            continue  # never read: see _is_paco_cache
        folder[parts[1]] = info
        if len(folders) > limits.max_multi_folders:
            raise _fail(
                name,
                f"the zip has more than {limits.max_multi_folders} sample folders",
                f"give at most {limits.max_multi_folders} samples in one Multi-Sample Zip",
            )
    if not folders:
        raise _fail(name, "the zip holds no sample folder", one_level)
    samples: list[_Sample] = []
    for folder_name in sorted(folders):
        files = folders[folder_name]
        where = f"{name}, folder {folder_name!r}"
        if not files:
            raise _fail(where, "the folder is empty", one_level)
        layers = _layers_of(files, where, f"{folder_name}/")
        samples.append(_Sample(archive=archive, source=where, members=files, layers=layers))
    return samples


def _check_same_layers(samples: list[_Sample]) -> None:
    first = samples[0]
    for sample in samples[1:]:
        if sample.layers != first.layers:
            raise _fail(
                sample.source,
                f"the sample has {sample.layers} layers besides the background, but {first.source} has {first.layers}",
                "every sample must have the same layers (Layer 1 ... Layer N)",
            )


# ---------------------------------------------------------------------------------------------------
# unpacking and loading


def _copy_bounded(source: IO[bytes], target: IO[bytes], limit: int) -> int | None:
    """Copy ``source`` to its end into ``target``; the byte count, or None as soon as it passes ``limit``.

    Reads at most one chunk past the limit and writes nothing past it: a zip bomb stops right there,
    whatever its header claims.
    """
    copied = 0
    while True:
        chunk = source.read(min(_CHUNK, limit - copied + 1))
        if not chunk:
            return copied
        copied += len(chunk)
        if copied > limit:
            return None
        target.write(chunk)


def _unpack(sample: _Sample, file: str, target: Path, budget: _Budget, max_pixels: int, limits: ZipLimits) -> None:
    """Unpack one member into ``target`` (a new file), checking its PNG header, size and CRC."""
    info = sample.members[file]
    member = info.filename
    limit = min(limits.max_member_bytes, budget.left)
    damaged = "upload it again, or make it again with Pixel.js or a zip tool"
    try:
        with sample.archive.open(info) as source, target.open("xb") as handle:
            head = source.read(24)
            if head.startswith(_ZIP_SIGNATURES):
                raise _member_fail(sample.source, member, "is a zip archive, not a PNG")
            if not head.startswith(_PNG_SIGNATURE):
                start = f"it starts with {head[:8].hex()}" if head else "it is empty"
                raise _fail(sample.source, f"member {member!r} is not a PNG image ({start})", "save it as PNG")
            if len(head) == 24 and head[12:16] == b"IHDR":
                width, height = struct.unpack(">II", head[16:24])
                if width * height > max_pixels:
                    raise _fail(
                        sample.source,
                        f"member {member!r} is {width}x{height} pixels, more than the limit of {max_pixels} "
                        "pixels per image (HPC_MAX_INPUT_PIXELS)",
                        "use a smaller scan of the page, or ask the operator to raise HPC_MAX_INPUT_PIXELS",
                    )
            handle.write(head)
            copied = _copy_bounded(source, handle, limit - len(head)) if len(head) <= limit else None
    except SampleZipError:
        raise
    except (zipfile.BadZipFile, zlib.error, EOFError, OSError, ValueError, RuntimeError, NotImplementedError) as exc:
        raise _fail(sample.source, f"member {member!r} is damaged ({exc})", damaged) from exc
    if copied is None:
        declared = f"its zip header said {info.file_size}"
        if limit == limits.max_member_bytes:
            problem = (
                f"member {member!r} unpacked past the limit of {limits.max_member_bytes} bytes for one file of a "
                f"sample (counted while unpacking; {declared})"
            )
            raise _fail(sample.source, problem, _TOO_LARGE_FIX)
        problem = (
            f"member {member!r} takes the samples past the limit of {budget.total} bytes unpacked in all "
            f"(counted while unpacking; {declared})"
        )
        raise _fail(
            sample.source,
            problem,
            "give fewer samples in one request; if each sample should be far smaller, the zips may be damaged "
            "or zip bombs: export them again from Pixel.js",
        )
    budget.left -= len(head) + copied


def _load(sample: _Sample, folder: Path, budget: _Budget, max_pixels: int, limits: ZipLimits) -> SamplePage:
    """Unpack one sample into ``folder`` (under names chosen here), load its page, remove the files."""
    folder.mkdir()
    chosen = {IMAGE_FILE: "image.png", SELECTED_REGIONS_FILE: "selected-regions.png"}
    chosen.update({layer_file(n): f"layer-{n:02d}.png" for n in range(sample.layers + 1)})
    try:
        for file, local in chosen.items():
            _unpack(sample, file, folder / local, budget, max_pixels, limits)
        layers = {layer_label(n): folder / chosen[layer_file(n)] for n in range(sample.layers + 1)}
        # load_page's messages start with what they are about: tell the member that is.
        whats = {IMAGE_FILE: "the image", SELECTED_REGIONS_FILE: "the selected regions"}
        whats.update({layer_file(n): f"layer {layer_label(n)!r}" for n in range(sample.layers + 1)})
        try:
            page = load_page(
                folder / chosen[IMAGE_FILE], layers, folder / chosen[SELECTED_REGIONS_FILE], max_pixels=max_pixels
            )
        except SampleZipError:
            raise
        except TrainingInputError as exc:
            problem = str(exc)
            culprit = next((file for file, what in whats.items() if problem.startswith(what)), None)
            if culprit is not None:  # the member's name instead of the name it was unpacked under
                problem = f"member {sample.members[culprit].filename!r}: {problem.replace(f' ({chosen[culprit]})', '')}"
            raise _fail(sample.source, problem, "fix the sample in Pixel.js and export it again") from exc
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    page.name = sample.source  # names the page in the trainer's messages
    return SamplePage(page=page, source=sample.source)
