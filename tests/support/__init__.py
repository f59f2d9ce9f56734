"""What several test modules share: the bridge as cron and systemd run it, the real clusters, the
Rodan side of the broker, waiting. Fixtures and hooks stay in tests/conftest.py; test modules import
from here, never from conftest or from another test module."""
