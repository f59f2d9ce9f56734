"""One training page: the image and a boolean mask per layer, loaded with Pillow."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt
from PIL import Image, ImageOps, UnidentifiedImageError

from worker.trainer.errors import TrainingInputError

#: A layer (or the selected regions) covers the pixels whose alpha is exactly this.
OPAQUE = 255

_SIXTEEN_BIT_GREY = {"I", "I;16", "I;16B", "I;16L", "I;16N"}


@dataclass(eq=False)
class Page:
    """A page to train on.

    ``image`` is uint8 ``(H, W, 3)`` in RGB order. ``masks`` maps each layer's label to a
    bool ``(H, W)`` array that is already restricted to the selected regions; its
    insertion order is the training order.
    """

    image: npt.NDArray[np.uint8]
    masks: dict[str, npt.NDArray[np.bool_]]

    @property
    def height(self) -> int:
        return int(self.image.shape[0])

    @property
    def width(self) -> int:
        return int(self.image.shape[1])


def _open(path: Path, what: str) -> Image.Image:
    """Decode ``path`` fully, turning anything but a missing file into TrainingInputError."""
    try:
        with Image.open(path) as opened:
            opened.load()
            loaded: Image.Image = opened.copy()
            return loaded
    except FileNotFoundError:
        raise
    except (UnidentifiedImageError, Image.DecompressionBombError, OSError, SyntaxError, ValueError) as exc:
        raise TrainingInputError(f"{what} ({path.name}) is not a readable image: {exc}") from exc


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


def load_page(image_path: Path, layer_paths: Mapping[str, Path], selected_regions_path: Path | None) -> Page:
    """Load a page as Rodan's trainer does.

    The image may be any format Pillow decodes (PNG or JPEG in practice); RGBA and grey
    images become RGB. Each layer and the selected regions are RGBA PNGs that cover the
    pixels whose alpha is 255; every layer mask is ANDed with the selected regions
    (without ``selected_regions_path`` the whole page counts as selected). The masks keep
    the order of ``layer_paths``.

    Raises TrainingInputError if a file is not a decodable image, a layer has no alpha
    channel, or sizes differ. A missing file raises FileNotFoundError.
    """
    image = _open(Path(image_path), "the image")
    pixels = _rgb(image)
    height, width = pixels.shape[:2]  # EXIF rotation may have swapped them
    del image

    regions: npt.NDArray[np.bool_] | None = None
    if selected_regions_path is not None:
        path = Path(selected_regions_path)
        what = "the selected regions"
        picture = _open(path, what)
        _check_size(width, height, picture, what)
        regions = _opaque(picture, what, path)

    masks: dict[str, npt.NDArray[np.bool_]] = {}
    for label, layer_path in layer_paths.items():
        path = Path(layer_path)
        what = f"layer {label!r}"
        picture = _open(path, what)
        _check_size(width, height, picture, what)
        mask = _opaque(picture, what, path)
        masks[label] = mask if regions is None else np.logical_and(mask, regions)
    return Page(image=pixels, masks=masks)
