"""``python -m ucmcache.cli``: the ``ucmcache`` command."""
import sys

from ._commands import main

sys.exit(main())
