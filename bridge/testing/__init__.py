"""Test support that ships with the bridge: a stand-in for Rodan, sample pages, and a client of a
real Rodan 3.x's REST API.

Operators use the stand-in to try a deployment without a real Rodan (``python -m bridge.testing``);
the test suite uses it as its Rodan for outages and faults. The demo and the tests against the real
Rodan 3.1.0 drive it as a user would through ``bridge.testing.rodan_api``. Nothing in the bridge's
own path imports any of it.

``bridge.testing.rodan`` is standard library only; ``bridge.testing.samples`` needs numpy and Pillow
(imported when its functions run); ``bridge.testing.rodan_api`` needs requests.
"""

from bridge.testing.rodan import ReceivedRequest, RodanStandin, User, token_for_email

__all__ = ["ReceivedRequest", "RodanStandin", "User", "token_for_email"]
