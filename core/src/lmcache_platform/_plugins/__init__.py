"""The plugin machinery: how installed plugins become one class per device type (or one store per URL scheme).

One chain, one module per link:

* :mod:`.discovery` reads an entry-point group from installed metadata and imports nothing;
* :mod:`.engine` is the one plugin engine, configured per entry-point group: it loads the
  plugins of a key (a device type, a URL scheme) on its first use, isolating and rolling
  back the ones that fail, and calls one plugin's own hooks;
* :mod:`.registry` is the ``lmcache.platform`` group over it: it checks the backends'
  answers against :mod:`lmcache_platform.hookspecs` and caches the chosen classes
  (remote stores are the ``lmcache.remote`` group, in :mod:`lmcache_platform.remote`);
* :mod:`.selection` applies the rule that picks one backend per device type.

The operator's switches (``LMCACHE_PLATFORM_BACKEND``, ``_DISABLE``, ``_AUTOLOAD``) are
read through :mod:`lmcache_platform._env`. Public names are re-exported from
:mod:`lmcache_platform`.
"""
