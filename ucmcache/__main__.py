"""``python -m ucmcache``: the ``ucmcache`` command (ucmcache.cli)."""
import sys

from .cli import main

sys.exit(main())
