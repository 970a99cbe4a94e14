"""``python -m lmcache_platform``: the ``lmcache-platform`` command, as ``python -m pip`` runs pip.

It picks the interpreter explicitly (the venv's, say) where the console script may be
another environment's or missing from ``PATH``.
"""

import sys

from ._cli import main

if __name__ == "__main__":
    sys.exit(main())
