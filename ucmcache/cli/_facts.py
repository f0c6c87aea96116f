"""Facts: what the ``ucmcache`` command gathers from a segment, as plain dicts.

Every dict here is a documented ``--json`` form (see ucmcache/cli/__init__.py) or a part of
one; rendering them as text is _render's job, running a command _commands'.  Opening a segment
goes through here too, so that every command refuses a missing, foreign, half-made or corrupt
one with the same one-line error.
"""
from __future__ import annotations

import os
import stat
from contextlib import contextmanager
from typing import Any, Dict, Iterator, List, Optional

import numpy as np

from ..core.errors import CorruptSegment, IncompatibleSegment, SegmentNotFound, UcmError
from ..core.ring import ring_counters
from ..core.stats import named, rank_counters
from ..core.table import (accounting, arena_owners, claimant, claimed, current, pin_bits, rank_rows, slot_fields,
                      slot_table, state_counts)
from ..core.verify import verify_segment
from ..lowlevel import (PREFIX, SHM_DIR, Segment, check_uuid, file_kind, lib, not_ours_error,
                        probe, probed_error, shm_path)

CHAIN_TARGET = 2            # DESIGN 2: n_buckets is sized so the mean chain is at most 2
STUCK_ITEMS = 100           # stuck items listed in --json (counts are always complete)
JSON_SCHEMA = 1


class CliError(Exception):
    """Stops a command with one line on stderr and an exit code."""

    def __init__(self, message: str, code: int = 2):
        super().__init__(message)
        self.code = code


# ------------------------------------------------------------------------- opening segments

def check_uuid_arg(uuid: str) -> str:
    try:
        return check_uuid(uuid)
    except ValueError as e:
        raise CliError(str(e)) from None


def probe_segment(uuid: str) -> Dict[str, Any]:
    """probe() with the CLI's errors: missing, unreadable and foreign are bad input (2)."""
    check_uuid_arg(uuid)
    try:
        info = probe(uuid)
    except UcmError as e:               # SegmentNotFound, ForeignSegment (cannot open)
        raise CliError(str(e)) from None
    except OSError as e:
        raise CliError(f"segment {uuid!r} cannot be read: {e}") from None
    if info["uid"] != os.getuid():
        raise CliError(str(not_ours_error(uuid, info["uid"], "refusing to touch it")))
    return info


def refuse_unmade(uuid: str, info: Dict[str, Any]) -> None:
    """A probed segment that is half-made, incompatible or corrupt stops the command with the
    error attach would raise: a problem found (1), or bad input (2) if it is not a ucmcache
    segment at all (a magic we never write)."""
    error = probed_error(uuid, info)
    if error is not None:
        foreign = info["header"].get("magic", 0) not in (0, lib.UCM_MAGIC)
        raise CliError(str(error), 2 if foreign else 1)


@contextmanager
def attached(uuid: str, *, writable: bool = False, timeout: float = 2.0) -> Iterator[Segment]:
    """A mapped, validated segment (no rank taken), detached afterwards."""
    refuse_unmade(uuid, probe_segment(uuid))
    try:
        seg = Segment.attach(uuid, timeout=timeout, writable=writable)
    except (IncompatibleSegment, CorruptSegment, TimeoutError) as e:  # HalfMadeSegment too
        raise CliError(str(e), 1) from None
    except UcmError as e:
        raise CliError(str(e)) from None
    except OSError as e:
        raise CliError(f"segment {uuid!r} cannot be mapped: {e}") from None
    try:
        yield seg
    finally:
        seg.detach()


# ------------------------------------------------------------------------- summary, status

def summary(seg: Segment) -> Dict[str, Any]:
    """The cheap facts (no slot scan): generation, exact entries/bytes, ranks."""
    out: Dict[str, Any] = accounting(seg)
    out["ranks"] = rank_rows(seg)
    out["live"] = any(r["alive"] for r in out["ranks"])
    return out


def status_word(live: bool, dead: bool) -> str:
    if live:
        return "live"
    return "orphan" if dead else "idle"


# ------------------------------------------------------------------------- inspect

def _slot_facts(seg: Segment, generation: int) -> Dict[str, Any]:
    """slot_states for --json, and the masks the rank rows are counted from."""
    f = slot_fields(slot_table(seg))
    ref, state = f["reference"], f["state"]
    claims = claimed(ref)
    pins = pin_bits(ref)
    ready = state == lib.UCM_READY
    visible = ready & (f["bucket"] != lib.UCM_INVALID_BUCKET) & current(f, generation)
    states = state_counts(state)
    states.update(stale=int((ready & ~visible).sum()), pinned=int((pins != 0).sum()),
                  claimed=int(claims.sum()))
    return {"states": states, "used": visible | (state == lib.UCM_LOADING), "pins": pins,
            "claims": claims, "claimant": claimant(ref),
            "loading": (state == lib.UCM_LOADING) & ~claims, "loader": f["loader"]}


def _rank_facts(seg: Segment, rows: List[Dict[str, Any]], slots: Dict[str, Any],
                counters: np.ndarray) -> Dict[str, Any]:
    """The "ranks" rows of --json, and "stuck": the holds of ranks that are not alive."""
    ranks = []
    items: List[Dict[str, Any]] = []
    stuck: Dict[str, Any] = {"pins": 0, "claims": 0, "loading": 0}
    L = seg.layout
    owned = arena_owners(seg)
    for row in rows:
        r = row["rank"]
        mine = owned.get(r, [])
        spans = [L.arena_range(a) for a in mine]
        used = sum(int(slots["used"][sp.start:sp.stop].sum()) for sp in spans)
        held = {"pin": np.flatnonzero((slots["pins"] & np.uint64(1 << r)) != 0),
                "claim": np.flatnonzero(slots["claims"] & (slots["claimant"] == r)),
                "loading": np.flatnonzero(slots["loading"] & (slots["loader"] == r))}
        ranks.append(dict(row, slots_used=used, arenas=mine,
                          arena_slots=sum(len(sp) for sp in spans),
                          pins=len(held["pin"]), claims=len(held["claim"]),
                          ring=ring_counters(seg, r), counters=named(counters[r])))
        if row["alive"]:
            continue
        # A rank that is not alive holds nothing legitimately: every hold it names is stuck.
        for kind, found in held.items():
            stuck[kind + "s" if kind != "loading" else kind] += len(found)
            items.extend({"slot": int(s), "kind": kind, "rank": r} for s in found[:STUCK_ITEMS])
    order = {"pin": 0, "claim": 1, "loading": 2}
    items.sort(key=lambda d: (d["slot"], order[d["kind"]]))
    stuck["items"] = items[:STUCK_ITEMS]
    return {"ranks": ranks, "stuck": stuck}


def _header_facts(seg: Segment) -> Dict[str, int]:
    L, h = seg.layout, seg.header()
    return {"layout_version": h["version"], "creator_pid": h["creator_pid"],
            "creator_uid": h["creator_uid"], "max_ranks": L.max_ranks,
            "slots_per_rank": L.slots_per_rank, "slot_size": L.slot_size,
            "n_buckets": L.n_buckets, "n_stripes": L.n_stripes, "total_size": L.total_size,
            "control_bytes": L.control_bytes, "data_bytes": L.data_bytes}


def inspect_facts(uuid: str, seg: Segment) -> Dict[str, Any]:
    """Everything `inspect` shows, as the documented --json object."""
    n = seg.layout.n_slots
    rep = verify_segment(seg)
    summ = summary(seg)
    slots = _slot_facts(seg, summ["generation"])
    counters = rank_counters(seg)
    held = _rank_facts(seg, summ["ranks"], slots, counters)
    chains = rep.facts["chains"]
    return {
        "schema": JSON_SCHEMA,
        "uuid": uuid,
        "path": shm_path(uuid),
        "status": status_word(bool(summ["live"]), any(r["dead"] for r in summ["ranks"])),
        "header": _header_facts(seg),
        "generation": summ["generation"],
        "entries": summ["entries"],
        "size_bytes": summ["size_bytes"],
        "slots": n,
        "occupancy": {"entries": summ["entries"], "slots": n, "fraction": summ["entries"] / n},
        "slot_states": slots["states"],
        "chains": {"buckets": chains["buckets"], "nonempty": chains["nonempty"],
                   "mean": chains["mean"], "p99": chains["p99"], "max": chains["max"],
                   "target_mean": CHAIN_TARGET,
                   "histogram": [[int(k), int(v)] for k, v in sorted(chains["histogram"].items())
                                 if v]},
        "ranks": held["ranks"],
        "arenas": {"count": seg.layout.n_arenas, "slots_each": seg.layout.arena_slots,
                   "free": rep.facts["arenas"]["free"]},
        "totals": named(counters.sum(axis=0)),
        "stuck": held["stuck"],
        "problems": list(rep.problems),
        "ok": rep.ok,
    }


# ------------------------------------------------------------------------- ls

def segment_names() -> List[str]:
    """Every /dev/shm name with the ucmcache prefix, sorted."""
    try:
        return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(PREFIX))
    except FileNotFoundError:
        return []


def _made_row(uuid: str, row: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """Fill an ls row of a made segment from its summary; None if it vanished meanwhile."""
    try:
        seg = Segment.attach(uuid, timeout=0, writable=False)
    except SegmentNotFound:
        return None
    except (UcmError, OSError, TimeoutError) as e:
        row.update(status="corrupt", error=str(e))
        return row
    try:
        s = summary(seg)
        slots = seg.layout.n_slots
    finally:
        seg.detach()
    live = [r for r in s["ranks"] if r["alive"]]
    row.update(status=status_word(bool(live), any(r["dead"] for r in s["ranks"])),
               live_ranks=[r["rank"] for r in live],
               dead_ranks=[r["rank"] for r in s["ranks"] if r["dead"]],
               live_pids=[r["pid"] for r in live], generation=s["generation"],
               entries=s["entries"], slots=slots, occupancy=s["entries"] / slots)
    return row


def ls_row(name: str) -> Optional[Dict[str, Any]]:
    """One `ls` row for the /dev/shm name; None if it vanished meanwhile."""
    uuid = name[len(PREFIX):]
    row: Dict[str, Any] = {"uuid": uuid, "path": os.path.join(SHM_DIR, name), "status": None,
                           "size": None, "uid": None, "layout_version": None, "params": None,
                           "live_ranks": None, "dead_ranks": None, "live_pids": None,
                           "generation": None, "entries": None, "slots": None,
                           "occupancy": None, "error": None}
    try:
        st = os.lstat(row["path"])
    except FileNotFoundError:
        return None
    row["uid"] = st.st_uid
    if not stat.S_ISREG(st.st_mode):
        # Anyone can mkdir /dev/shm/ucmcache-x: it is shown, never opened, never collected.
        row.update(status="foreign", error=f"{file_kind(st.st_mode)}, not a shared-memory "
                                           "file: not a ucmcache segment")
        return row
    try:
        check_uuid(uuid)
    except ValueError:
        row.update(status="foreign", size=st.st_size, error="the name is not a ucmcache uuid")
        return row
    try:
        info = probe(uuid)
    except SegmentNotFound:
        return None
    except (UcmError, OSError) as e:
        row.update(status="foreign", error=str(e))
        return row
    h = info["header"]
    # A header is read as ours only as far as it proved to be: its version word once the
    # magic is ucmcache's, its params once attach's checks passed ("made").  A garbage file's,
    # another layout's or a half-written header's words are not sizes to show.
    ours = h.get("magic") == lib.UCM_MAGIC
    row.update(size=info["size"], uid=info["uid"],
               layout_version=h.get("version") if ours else None, error=info.get("error"))
    if info["status"] == "made":
        row["params"] = {k: h[k] for k in ("max_ranks", "slots_per_rank", "slot_size",
                                           "n_buckets", "n_stripes")}
    if info["uid"] != os.getuid():
        row.update(status="foreign", error=f"belongs to uid {info['uid']}")
        return row
    if info["status"] != "made":
        row["status"] = info["status"]
        return row
    return _made_row(uuid, row)


def live_pids(uuid: str) -> Dict[int, int]:
    """rank -> pid for the live ranks, if the segment can be read (else empty)."""
    try:
        seg = Segment.attach(uuid, timeout=0, writable=False)
    except Exception:
        return {}
    try:
        return {r["rank"]: r["pid"] for r in rank_rows(seg) if r["alive"]}
    finally:
        seg.detach()
