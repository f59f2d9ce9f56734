"""``python -m bridge.chain RUN_DIR LINK``: the entry point of every link's batch job.

:func:`~bridge.chain.submit.link_spec` puts this command in each link's batch script; it runs
the link supervisor, :func:`~bridge.chain.link.link_main`, and exits with its status.
"""

import sys

from bridge.chain.link import link_main

sys.exit(link_main())
