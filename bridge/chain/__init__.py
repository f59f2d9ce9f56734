"""``hpc-bridge chain``: run any command for longer than one batch job may run.

The chain is N batch jobs ("links"), each held on the one before (Slurm ``afterany``, Grid
Engine ``-hold_jid``). Every link runs the same command under a supervisor (``python -m
bridge.chain RUN_DIR LINK``) that tells it where to checkpoint (``HPC_CHECKPOINT_DIR``) and
warns it with ``SIGUSR1`` when its time is nearly up. The command exits ``0`` when the work is
finished (the rest of the chain is cancelled), ``75`` (``EX_TEMPFAIL``) to continue in the next
link, anything else to fail the chain. Everything lives in one run directory, private to its
user (a link runs nothing from one that anyone else could have changed); ``chain.log``
holds one JSON event per line. No broker, no Rodan, no credentials. The full contract is in
``docs/researcher-guide.md``.

Modules: :mod:`~bridge.chain.settings` (options, :class:`ChainSettings`, the contract's
constants), :mod:`~bridge.chain.rundir` (:class:`ChainRunDir`, :class:`ChainLog`),
:mod:`~bridge.chain.submit` (submitting the links), :mod:`~bridge.chain.link` (the supervisor
inside each job), :mod:`~bridge.chain.follow` (``--wait``), :mod:`~bridge.chain.command`
(``hpc-bridge chain`` itself).
"""

from bridge.chain.command import cancel_chain, chain_command
from bridge.chain.rundir import ChainRunDir
from bridge.chain.settings import EX_TEMPFAIL, ChainError, ChainSettings

__all__ = ["EX_TEMPFAIL", "ChainError", "ChainRunDir", "ChainSettings", "cancel_chain", "chain_command"]
