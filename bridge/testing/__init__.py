"""Test support that ships with the bridge: a stand-in for Rodan and sample pages.

Operators and the demo use it to try a deployment without a real Rodan (``python -m bridge.testing``);
the test suite uses it as its Rodan. Nothing in the bridge's own path imports it.

``bridge.testing.rodan`` is standard library only; ``bridge.testing.samples`` needs numpy and Pillow
(imported when its functions run).
"""

from bridge.testing.rodan import ReceivedRequest, RodanStandin, User, token_for_email

__all__ = ["ReceivedRequest", "RodanStandin", "User", "token_for_email"]
