"""Sample pages and layers as Rodan's training job receives them (docs/protocol.md §2).

Everything is written like Rodan stores resources: ``<uploads>/projects/<32 hex>/resources/<32 hex>/
original_file`` (no extension), and the functions return the request ``inputs`` mapping (input name ->
resource PATH, ``/uploads/projects/.../original_file``) that Rodan would publish.

- :func:`make_sample_page`: a small synthetic page (parchment, staves, neumes, text, optional extra
  symbol classes) whose layers partition the selected region exactly;
- :func:`synthesize_page_from_masks`: an RGB page synthesized from the real Einsiedeln annotation
  layers (:data:`EINSIEDELN_DIR`, a data set kept beside the checkout), optionally cropped;
- :func:`make_sample_zip` / :func:`make_multi_sample_zip`: a newer-generation page of either packed
  into a sample zip exactly as Rodan 3's Pixel.js job writes it, and sample zips into a Multi-Sample
  Zip as Rodan 3's trainer writes it.

numpy and Pillow are imported inside the functions, so importing this module costs nothing.
Everything is deterministic for a given ``seed``.
"""

from __future__ import annotations

import hashlib
import io
import os
import stat
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from bridge.atomic import atomic_file

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt
    from PIL import Image as PILImage

__all__ = [
    "EINSIEDELN_DIR",
    "OLD_LAYER_INPUTS",
    "PIXELJS_BACKGROUND",
    "PIXELJS_IMAGE",
    "PIXELJS_SELECTED_REGIONS",
    "Generation",
    "input_names",
    "layer_input_names",
    "make_multi_sample_zip",
    "make_sample_page",
    "make_sample_zip",
    "pixeljs_layer_file",
    "resource_path",
    "synthesize_page_from_masks",
]

Generation = Literal["old", "new"]

#: The real Einsiedeln layers live in the project's shared/ folder beside the checkout (never copied in);
#: HPC_EINSIEDELN_DIR points elsewhere.
EINSIEDELN_DIR = Path(
    os.environ.get("HPC_EINSIEDELN_DIR")
    or Path(__file__).resolve().parents[3] / "shared" / "data" / "einsiedeln-32r-263v"
)

#: The older job's layer inputs, in the order of their reply keys (Music Symbol, Staff Lines, Text).
OLD_LAYER_INPUTS = ("Music Layer", "Staff Layer", "Text")
MAX_NEW_LAYERS = 10

_PARCHMENT = (228, 214, 181)
# Ink colours per class of make_sample_page: 0 neumes, 1 staff lines, 2 text, 3.. extra symbols.
_INK = (
    (32, 26, 22),
    (150, 42, 36),
    (74, 52, 40),
    (34, 52, 140),
    (40, 108, 52),
    (118, 40, 118),
    (22, 98, 108),
    (150, 100, 22),
    (92, 92, 92),
    (160, 62, 108),
)
# Flat annotation colours of the layer PNGs (Pixel.js style; only alpha carries meaning).
_BACKGROUND_RGB = (120, 116, 114)
_SELECTION_RGB = (120, 116, 114)
_LAYER_RGB = (
    (51, 102, 255),
    (255, 51, 102),
    (102, 255, 51),
    (255, 204, 0),
    (0, 204, 204),
    (204, 0, 204),
    (255, 128, 0),
    (128, 0, 255),
    (0, 128, 64),
    (128, 64, 0),
)


def layer_input_names(generation: Generation, n_layers: int = 2) -> list[str]:
    """The layer input names (without Image, Background and Selected Regions) of a generation."""
    if generation == "old":
        return list(OLD_LAYER_INPUTS)
    if generation == "new":
        if not 1 <= n_layers <= MAX_NEW_LAYERS:
            raise ValueError(f"the newer job takes 1..{MAX_NEW_LAYERS} layers, not {n_layers}")
        return [f"rgba PNG - Layer {i}" for i in range(n_layers)]
    raise ValueError(f"generation must be 'old' or 'new', not {generation!r}")


def input_names(generation: Generation, n_layers: int = 2) -> list[str]:
    """All input names of a request of that generation, exactly as docs/protocol.md §2.3 spells them."""
    layers = layer_input_names(generation, n_layers)
    if generation == "old":
        return ["Image", "Background", *layers, "Selected Regions"]
    return ["Image", "Background", "Selected Regions", *layers]


def _hex32(*parts: object) -> str:
    return hashlib.sha256(repr(parts).encode("utf-8")).hexdigest()[:32]


def resource_path(uploads_dir: Path, project: str, resource: str) -> tuple[Path, str]:
    """(file on disk, resource PATH as Rodan sends it) of a resource's ``original_file``."""
    relative = f"projects/{project}/resources/{resource}/original_file"
    return Path(uploads_dir) / relative, f"/uploads/{relative}"


def _write_png(image: PILImage.Image, file: Path, *, compress_level: int = 6) -> None:
    file.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(file, mode=None) as handle:
        image.save(handle, format="PNG", compress_level=compress_level)


def _rgba_layer(mask: npt.NDArray[np.bool_], rgb: tuple[int, int, int]) -> PILImage.Image:
    import numpy as np
    from PIL import Image

    out = np.zeros((*mask.shape, 4), dtype=np.uint8)
    out[mask] = (*rgb, 255)
    return Image.fromarray(out)  # (h, w, 4) uint8 is RGBA


def _to_image(array: npt.NDArray[np.uint8]) -> PILImage.Image:
    from PIL import Image

    return Image.fromarray(array)


# ---------------------------------------------------------------------------------------------------
# make_sample_page


def make_sample_page(
    uploads_dir: Path,
    *,
    generation: Generation,
    n_layers: int = 2,
    height: int = 160,
    width: int = 192,
    seed: int = 0,
    selected_box: tuple[int, int, int, int] | None = None,
    image_format: Literal["png", "jpeg"] = "png",
) -> dict[str, str]:
    """Write a synthetic page and its layers under ``uploads_dir``; return the request ``inputs``.

    The page has staves of four staff lines, neumes on them (small blobs, some with a stem) and a
    line of text under each staff (small rectangles), plus, for a newer-generation request with more
    than three layers, extra symbol classes (rings, crosses, diamonds, bars...), each in its own ink
    colour, on parchment-coloured noise. Classes and layers:

    - old generation (``n_layers`` is ignored): ``Music Layer`` = neumes, ``Staff Layer`` = staff
      lines, ``Text`` = text;
    - new generation: ``rgba PNG - Layer 0`` = neumes, ``Layer 1`` = staff lines, ``Layer 2`` = text,
      ``Layer 3..9`` = extra classes; a class without a layer is not drawn at all.

    ``Background`` is every selected pixel in no other layer, so the layers (Background included)
    are disjoint and cover the selected region exactly; nothing outside it belongs to any layer.
    ``Selected Regions`` is the whole page, or ``selected_box`` = (left, top, right, bottom),
    right/bottom exclusive. Layer PNGs are RGBA with alpha exactly 0 or 255; ``Image`` is RGB (PNG,
    or JPEG with ``image_format="jpeg"``). Paths are derived from the arguments, so the same call
    rewrites the same files and different calls never collide.
    """
    import numpy as np

    layer_names = layer_input_names(generation, n_layers)
    n_classes = 3 if generation == "old" else n_layers
    if height < 40 or width < 40:
        raise ValueError("the page must be at least 40 x 40 pixels")
    if selected_box is None:
        selected_box = (0, 0, width, height)
    left, top, right, bottom = selected_box
    if not (0 <= left < right <= width and 0 <= top < bottom <= height):
        raise ValueError(f"selected_box {selected_box} is not inside the {width}x{height} page")

    rng = np.random.default_rng(seed)
    labels = _draw_labels(rng, height, width, n_classes)  # 0 background, k+1 class k

    selected = np.zeros((height, width), dtype=bool)
    selected[top:bottom, left:right] = True
    rgb = _render(rng, labels, n_classes)

    project = _hex32("sample", generation, n_classes, height, width, seed, selected_box, image_format)
    inputs: dict[str, str] = {}

    def put(name: str, image: PILImage.Image, fmt: str = "PNG") -> None:
        file, path = resource_path(uploads_dir, project, _hex32(project, name))
        file.parent.mkdir(parents=True, exist_ok=True)
        if fmt == "PNG":
            _write_png(image, file)
        else:
            with atomic_file(file, mode=None) as handle:
                image.save(handle, format=fmt, quality=92)
        inputs[name] = path

    put("Image", _to_image(rgb), "PNG" if image_format == "png" else "JPEG")
    put("Background", _rgba_layer(selected & (labels == 0), _BACKGROUND_RGB))
    class_of_layer = {name: i for i, name in enumerate(layer_names)}
    for name in input_names(generation, n_layers)[2:]:
        if name == "Selected Regions":
            put(name, _rgba_layer(selected, _SELECTION_RGB))
        else:
            k = class_of_layer[name]
            put(name, _rgba_layer(selected & (labels == k + 1), _LAYER_RGB[k]))
    return {name: inputs[name] for name in input_names(generation, n_layers)}


def _draw_labels(rng: np.random.Generator, h: int, w: int, n_classes: int) -> npt.NDArray[np.int8]:
    """The class map of a synthetic page: 0 = background, k + 1 = class k."""
    import numpy as np

    labels = np.zeros((h, w), dtype=np.int8)
    s = max(3, round(min(h, w) / 40))  # the unit: 4 px on the default page
    spacing, thick = 2 * s, max(1, s // 2)
    staff_h = 3 * spacing + thick
    letter_h = max(3, round(1.5 * s))
    system_h = staff_h + 2 * s + letter_h + 2 * s
    margin = 2 * s
    # With extra symbol classes, the bottom of the page is kept for them (see _draw_extra_classes).
    band = 0.0 if n_classes <= 3 else min(0.6, 0.08 * (n_classes - 3))
    usable_h = round(h * (1.0 - band))
    n_systems = max(1, (usable_h - 2 * margin + 2 * s) // system_h)
    x0, x1 = margin, w - margin
    draw = [k < n_classes for k in range(3)]
    for i in range(n_systems):
        y = margin + s + i * system_h
        if draw[1]:  # staff lines
            for line in range(4):
                ly = y + line * spacing
                a = x0 + int(rng.integers(0, 2))
                b = x1 - int(rng.integers(0, 2))
                labels[ly : ly + thick, a:b] = 2
        if draw[0]:  # neumes: a head on a line or in a space, some with a stem or a second head
            x = x0 + s
            while x + s + 2 <= x1 - s:
                pos = int(rng.integers(0, 7))
                cy = y + pos * spacing // 2 + thick // 2
                hy0 = max(0, cy - s // 2)
                corners = labels[hy0, [x, x + s]].copy()
                labels[hy0 : hy0 + s, x : x + s + 1] = 1
                labels[hy0, [x, x + s]] = corners  # a rounded top
                shape = rng.random()
                if shape < 0.3:
                    labels[hy0 : min(h, hy0 + 2 * s - 1), x + s : x + s + 1] = 1  # stem
                elif shape < 0.5 and x + 2 * s + 2 <= x1 - s:
                    hy1 = max(0, hy0 - spacing // 2)
                    labels[hy1 : hy1 + s, x + s + 1 : x + 2 * s + 2] = 1  # a second, higher head
                    x += s + 1
                x += int(rng.integers(2 * s, 3 * s + 1))
        if draw[2]:  # text: words of small letter rectangles under the staff
            ty = y + staff_h + 2 * s
            x = x0 + int(rng.integers(0, s))
            while x < x1 - s:
                for _ in range(int(rng.integers(2, 7))):
                    lw = int(rng.integers(max(2, s - 1), s + 2))
                    if x + lw > x1:
                        break
                    tall = rng.random() < 0.2
                    top = ty - (s // 2 if tall else 0)
                    labels[max(0, top) : min(h, ty + letter_h), x : x + lw] = 3
                    x += lw + int(rng.integers(1, 3))
                x += 2 * s
    if n_classes > 3:
        _draw_extra_classes(rng, labels, s, n_classes, margin + s + n_systems * system_h)
    return labels


def _extra_shape(kind: int, size: int) -> npt.NDArray[np.bool_]:
    import numpy as np

    m = np.zeros((size, size), dtype=bool)
    c = size // 2
    yy, xx = np.mgrid[0:size, 0:size]
    kind %= 7
    if kind == 0:  # ring (hollow square)
        m[[0, -1], :] = True
        m[:, [0, -1]] = True
    elif kind == 1:  # plus
        m[c, :] = True
        m[:, c] = True
        m[c - 1 : c + 1, :] = True
    elif kind == 2:  # X
        m[yy == xx] = True
        m[yy == size - 1 - xx] = True
    elif kind == 3:  # diamond
        m[np.abs(yy - c) + np.abs(xx - c) <= c] = True
    elif kind == 4:  # vertical double bar
        m[:, 1:3] = True
        m[:, -3:-1] = True
    elif kind == 5:  # triangle
        m[xx <= yy] = True
    else:  # horizontal double bar
        m[1:3, :] = True
        m[-3:-1, :] = True
    return m


def _draw_extra_classes(
    rng: np.random.Generator, labels: npt.NDArray[np.int8], s: int, n_classes: int, band_top: int
) -> None:
    """Lay the symbols of classes 3.. out on a jittered grid in the band below the last system."""
    h, w = labels.shape
    size = 2 * s - 1
    cell = size + 3  # one free pixel all round, plus one of jitter
    margin = 2 * s
    rows = max(0, (h - margin - band_top) // cell)
    cols = max(0, (w - 2 * margin) // cell)
    cells = [(band_top + r * cell, margin + c * cell) for r in range(rows) for c in range(cols)]
    order = rng.permutation(len(cells))
    n_extra = n_classes - 3
    for i, idx in enumerate(order):
        k = 3 + i % n_extra
        y, x = cells[int(idx)]
        y += 1 + int(rng.integers(0, 2))
        x += 1 + int(rng.integers(0, 2))
        labels[y : y + size, x : x + size][_extra_shape(k - 3, size)] = k + 1


def _render(rng: np.random.Generator, labels: npt.NDArray[np.int8], n_classes: int) -> npt.NDArray[np.uint8]:
    """Parchment with slow blotches and grain, and class-coloured ink with its own noise."""
    import numpy as np

    h, w = labels.shape
    rgb = _parchment(rng, h, w)
    ink = np.asarray(_INK[:n_classes], dtype=np.float32)
    inked = labels > 0
    colours = ink[labels[inked].astype(np.intp) - 1]
    colours += rng.normal(0.0, 9.0, size=colours.shape).astype(np.float32)
    rgb[inked] = colours
    return np.clip(np.rint(rgb), 0, 255).astype(np.uint8)


def _parchment(rng: np.random.Generator, h: int, w: int) -> npt.NDArray[np.float32]:
    """Parchment colour with low-frequency blotches and per-pixel grain, as float32 RGB."""
    import numpy as np
    from PIL import Image

    gh, gw = h // 32 + 2, w // 32 + 2
    coarse = rng.normal(0.0, 6.0, size=(gh, gw)).astype(np.float32)
    blotch = np.asarray(Image.fromarray(coarse).resize((w, h), Image.Resampling.BILINEAR), dtype=np.float32)
    rgb = np.empty((h, w, 3), dtype=np.float32)
    rgb[:] = np.asarray(_PARCHMENT, dtype=np.float32)
    rgb += blotch[..., None] * np.asarray([1.0, 1.0, 1.2], dtype=np.float32)
    rgb += rng.normal(0.0, 5.0, size=(h, w, 3)).astype(np.float32)
    return rgb


# ---------------------------------------------------------------------------------------------------
# synthesize_page_from_masks

_MASK_FILES = {
    "Background": "Background.png",
    "Neumes": "Neumes.png",
    "StaffLines": "StaffLines.png",
    "SelectedRegions": "SelectedRegions.png",
}
_NEUME_INK = (30, 24, 20)
_STAFF_INK = (146, 44, 38)
_TEXT_INK = (62, 44, 34)


def _load_rgba_rows(path: Path, bottom: int) -> PILImage.Image:
    """Decode an RGBA PNG only down to row ``bottom`` (PNG rows are sequential; the rest is skipped).

    Falls back to decoding the whole image whenever the file is not a plain, non-interlaced
    single-tile PNG.
    """
    from PIL import Image

    image = Image.open(path)
    width, height = image.size
    tile = image.tile
    if (
        0 < bottom < height
        and image.format == "PNG"
        and not image.info.get("interlace")
        and len(tile) == 1
        and tile[0][0] == "zip"
        and tile[0][1] == (0, 0, width, height)
    ):
        try:
            image._size = (width, bottom)
            image.tile = [tile[0]._replace(extents=(0, 0, width, bottom))]
            image.load()
            if image.size == (width, bottom):
                return image.convert("RGBA") if image.mode != "RGBA" else image
        except Exception:  # noqa: S110 - any trouble with the shortcut: decode it all below
            pass
        image = Image.open(path)
    image.load()
    return image.convert("RGBA") if image.mode != "RGBA" else image


def synthesize_page_from_masks(
    data_dir: Path,
    out_dir: Path,
    crop: tuple[int, int, int, int] | None = None,
    *,
    generation: Generation = "old",
    seed: int = 0,
    text_layer: Literal["synthetic", "empty"] = "synthetic",
) -> dict[str, str]:
    """Build a realistic page from the real Einsiedeln masks and write it as Rodan uploads.

    ``data_dir`` holds ``Background.png``, ``Neumes.png``, ``StaffLines.png`` and
    ``SelectedRegions.png`` (RGBA, a pixel is in a layer where alpha == 255); it is only read.
    ``out_dir`` is the uploads directory (the stand-in's ``uploads_dir``); the returned mapping holds
    resource paths ``/uploads/projects/...``. ``crop`` is a Pillow box (left, top, right, bottom),
    right/bottom exclusive; None is the whole page (4872 wide, 12992 high: about a minute and
    2.3 GB of memory). A crop decodes the PNGs only down to its bottom row, so a crop near the top
    is fast (a 512 x 512 crop at y = 1024: about 0.5 s).

    The ``Image`` is parchment with blotches and grain, dark brown ink where ``Neumes`` is opaque
    and red-brown ink on ``StaffLines``, each blended by the mask's alpha so that the edges are
    anti-aliased as on a scan. The real masks are written as they are (cropped), partial alpha
    included, and in the real data Neumes and StaffLines overlap where a note sits on a line.

    Input mapping:

    - old generation: ``Background`` <- Background, ``Music Layer`` <- Neumes, ``Staff Layer`` <-
      StaffLines, ``Selected Regions`` <- SelectedRegions, and ``Text``: the real data has no text
      layer (the text is annotated as Background), so with ``text_layer="synthetic"`` (default)
      words of gothic-looking minim strokes are inked into empty stretches of Background (at least
      12 px from anything else) and that becomes the ``Text`` layer, removed from ``Background``;
      with ``text_layer="empty"`` the ``Text`` layer is fully transparent and nothing is added;
    - new generation: ``rgba PNG - Layer 0`` <- Neumes, ``rgba PNG - Layer 1`` <- StaffLines
      (``text_layer`` is not used).
    """
    import numpy as np

    data_dir = Path(data_dir)
    with_text = generation == "old" and text_layer == "synthetic"
    if generation not in ("old", "new"):
        raise ValueError(f"generation must be 'old' or 'new', not {generation!r}")

    from PIL import Image

    with Image.open(data_dir / _MASK_FILES["Neumes"]) as probe:
        full_w, full_h = probe.size
    if crop is None:
        crop = (0, 0, full_w, full_h)
    left, top, right, bottom = crop
    if not (0 <= left < right <= full_w and 0 <= top < bottom <= full_h):
        raise ValueError(f"crop {crop} is not inside the {full_w}x{full_h} page")

    masks: dict[str, npt.NDArray[np.uint8]] = {}
    for key, name in _MASK_FILES.items():
        image = _load_rgba_rows(data_dir / name, bottom)
        masks[key] = np.ascontiguousarray(np.asarray(image)[top:bottom, left:right])
        del image
    h, w = bottom - top, right - left

    rng = np.random.default_rng(seed)
    text = np.zeros((h, w), dtype=bool)
    if with_text:
        text = _place_text(rng, masks["Background"][..., 3] == 255, masks["SelectedRegions"][..., 3] == 255)

    rgb = np.empty((h, w, 3), dtype=np.uint8)
    block = 1024
    neume_ink = np.asarray(_NEUME_INK, dtype=np.float32)
    staff_ink = np.asarray(_STAFF_INK, dtype=np.float32)
    for r0 in range(0, h, block):
        r1 = min(h, r0 + block)
        part = _parchment(rng, r1 - r0, w)
        a_n = masks["Neumes"][r0:r1, :, 3].astype(np.float32) / 255.0
        a_s = masks["StaffLines"][r0:r1, :, 3].astype(np.float32) / 255.0
        alpha = np.maximum(a_n, a_s)[..., None]
        ink = np.where((a_n >= a_s)[..., None], neume_ink, staff_ink)
        ink = ink + rng.normal(0.0, 8.0, size=ink.shape).astype(np.float32)
        part = part * (1.0 - alpha) + ink * alpha
        t = text[r0:r1]
        if t.any():
            part[t] = np.asarray(_TEXT_INK, dtype=np.float32) + rng.normal(0.0, 8.0, size=(int(t.sum()), 3))
        rgb[r0:r1] = np.clip(np.rint(part), 0, 255).astype(np.uint8)

    background = masks["Background"]
    if with_text:
        background = background.copy()
        background[text] = 0

    project = _hex32("einsiedeln", str(data_dir.resolve()), crop, generation, seed, text_layer)
    inputs: dict[str, str] = {}
    big = h * w > 4_000_000

    def put(name: str, image: PILImage.Image) -> None:
        file, path = resource_path(Path(out_dir), project, _hex32(project, name))
        _write_png(image, file, compress_level=1 if big else 6)
        inputs[name] = path

    put("Image", _to_image(rgb))
    put("Background", _to_image(background))
    if generation == "old":
        put("Music Layer", _to_image(masks["Neumes"]))
        put("Staff Layer", _to_image(masks["StaffLines"]))
        text_rgba = np.zeros((h, w, 4), dtype=np.uint8)
        text_rgba[text] = (*_LAYER_RGB[2], 255)
        put("Text", _to_image(text_rgba))
    else:
        put("rgba PNG - Layer 0", _to_image(masks["Neumes"]))
        put("rgba PNG - Layer 1", _to_image(masks["StaffLines"]))
    put("Selected Regions", _to_image(masks["SelectedRegions"]))
    return {name: inputs[name] for name in input_names(generation, 2)}


def _place_text(
    rng: np.random.Generator, background: npt.NDArray[np.bool_], selected: npt.NDArray[np.bool_]
) -> npt.NDArray[np.bool_]:
    """Words of minim strokes (the look of textualis at this page's scale) on free background."""
    import numpy as np

    h, w = background.shape
    free = background & selected
    # integral image of "not free", for O(1) emptiness checks of a window
    busy = np.zeros((h + 1, w + 1), dtype=np.int64)
    busy[1:, 1:] = np.cumsum(np.cumsum(~free, axis=0), axis=1)
    text = np.zeros((h, w), dtype=bool)
    letter_h, stroke, gap, pad = 36, 7, 6, 12
    target = int(0.015 * h * w)
    placed = 0
    attempts = max(200, h * w // 2000)
    for _ in range(attempts):
        if placed >= target:
            break
        strokes = [int(rng.integers(1, 4)) for _ in range(int(rng.integers(2, 7)))]
        word_w = sum(n * stroke + (n - 1) * gap for n in strokes) + 10 * (len(strokes) - 1)
        y0 = int(rng.integers(0, max(1, h - letter_h)))
        x0 = int(rng.integers(0, max(1, w - word_w)))
        ya, yb = y0 - pad, y0 + letter_h + pad
        xa, xb = x0 - pad, x0 + word_w + pad
        if ya < 0 or xa < 0 or yb > h or xb > w:
            continue
        if busy[yb, xb] - busy[ya, xb] - busy[yb, xa] + busy[ya, xa] != 0:
            continue
        if text[ya:yb, xa:xb].any():
            continue
        x = x0
        for n in strokes:
            for _ in range(n):
                text[y0 : y0 + letter_h, x : x + stroke] = True
                placed += letter_h * stroke
                x += stroke + gap
            x += 10 - gap
    return text


# ---------------------------------------------------------------------------------------------------
# make_sample_zip, make_multi_sample_zip

#: The files of a sample zip as Rodan's Pixel.js job (DDMAL/pixel_wrapper ``wrapper.py``) names them.
PIXELJS_IMAGE = "Image.png"
PIXELJS_SELECTED_REGIONS = "rgba PNG - Selected regions.png"
PIXELJS_BACKGROUND = "rgba PNG - Layer 0 (Background).png"
# A fixed member time (wrapper.py stamps the current time), so that the same page gives the same bytes.
_ZIP_TIME = (2024, 1, 1, 0, 0, 0)


def pixeljs_layer_file(number: int) -> str:
    """The file name of layer ``number`` in a sample zip (0 is the background)."""
    return PIXELJS_BACKGROUND if number == 0 else f"rgba PNG - Layer {number}.png"


def _upload_file(uploads_dir: Path, resource: str) -> Path:
    prefix = "/uploads/"
    if not resource.startswith(prefix):
        raise ValueError(f"{resource!r} is not a resource path under /uploads/")
    return Path(uploads_dir) / resource[len(prefix) :]


def _png_bytes(array: npt.NDArray[np.uint8]) -> bytes:
    buffer = io.BytesIO()
    _to_image(array).save(buffer, format="PNG", compress_level=1)  # OpenCV's imencode default: fast
    return buffer.getvalue()


def _zip_member(name: str, mode: int) -> zipfile.ZipInfo:
    info = zipfile.ZipInfo(name, date_time=_ZIP_TIME)
    info.compress_type = zipfile.ZIP_STORED
    info.external_attr = mode << 16
    return info


def make_sample_zip(zip_path: Path, uploads_dir: Path, inputs: Mapping[str, str]) -> Path:
    """Pack a newer-generation page into a sample zip as Rodan 3's Pixel.js job writes it; return ``zip_path``.

    ``inputs`` is what :func:`make_sample_page` or :func:`synthesize_page_from_masks` return with
    ``generation="new"`` for files under ``uploads_dir``. The members, at the top level, stored (no
    compression), in wrapper.py's order:

    - ``rgba PNG - Layer 0 (Background).png`` <- ``Background``;
    - ``rgba PNG - Layer k.png`` <- ``rgba PNG - Layer k-1`` (k = 1 ...: Pixel.js numbers the layers
      after the background from 1);
    - ``rgba PNG - Selected regions.png`` <- ``Selected Regions``;
    - ``Image.png`` <- ``Image``, written as wrapper.py writes it: four channels, alpha 255.

    Each layer (and the selected regions) is, as wrapper.py makes it, the image's pixels where the layer
    is and transparent black elsewhere; "where the layer is" is where the source is opaque (alpha 255),
    so every mask is exactly the one ``load_page`` reads from the loose file (partial alpha becomes
    transparent).
    """
    import numpy as np
    from PIL import Image

    with Image.open(_upload_file(uploads_dir, inputs["Image"])) as opened:
        rgba = np.array(opened.convert("RGB").convert("RGBA"), dtype=np.uint8)

    def masked(name: str) -> bytes:
        with Image.open(_upload_file(uploads_dir, inputs[name])) as layer:
            alpha = np.asarray(layer.convert("RGBA").getchannel("A"), dtype=np.uint8)
        if alpha.shape != rgba.shape[:2]:
            raise ValueError(f"{name} is {alpha.shape[1]}x{alpha.shape[0]}, the image {rgba.shape[1]}x{rgba.shape[0]}")
        out = np.zeros_like(rgba)
        out[alpha == 255] = rgba[alpha == 255]
        return _png_bytes(out)

    layers = [name for name in input_names("new", MAX_NEW_LAYERS) if name in inputs and name.startswith("rgba PNG")]
    members = [(PIXELJS_BACKGROUND, masked("Background"))]
    members += [(pixeljs_layer_file(k), masked(name)) for k, name in enumerate(layers, 1)]
    members.append((PIXELJS_SELECTED_REGIONS, masked("Selected Regions")))
    members.append((PIXELJS_IMAGE, _png_bytes(rgba)))
    zip_path = Path(zip_path)
    zip_path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(zip_path, mode=None) as handle, zipfile.ZipFile(handle, "w") as archive:
        for name, data in members:
            archive.writestr(_zip_member(name, 0o600), data)  # writestr's mode for a name
    return zip_path


def make_multi_sample_zip(zip_path: Path, samples: Mapping[str, Path], *, folder_entries: bool = False) -> Path:
    """Put sample zips (folder name -> sample zip) into one Multi-Sample Zip; return ``zip_path``.

    As Rodan 3's trainer writes its ``Multi-Sample Zip`` output: ``<folder>/<file>`` for every file of
    every sample, stored, regular files (mode 644), no folder entries; ``folder_entries=True`` adds a
    ``<folder>/`` entry before each folder's files, as ``zip -r`` does.
    """
    zip_path = Path(zip_path)
    zip_path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(zip_path, mode=None) as handle, zipfile.ZipFile(handle, "w") as archive:
        for folder, sample in samples.items():
            if folder_entries:
                archive.writestr(_zip_member(f"{folder}/", stat.S_IFDIR | 0o755), b"")
            with zipfile.ZipFile(sample) as source:
                for info in source.infolist():
                    data = source.read(info)
                    archive.writestr(_zip_member(f"{folder}/{info.filename}", stat.S_IFREG | 0o644), data)
    return zip_path
