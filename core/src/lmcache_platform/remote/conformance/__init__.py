"""The remote-store conformance suite: what every remote store must do, against a live store.

Run it against a URL your store serves (a scratch store: it writes keys under a random
``lmcache-conformance:`` prefix, each with a TTL of ten minutes)::

    pytest --pyargs lmcache_platform.remote.conformance --lmcache-remote URL \\
        [--lmcache-remote-option KEY=VALUE ...] [--lmcache-remote-password-env NAME] \\
        [--lmcache-remote-tls-ca FILE]
    lmcache-platform check --remote URL     # the same, with a summary; exit status 0 = conformant

It opens the store through installed metadata exactly as ``serve --remote URL`` would
(:func:`lmcache_platform.remote.open_remote`) and checks (``test_store``):

* the round trip: values come back byte for byte, whatever bytes they hold (NUL, CR LF,
  every byte value, empty), from ``bytes``, ``bytearray`` and ``memoryview`` alike;
* missing keys: ``None`` from get, ``False`` from exists, in the order asked;
* pipelined batches: a thousand keys in one call, answers in order; replacing a value;
* ``delete_many``, where the store has it (optional; the server deletes damaged entries
  with it): the entry is gone, the others stay, ``True`` where one was removed;
* TTL: an entry put with a TTL is gone some seconds after it;
* large values: 64 MiB and more round trip (the figure is printed);
* timeouts: against a server that accepts connections and never answers, and against a
  port nobody listens on, every call raises :class:`~lmcache_platform.remote.RemoteTimeout`
  or :class:`~lmcache_platform.remote.RemoteUnavailable` in about its timeout;
* errors typed: nothing but :class:`~lmcache_platform.remote.RemoteError` subclasses
  escapes a call, including after ``close()``;
* concurrent use: several threads on one store, every answer right.

The stalled and the refusing server are made by replacing the URL's hosts with loopback
ones (a listener that never answers, a closed port); for a URL without hosts pass
``--lmcache-remote-stalled URL`` and ``--lmcache-remote-refused URL`` instead
(``check``: ``--remote-stalled``, ``--remote-refused``), or those checks are skipped and
``check`` says ``PASS (timeouts not checked)``.
"""
