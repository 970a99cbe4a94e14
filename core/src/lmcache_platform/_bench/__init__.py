"""The sections of ``lmcache-platform bench``, one module per measured concern.

``handoff`` (wrappers to a spawned process, and the one-time migration; ``child`` is the
receiving process), ``peak`` (the peak memory the migration adds), ``transfer``
(store/retrieve throughput), ``dispatch`` (per-call overhead and import cost); under them
``kvsets`` (the KV sets and sizes they measure) and ``stats`` (timing, summaries and the
report), which import no section. The command itself, which runs the sections and prints
the table, is :mod:`lmcache_platform._cli.bench`.
"""
