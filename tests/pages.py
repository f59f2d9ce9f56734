"""Small synthetic pages for trainer tests."""

from __future__ import annotations

import numpy as np

from worker.trainer import Page


def striped_page(height: int = 300, width: int = 300) -> Page:
    """Dark horizontal "staff lines" (Layer 0) on light paper (Background), a bit coloured."""
    ink = np.zeros((height, width), dtype=bool)
    for row in range(20, height, 24):
        ink[row : row + 6, :] = True
    image = np.empty((height, width, 3), dtype=np.uint8)
    image[:] = (235, 225, 200)
    image[ink] = (40, 20, 10)
    return Page(image=image, masks={"Background": ~ink, "Layer 0": ink})
