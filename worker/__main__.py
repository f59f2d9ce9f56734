"""``python -m worker`` (what the batch script runs) is ``hpc-worker``."""

from worker.cli import main

raise SystemExit(main())
