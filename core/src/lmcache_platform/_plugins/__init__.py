"""The plugin machinery: how installed backends become one class per device type.

One chain, one module per link:

* :mod:`.discovery` reads the ``lmcache.platform`` entry points from installed metadata
  and imports nothing;
* :mod:`.registry` loads a device type's backends on its first lookup (isolating and
  rolling back the ones that fail), validates their hook answers against
  :mod:`lmcache_platform.hookspecs`, and caches the chosen classes;
* :mod:`.selection` applies the rule that picks one backend per device type.

The operator's switches (``LMCACHE_PLATFORM_BACKEND``, ``_DISABLE``, ``_AUTOLOAD``) are
read through :mod:`lmcache_platform._env`. Public names are re-exported from
:mod:`lmcache_platform`.
"""
