"""Stats: per-rank counters in each rank's own lines of the segment, written only by that rank.

The counter names and their order come from the C header (UCM_ST_*): one list, two languages.
The original specification's acceptance metrics derive from them: outer requests = gets,
loader runs = loads_started, hits, misses, waiters = joins, failures = loads_failed.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List

import numpy as np

from .._core import lib
from .table import rank_rows, rank_table

COUNTERS: Dict[str, int] = {
    name[len("UCM_ST_"):].lower(): getattr(lib, name)
    for name in dir(lib)
    if name.startswith("UCM_ST_") and name != "UCM_ST_COUNT" and not name.endswith("_HIST")
}
# Histograms: name -> first bucket's counter; bucket k counts values <= HIST_BOUNDS_NS[k] (the
# last bucket: everything above).  Their _sum_ns and _count are ordinary counters above.
HISTOGRAMS: Dict[str, int] = {"load": lib.UCM_ST_LOAD_HIST, "wait": lib.UCM_ST_WAIT_HIST}
HIST_BOUNDS_NS: List[int] = [lib.UCM_HIST_FIRST_NS * lib.UCM_HIST_FACTOR ** k
                             for k in range(lib.UCM_HIST_BUCKETS - 1)]
COUNTER_NAMES: List[str] = sorted(COUNTERS, key=COUNTERS.__getitem__)


def rank_counters(seg) -> np.ndarray:
    """A (max_ranks, UCM_ST_COUNT) snapshot of every rank's counters (a copy), by UCM_ST_*."""
    snap = rank_table(seg, copy=False)["stats"].copy()
    # A lock-free hit bumps only FAST_HITS (see UCM_ST_GETS): outer requests and hits include it.
    snap[:, lib.UCM_ST_GETS] += snap[:, lib.UCM_ST_FAST_HITS]
    snap[:, lib.UCM_ST_HITS] += snap[:, lib.UCM_ST_FAST_HITS]
    return snap


def named(row: np.ndarray) -> Dict[str, int]:
    """One rank's counters (or their sum over ranks) by name, in UCM_ST_* order."""
    return {name: int(row[COUNTERS[name]]) for name in COUNTER_NAMES}


def histogram_buckets(row: np.ndarray, name: str) -> List[int]:
    """The per-bucket (not cumulative) counts of histogram `name` in one rank's row."""
    first = HISTOGRAMS[name]
    return [int(v) for v in row[first:first + lib.UCM_HIST_BUCKETS]]


def collect(seg, alive: Callable[[int], bool]) -> Dict[str, Any]:
    snap = rank_counters(seg)
    out: Dict[str, Any] = named(snap.sum(axis=0))
    out["wait_seconds"] = out["wait_ns"] / 1e9
    out["per_rank"] = [dict(named(snap[row["rank"]]), **row) for row in rank_rows(seg, alive)]
    return out
