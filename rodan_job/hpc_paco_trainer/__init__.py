"""hpc-bridge's Rodan 3.x job package: install it as ``rodan/jobs/hpc_paco_trainer`` (rodan_job/README.md)."""

__version__ = "1.0.0"

try:
    from rodan.jobs import module_loader
except ImportError:
    # Imported outside Rodan (rodan_job/tests): only hpc_relay and selftest, which need no Rodan.
    pass
else:
    module_loader("rodan.jobs.hpc_paco_trainer.hpc_fast_trainer")
