"""The backend conformance suite: what every lmcache-platform backend must do.

Run it against an installed backend, by its entry-point name::

    pytest --pyargs lmcache_platform.conformance --lmcache-backend NAME
    lmcache-platform check NAME          # the same, with a summary; exit status 0 = conformant

The backend is selected for its device type through ``LMCACHE_PLATFORM_BACKEND``, so
other installed backends do not get in the way. It checks, on tensors allocated
with ``torch.device(device_type)``:

* the hooks: every ``lmcache_platform_*`` function is a marked implementation of a
  known spec with valid arguments; the declared backend API major; classes of the
  right bases and device type; bounded wire fields; the probe and gc answers
  (``test_hooks``);
* IPC: wrap, :func:`lmcache_platform.wire.encode`, ``decode`` and ``to_tensor()`` in a
  spawned process, aliasing the same memory with writes visible both ways, for
  several dtypes and for strided views at an offset (``test_ipc``);
* the cache context, for every KV format the context class claims
  (``supported_kv_formats``, default all of :class:`~lmcache_platform.KVFormat`):
  construction through ``create_cache_context`` in the spawned process, bit-exact
  ``store_chunk`` and ``retrieve_chunk`` that touch nothing else, and idempotent
  ``close()`` (``test_context``);
* host memory, for backends built on :mod:`lmcache_platform.hostmem`: an empty tensor
  needs no memory, views of one allocation share one export, a forked child never
  releases its parent's memory, a capacity error leaves no fd or mapping behind, and
  closing every export keeps the engine's tensor (``test_hostmem``);
* coexistence: in a fresh process that selects nothing, next to a stand-in for the
  missing one, the primary backend (``<device_type>``) still serves when a variant
  (``<device_type>.<variant>``) is installed, and a wire tag the variant shares with the
  primary declares the same fields (``test_variant``);
* the error cases: malformed or hostile descriptors raise ``DescriptorError`` before
  anything is mapped, tampered wire bytes ``WireFormatError``, out-of-range block ids
  ``TransferError`` with nothing written, an empty wrapper list ``ValueError``
  (``test_errors``).

Device checks skip, with the probe's reason, where the backend cannot serve (a
CUDA backend without a GPU); a backend that fails to load fails them.
"""
