"""Prometheus metrics of a segment, read from its shared per-rank counters without taking a rank.

``collector(uuid)`` is a prometheus_client collector a process can register in its own
registry (vLLM's ``/metrics``, a multiprocess setup); ``render(uuid)`` is one scrape as text
(``ucmcache metrics UUID --once``, for node_exporter's textfile collector); ``serve(uuid, port)``
answers ``/metrics`` over HTTP (``ucmcache metrics UUID --port P``).  Every scrape attaches
read-only, reads, and detaches, so a segment that is removed and made again is followed.

Names (all labelled ``segment``; per-rank ones also ``rank``):

* counters ``ucmcache_<name>_total`` for gets, hits, misses, joins, loads (loads started),
  load_failures, evictions, bypasses, clears, deletes, recovered_ranks and the tier-2 counters
  (``tier2_hits``, ``tier2_misses``, ``tier2_writes``, ``tier2_bypasses``, ``tier2_lease_waits``,
  ``tier2_bad_values``): each rank's counter exactly as ``stats()["per_rank"]`` has it, and
  their sum over ranks is ``stats()``'s figure;
* ``ucmcache_up`` 1 when the scrape could read the segment, 0 when it could not (removed,
  being made, foreign, corrupt: then no other series), and ``ucmcache_info`` (its labels: the
  package ``version``, ``layout_version``, ``max_ranks``, ``slots_per_rank``, ``slot_size``,
  ``slots``);
* gauges ``ucmcache_entries``, ``ucmcache_bytes``, ``ucmcache_capacity_bytes``,
  ``ucmcache_slots{state}`` (empty, loading, ready, failed), ``ucmcache_ranks{state}`` (live,
  dead, free), ``ucmcache_arenas{owner}`` (arenas owned by each rank that owns any, and
  ``free``: where each rank may allocate, DESIGN 4.12);
* with ``tiers=[path, ...]`` (``ucmcache metrics UUID --tier PATH``), each disk tier
  directory's counters as ``ucmcache_tier_<name>_total{tier="disk:<path>"}`` (``hits``,
  ``misses``, ``bypasses``, ``bad_values``, ``writes``, ``write_dedups``, ``write_drops``,
  ``write_failures``, ``evictions``, ``evicted_bytes``, ``read_bytes``, ``written_bytes``: the
  tier's ``t2_*``, summed over every process that used it) and ``ucmcache_tier_bytes{tier}``
  (its usage record; no scan of the directory at a scrape);
* histograms ``ucmcache_load_seconds`` (an owner's get to its publish) and
  ``ucmcache_wait_seconds`` (a join's wait), per rank, with fixed log-scale buckets (10 us
  times powers of 2, up to 41.9 s: no bucket wider than 2x) kept in the segment.
"""
from __future__ import annotations

import threading
from typing import Any, Dict, Iterator, List, Sequence, Tuple, TypedDict

import numpy as np

from .core.errors import UcmError
from .core.segment import Segment
from ._core import lib
from .core.stats import HIST_BOUNDS_NS, COUNTERS, histogram_buckets, rank_counters
from .core.table import accounting, arena_table, rank_rows, slot_fields, slot_table, state_counts

try:
    from prometheus_client import CollectorRegistry, generate_latest, start_http_server
    from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily,
                                        HistogramMetricFamily, InfoMetricFamily, Metric)
    from prometheus_client.registry import Collector
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError("ucmcache.metrics needs prometheus_client: pip install "
                      "'ucmcache[metrics]' (or prometheus_client)") from e

PREFIX = "ucmcache"
# Prometheus name (without _total) -> stats() counter, with its help text.
COUNTER_METRICS: Dict[str, Tuple[str, str]] = {
    "gets": ("gets", "Outer get requests (hits included)"),
    "hits": ("hits", "Gets served by a Ready entry"),
    "misses": ("misses", "Gets that installed a key (this caller loads it)"),
    "joins": ("joins", "Gets that joined another caller's load"),
    "loads": ("loads_started", "Loads started (loader runs)"),
    "load_failures": ("loads_failed", "Loads their owner published as Failed"),
    "evictions": ("evictions", "Counted entries evicted by CLOCK"),
    "bypasses": ("bypasses", "Loads run uncached because the cache was full"),
    "clears": ("clears", "clear() calls"),
    "deletes": ("deletes", "Entries removed by delete()"),
    "recovered_ranks": ("recovered_ranks", "Dead ranks recovered by this rank (or before "
                        "taking it, as this rank)"),
    "tier2_hits": ("t2_hits", "Local misses served from tier 2"),
    "tier2_misses": ("t2_misses", "Tier-2 lookups that found nothing"),
    "tier2_writes": ("t2_writes", "Tier-2 write-throughs"),
    "tier2_bypasses": ("t2_bypasses", "Tier 2 skipped (down, slow, breaker open)"),
    "tier2_lease_waits": ("t2_lease_waits", "Waits for another node's load"),
    "tier2_bad_values": ("t2_bad_values", "Corrupt or foreign tier-2 values"),
}


class Snapshot(TypedDict):
    """What one scrape reads from a segment."""
    counters: np.ndarray        # (max_ranks, UCM_ST_COUNT), as stats() sums them
    entries: int
    size: int
    capacity: int
    slots: Dict[str, int]       # slots by state
    ranks: Dict[str, int]       # live, dead, free
    arenas: Dict[str, int]      # arenas by owner (a rank, or free)


def _snapshot(seg: Segment) -> Snapshot:
    """Everything one scrape reports, read from the mapping (no rank taken)."""
    L = seg.layout
    counters = rank_counters(seg)  # the same snapshot stats() sums
    acc = accounting(seg)
    states = state_counts(slot_fields(slot_table(seg))["state"])
    rows = rank_rows(seg)
    ranks = {"live": sum(r["alive"] for r in rows), "dead": sum(r["dead"] for r in rows)}
    ranks["free"] = len(rows) - ranks["live"] - ranks["dead"]
    owners = arena_table(seg)["owner"].tolist()
    arenas = {"free": owners.count(0)}
    for word in sorted(set(owners) - {0}):
        arenas[str(word - 1)] = owners.count(word)
    return {"counters": counters, "entries": acc["entries"], "size": acc["size_bytes"],
            "capacity": L.n_slots * L.slot_size, "slots": states, "ranks": ranks,
            "arenas": arenas}


def _histogram(name: str, help_text: str, uuid: str, snap: Snapshot,
               which: str) -> HistogramMetricFamily:
    fam = HistogramMetricFamily(f"{PREFIX}_{name}", help_text, labels=["segment", "rank"])
    counters = snap["counters"]
    bounds = [b / 1e9 for b in HIST_BOUNDS_NS] + [float("inf")]
    for r in range(counters.shape[0]):
        row = counters[r]
        per_bucket = histogram_buckets(row, which)
        cumulative, total = [], 0
        for bound, n in zip(bounds, per_bucket):
            total += n
            cumulative.append((repr(bound) if bound != float("inf") else "+Inf", total))
        fam.add_metric([uuid, str(r)], cumulative,
                       sum_value=int(row[COUNTERS[f"{which}_sum_ns"]]) / 1e9)
    return fam


class SegmentCollector(Collector):
    """A prometheus_client collector for one segment (see the module docs)."""

    def __init__(self, uuid: str, *, timeout: float = 1.0, tiers: Sequence[str] = ()):
        self.uuid = uuid
        self.timeout = timeout
        self.tiers = list(tiers)

    def collect(self) -> Iterator[Metric]:
        # A segment removed, half made, foreign or corrupt is a fact to report, not a failed
        # scrape: ucmcache_up 0 (an alert's series) and nothing else.
        up = GaugeMetricFamily(f"{PREFIX}_up", "1 if the segment could be read at this scrape",
                               labels=["segment"])
        try:
            seg = Segment.attach(self.uuid, timeout=self.timeout, writable=False)
            try:
                snap = _snapshot(seg)
                params = _params(seg)
            finally:
                seg.detach()
        except (UcmError, OSError, ValueError):
            up.add_metric([self.uuid], 0)
            yield up
            return
        up.add_metric([self.uuid], 1)
        yield up
        info = InfoMetricFamily(f"{PREFIX}", "The segment's parameters and this package's version",
                                labels=["segment"])
        info.add_metric([self.uuid], params)
        yield info
        yield from families(self.uuid, snap)
        if self.tiers:
            yield from tier_families(self.tiers)


def tier_families(paths: Sequence[str]) -> List[Metric]:
    """The disk tiers' counters and usage (see the module docs), labelled by tier."""
    from .tiers.disk.counters import NAMES
    from .tiers.disk.facts import tier_usage
    rows = [tier_usage(p) for p in paths]  # read only: a scrape builds no DiskTier, keeps no fd
    out: List[Metric] = []
    for name in NAMES:
        short = name[len("t2_"):]
        fam = CounterMetricFamily(f"{PREFIX}_tier_{short}", f"Disk tier {name}", labels=["tier"])
        for label, counters, _ in rows:
            fam.add_metric([label], counters[name])
        out.append(fam)
    usage = GaugeMetricFamily(f"{PREFIX}_tier_bytes", "Bytes of a disk tier's block files (its "
                              "usage record)", labels=["tier"])
    for label, _, used in rows:
        usage.add_metric([label], used)
    out.append(usage)
    return out


def _params(seg: Segment) -> Dict[str, str]:
    L = seg.layout
    from . import __version__
    return {"version": __version__, "layout_version": str(lib.UCM_LAYOUT_VERSION),
            "max_ranks": str(L.max_ranks), "slots_per_rank": str(L.slots_per_rank),
            "slot_size": str(L.slot_size), "slots": str(L.n_slots)}


def families(uuid: str, snap: Snapshot) -> List[Metric]:
    out: List[Metric] = []
    counters = snap["counters"]
    for name, (stat, help_text) in COUNTER_METRICS.items():
        counter = CounterMetricFamily(f"{PREFIX}_{name}", help_text, labels=["segment", "rank"])
        for r in range(counters.shape[0]):
            counter.add_metric([uuid, str(r)], int(counters[r, COUNTERS[stat]]))
        out.append(counter)
    for name, value, help_text in (
            ("entries", snap["entries"], "Ready entries of the current generation"),
            ("bytes", snap["size"], "Payload bytes of those entries"),
            ("capacity_bytes", snap["capacity"], "Slots times slot size")):
        fam = GaugeMetricFamily(f"{PREFIX}_{name}", help_text, labels=["segment"])
        fam.add_metric([uuid], value)
        out.append(fam)
    fam = GaugeMetricFamily(f"{PREFIX}_slots", "Slots by state", labels=["segment", "state"])
    for state, n in snap["slots"].items():
        fam.add_metric([uuid, state], n)
    out.append(fam)
    fam = GaugeMetricFamily(f"{PREFIX}_ranks", "Ranks by state", labels=["segment", "state"])
    for state, n in snap["ranks"].items():
        fam.add_metric([uuid, state], n)
    out.append(fam)
    fam = GaugeMetricFamily(f"{PREFIX}_arenas", "Arenas by owner (a rank, or free)",
                            labels=["segment", "owner"])
    for owner, n in snap["arenas"].items():
        fam.add_metric([uuid, owner], n)
    out.append(fam)
    out.append(_histogram("load_seconds", "Time from an owner's get to its publish", uuid,
                          snap, "load"))
    out.append(_histogram("wait_seconds", "Time a join waited for another caller's load",
                          uuid, snap, "wait"))
    return out


def collector(uuid: str, *, timeout: float = 1.0,
              tiers: Sequence[str] = ()) -> SegmentCollector:
    """A collector to register: ``prometheus_client.REGISTRY.register(collector(uuid))``;
    ``tiers``: disk tier directories to report too."""
    Segment.attach(uuid, timeout=timeout, writable=False).detach()  # fail now, not per scrape
    if tiers:
        from .tiers.disk.facts import tier_usage
        for p in tiers:
            tier_usage(p)  # not a tier directory: fail now, not per scrape
    return SegmentCollector(uuid, timeout=timeout, tiers=tiers)


def render(uuid: str, *, timeout: float = 1.0, tiers: Sequence[str] = ()) -> str:
    """One scrape in the Prometheus text format."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector(uuid, timeout=timeout, tiers=tiers))
    return generate_latest(registry).decode("utf-8")


def serve(uuid: str, port: int, addr: str = "0.0.0.0", *,
          timeout: float = 1.0, tiers: Sequence[str] = ()) -> Tuple[Any, threading.Thread]:
    """Answer /metrics on addr:port from a background thread; returns (server, thread)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector(uuid, timeout=timeout, tiers=tiers))
    return start_http_server(port, addr=addr, registry=registry)


__all__ = ["SegmentCollector", "collector", "render", "serve", "COUNTER_METRICS"]
