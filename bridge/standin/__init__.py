"""A stand-in for Rodan (REST API, uploads, sample pages) for tests and the demo.

``bridge.standin.server`` is standard library only; ``bridge.standin.samples`` needs numpy and Pillow
(imported when its functions run).
"""

from bridge.standin.server import RequestRecord, RodanStandin, User, token_for_email

__all__ = ["RequestRecord", "RodanStandin", "User", "token_for_email"]
