"""The sections of ``lmcache-platform bench``, one module per measured concern.

``handoff`` (wrappers to a spawned process, and the one-time migration; ``child`` is the
receiving process), ``transfer`` (store/retrieve throughput), ``dispatch`` (per-call
overhead and import cost) and ``stats`` (timing, summaries and the report). The command
itself, which runs the sections and prints the table, is :mod:`lmcache_platform._cli.bench`.
"""
