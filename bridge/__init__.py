"""hpc-bridge: the login-node side, and the modules the batch jobs share with it.

Its modules come in three kinds. The import contracts in pyproject.toml (``lint-imports``, run by
the test command) keep them apart, and tests/test_import_contracts.py checks that every module is
named below, in the kind the contracts give it.

Job-side (they also run inside batch jobs: the worker, the chain's links, the probe job; none of
them imports a login-only module): ``amqp``, ``atomic``, ``chain``, ``continuation_record``,
``errors``, ``faults``, ``handoff``, ``instance``, ``logs``, ``progress``, ``protocol``, ``replies``,
``rodan``, ``schedulers``, ``shell``, ``spool``, ``version``.

Login-only (the bridge's pass or daemon and the operator commands, on the login node): ``__main__``,
``active``, ``cli``, ``config``, ``enqueue``, ``intake``, ``ledger``, ``ops``, ``reconcile``, ``rodan_cancel``,
``runner``, ``sdnotify``.

Test support (the Rodan stand-in and sample pages; no other module imports it): ``testing``.

No module here imports ``worker`` or TensorFlow; ``schedulers`` imports none of ``amqp``,
``rodan``, ``replies``, ``protocol``; ``atomic`` imports nothing of the project (``worker.trainer``
may use it and nothing else of the project); only ``shell`` imports :mod:`subprocess`.
"""
