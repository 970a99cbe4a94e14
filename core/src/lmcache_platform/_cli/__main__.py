"""``python -m lmcache_platform._cli``: the ``lmcache-platform`` command without its script."""

import sys

from . import main

sys.exit(main())
