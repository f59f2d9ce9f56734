"""``python -m bridge`` is ``hpc-bridge``."""

from bridge.cli import main

raise SystemExit(main())
