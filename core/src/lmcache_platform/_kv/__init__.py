"""KV-cache machinery behind :class:`lmcache_platform.BaseCacheContext`.

One concern per module: ``layout`` (what each layer's tensor looks like), ``groups``
(layers grouped by geometry and by engine group), ``staging`` (the staging buffer's
slots), ``transfer`` (moving chunks between paged blocks and staging) and ``context``
(the base class that ties them together). The public names are re-exported from
:mod:`lmcache_platform`; nothing here is imported by ``import lmcache_platform`` but
those names, and torch is imported only when a context is built.
"""
