"""``ucmcache demo`` and ``python -m ucmcache.demo``: run the demo of the source tree.

The demo (``demos/kv_demo.py``: inference workers sharing KV blocks through one segment, with a
summary and its own checks) is an application of the library, not part of it, so it is not
installed with it: it lives in the repository beside the tests and the benchmarks, with the
real-model demo and the harness both share (``demos/demo_harness.py``).  Like ``ucmcache bench``,
this entry point finds it next to the package, which is where it is in a checkout and in an
editable install (what ``./scripts/*`` make), and runs it in this process.  From an installed
wheel there is no source tree: it says so on one line and returns 2.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional, Sequence

DEMOS = Path(__file__).resolve().parents[1] / "demos"


def main(argv: Optional[Sequence[str]] = None) -> int:
    script = DEMOS / "kv_demo.py"
    if not script.is_file():
        print(f"ucmcache demo: the demo is not available: {script} does not exist (it ships "
              "with the source tree, not with an installed package: run ./scripts/demo in a "
              "checkout of the repository)", file=sys.stderr)
        return 2
    # The workers are spawned: they import the demo by name, with this sys.path.
    if str(DEMOS) not in sys.path:
        sys.path.insert(0, str(DEMOS))
    import kv_demo
    return kv_demo.main(argv)


if __name__ == "__main__":
    sys.exit(main())
