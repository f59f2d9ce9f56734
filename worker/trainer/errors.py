"""The one exception type a user can act on."""

from __future__ import annotations


class TrainingInputError(ValueError):
    """The training input is unusable and only the user can fix it.

    Raised for images that cannot be decoded, layers whose size differs from the image,
    layers without pixels inside the selected regions, patches larger than the page, or a
    page on which no patches could be sampled. The message is meant for a human and names
    the layer concerned.
    """
