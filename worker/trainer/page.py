"""One training page: the image and a boolean mask per layer, loaded with Pillow."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt
from PIL import Image, ImageOps, UnidentifiedImageError

from worker.trainer.errors import TrainingInputError

#: A layer (or the selected regions) covers the pixels whose alpha is exactly this.
OPAQUE = 255
#: The only formats an input is opened as (docs/protocol.md §2.3: the image is a PNG or JPEG, the layers
#: RGBA PNGs). Nothing else is even identified: no EPS (Ghostscript), TIFF, BMP, GIF, ...
FORMATS = ("PNG", "JPEG")
#: The pixel limit (width x height) of one image when the caller gives none; the worker passes
#: the bridge's HPC_MAX_INPUT_PIXELS (the same default).
DEFAULT_MAX_PIXELS = 400_000_000

# Pillow's own decompression-bomb check reads the module-wide Image.MAX_IMAGE_PIXELS (a warning
# above it, an error above twice it). _open checks the caller's limit itself, from the header, so
# Pillow's check is off (None) for the few header-reading instructions of one Image.open, under
# this lock, and the previous value is back when it returns.
_PIXEL_LIMIT_LOCK = threading.Lock()

_SIXTEEN_BIT_GREY = {"I", "I;16", "I;16B", "I;16L", "I;16N"}


@dataclass(eq=False)
class Page:
    """A page to train on.

    ``image`` is uint8 ``(H, W, 3)`` in RGB order. ``masks`` maps each layer's label to a
    bool ``(H, W)`` array that is already restricted to the selected regions; its
    insertion order is the training order. ``name`` (optional, e.g. the sample zip's) only
    names the page in the messages of a multi-page run; it is no part of what is trained.
    """

    image: npt.NDArray[np.uint8]
    masks: dict[str, npt.NDArray[np.bool_]]
    name: str = ""

    @property
    def height(self) -> int:
        return int(self.image.shape[0])

    @property
    def width(self) -> int:
        return int(self.image.shape[1])


@contextmanager
def _own_pixel_check() -> Iterator[None]:
    """Pillow's global pixel limit off for one open: the caller checks its own limit instead.

    Neither Pillow's default limit (about 89 million pixels, far below HPC_MAX_INPUT_PIXELS'
    default) decides, nor is a global left changed for other code.
    """
    with _PIXEL_LIMIT_LOCK:
        saved = Image.MAX_IMAGE_PIXELS
        Image.MAX_IMAGE_PIXELS = None
        try:
            yield
        finally:
            Image.MAX_IMAGE_PIXELS = saved


def _too_large(what: str, path: Path, max_pixels: int, size: str = "") -> TrainingInputError:
    return TrainingInputError(
        f"{what} ({path.name}) is larger{size} than the limit of {max_pixels} pixels per image (HPC_MAX_INPUT_PIXELS)"
    )


def _open(path: Path, what: str, max_pixels: int = DEFAULT_MAX_PIXELS) -> Image.Image:
    """Decode ``path`` fully as a PNG or JPEG of at most ``max_pixels`` pixels.

    Anything but a missing file becomes TrainingInputError: another format (identified by no
    decoder, so none of Pillow's other plugins ever runs), an image over the limit (refused from
    its header, before any pixel is decoded), or a broken file.
    """
    try:
        with _own_pixel_check():
            opened = Image.open(path, formats=list(FORMATS))
    except FileNotFoundError:
        raise
    except UnidentifiedImageError as exc:
        raise TrainingInputError(
            f"{what} ({path.name}) is not a readable image: not a PNG or JPEG file ({_first_bytes(path)})"
        ) from exc
    except (OSError, SyntaxError, ValueError) as exc:
        raise TrainingInputError(f"{what} ({path.name}) is not a readable image: {exc}") from exc
    with opened:
        width, height = opened.size
        if width * height > max_pixels:
            raise _too_large(what, path, max_pixels, f" ({width}x{height} pixels)")
        try:
            opened.load()
            loaded: Image.Image = opened.copy()
        except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
            raise _too_large(what, path, max_pixels) from exc  # a frame larger than the header said
        except (OSError, SyntaxError, ValueError) as exc:
            raise TrainingInputError(f"{what} ({path.name}) is not a readable image: {exc}") from exc
    return loaded


def _first_bytes(path: Path) -> str:
    try:
        with path.open("rb") as handle:
            head = handle.read(16)
    except OSError:
        return "it cannot be read"
    return f"it starts with {head.hex()}" if head else "it is empty"


def _has_alpha(image: Image.Image) -> bool:
    bands = image.getbands()
    return "A" in bands or "a" in bands or (image.mode == "P" and "transparency" in image.info)


def _rgb(image: Image.Image) -> npt.NDArray[np.uint8]:
    """RGB uint8 pixels as OpenCV's ``IMREAD_COLOR`` would give them (but in RGB order).

    EXIF orientation is applied (OpenCV does so too), alpha is dropped without compositing,
    grey is replicated, and 16-bit grey keeps its high byte.
    """
    image = ImageOps.exif_transpose(image)
    if image.mode in _SIXTEEN_BIT_GREY:
        grey = (np.asarray(image).astype(np.uint32) >> 8).clip(0, 255).astype(np.uint8)
        return np.ascontiguousarray(np.repeat(grey[:, :, None], 3, axis=2))
    return np.array(image.convert("RGB"), dtype=np.uint8)


def _opaque(image: Image.Image, what: str, path: Path) -> npt.NDArray[np.bool_]:
    if not _has_alpha(image):
        raise TrainingInputError(
            f"{what} ({path.name}) has no alpha channel; it must be an RGBA PNG whose "
            f"pixels are opaque (alpha {OPAQUE}) where the {what} is"
        )
    alpha = image.getchannel("A") if image.mode in ("RGBA", "LA", "PA") else image.convert("RGBA").getchannel("A")
    opaque: npt.NDArray[np.bool_] = np.asarray(alpha, dtype=np.uint8) == OPAQUE
    return opaque


def _check_size(width: int, height: int, image: Image.Image, what: str) -> None:
    if image.size != (width, height):
        raise TrainingInputError(
            f"{what} is {image.width}x{image.height} pixels but the image is {width}x{height}; "
            "every layer must have exactly the size of the image"
        )


def load_page(
    image_path: Path,
    layer_paths: Mapping[str, Path],
    selected_regions_path: Path | None,
    *,
    max_pixels: int = DEFAULT_MAX_PIXELS,
) -> Page:
    """Load a page as Rodan's trainer does.

    The image is a PNG or JPEG (nothing else is opened); RGBA and grey images become RGB.
    Each layer and the selected regions are RGBA PNGs that cover the pixels whose alpha is
    255; every layer mask is ANDed with the selected regions (without
    ``selected_regions_path`` the whole page counts as selected). The masks keep the order
    of ``layer_paths``. No file may have more than ``max_pixels`` pixels (width x height).

    Raises TrainingInputError if a file is not a decodable PNG or JPEG, is over the pixel
    limit, a layer has no alpha channel, or sizes differ. A missing file raises
    FileNotFoundError.
    """
    image = _open(Path(image_path), "the image", max_pixels)
    pixels = _rgb(image)
    height, width = pixels.shape[:2]  # EXIF rotation may have swapped them
    del image

    regions: npt.NDArray[np.bool_] | None = None
    if selected_regions_path is not None:
        path = Path(selected_regions_path)
        what = "the selected regions"
        picture = _open(path, what, max_pixels)
        _check_size(width, height, picture, what)
        regions = _opaque(picture, what, path)

    masks: dict[str, npt.NDArray[np.bool_]] = {}
    for label, layer_path in layer_paths.items():
        path = Path(layer_path)
        what = f"layer {label!r}"
        picture = _open(path, what, max_pixels)
        _check_size(width, height, picture, what)
        mask = _opaque(picture, what, path)
        masks[label] = mask if regions is None else np.logical_and(mask, regions)
    return Page(image=pixels, masks=masks)
