"""Version numbers: the distribution's, and the backend API major a backend must target."""

__version__ = "0.1.0"

#: Major version of the backend-facing API (hook specs, base classes, config object).
#: A backend declares the major it was written against through the
#: ``lmcache_platform_api_version`` hook; core refuses any other major.
API_VERSION = 1
