"""The ``ucmcache`` command: see inside a live segment from the shell, and operate it.

Commands (``ucmcache COMMAND --help`` for each)::

    ls [--json]                      every /dev/shm/ucmcache-* segment with a status word
    inspect UUID [--json]            header, ranks, slot states, chains, stats, stuck items
    watch UUID [--interval S]        rates (gets/s, hit %, loads/s, evictions/s), refreshed
    verify UUID                      the invariant checker (ucmcache.verify)
    recover UUID                     recover dead ranks now and say what was reclaimed
    rm UUID [--force]                unlink; refused while a live rank is attached
    gc [--prefix P] [--dry-run]      unlink orphan and half-made segments
    create UUID --slots-per-rank N --slot-size B [--max-ranks R]
    demo [ARGS...]                   ucmcache.demo:main(ARGS)
    bench [ARGS...]                  bench/run.py ARGS (next to the package, in a source tree)

The CLI only reads a segment (``inspect``, ``watch``, ``verify``, ``ls`` map it read-only and
take no rank), except ``recover`` (which writes exactly what recovery writes, without taking a
rank), ``create`` and ``rm``/``gc``.  A live segment changes while it is read, so one report is
not an atomic snapshot; ``verify`` is exact only on a quiescent segment.

Status words (``ls``, ``inspect``)
----------------------------------
live          made, and at least one rank's process is alive
orphan        made, no rank's process is alive, and some rank died attached; gc removes it
idle          made, no rank attached, none died (pre-created, or every worker closed
              cleanly); gc keeps it unless --idle
making        its creator is still initialising it
half-made     its creator died before finishing it; gc removes it
incompatible  a ucmcache segment of another layout version
corrupt       the header is not what any ucmcache writes (or not a ucmcache segment at all)
foreign       another user's segment, a name that is not a ucmcache uuid, or an entry that is
              not a file (a directory, symlink, FIFO...); gc never removes one

Exit codes
----------
0  done (for ``inspect``: the segment was shown, whatever it holds; use ``verify`` to judge)
1  a problem was found: ``verify`` found broken invariants; the segment is half-made,
   incompatible or corrupt; ``rm`` refused (live ranks); ``recover`` left problems behind;
   ``create`` found too little room in /dev/shm
2  usage or bad input: a malformed uuid, no such segment, not a ucmcache segment, another
   user's segment, unreadable, bad ``create`` params or a uuid that exists; one line on stderr

``inspect --json`` (schema 1)
-----------------------------
Stable: within schema 1 keys are only ever added, never renamed or removed; consumers must
ignore keys they do not know.  Counter names come from the C core (``UCM_ST_*``) and may grow.

    {
      "schema": 1,
      "uuid": str, "path": str,
      "status": "live" | "orphan" | "idle",
      "header": {"layout_version": int, "creator_pid": int, "creator_uid": int,
                 "max_ranks": int, "slots_per_rank": int, "slot_size": int,
                 "n_buckets": int, "n_stripes": int, "total_size": int,
                 "control_bytes": int, "data_bytes": int},
      "generation": int,            # clear() advances it
      "entries": int,               # Ready entries of the current generation (exact accounting)
      "size_bytes": int,            # their payload bytes (exact accounting)
      "slots": int,                 # max_ranks * slots_per_rank
      "occupancy": {"entries": int, "slots": int, "fraction": float},   # entries / slots
      "slot_states": {              # from the slots' own words; the first four sum to "slots"
          "empty": int, "loading": int, "ready": int, "failed": int,
          "stale": int,             # Ready but of an older generation or unlinked (invisible)
          "pinned": int,            # slots with at least one pin
          "claimed": int},          # slots claimed by a writer
      "chains": {"buckets": int, "nonempty": int, "mean": float, "p99": float, "max": int,
                 "target_mean": 2,  # DESIGN 2: buckets are sized for a mean chain <= 2
                 "histogram": [[length, buckets], ...]},   # ascending length, counts > 0
      "ranks": [                    # one row per rank, 0 .. max_ranks-1
          {"rank": int, "state": "free" | "initializing" | "ready" | "stopped",
           "pid": int,              # 0 when free
           "alive": bool,           # its life lock is held: the process lives
           "dead": bool,            # not free and not alive: needs recovery
           "slots_used": int,       # slots of its range holding a current entry or a load
           "pins": int,             # slots it pins now
           "claims": int,           # slots it has claimed now
           "ring": {"depth": int, "posted": int, "dropped": int,     # its prefetch ring
                    "already_present": int},
           "counters": {name: int, ...}}],   # gets, hits, misses, loads_started, t2_hits, ...
      "totals": {name: int, ...},   # counters summed over ranks
      "stuck": {"pins": int, "claims": int, "loading": int,   # holds of ranks that are dead
                "items": [{"slot": int, "kind": "pin" | "claim" | "loading", "rank": int},
                          ...]},    # the first 100
      "problems": [str, ...],       # ucmcache.verify's list
      "ok": bool                    # problems is empty
    }

``ls --json`` gives a list of objects: ``uuid``, ``path``, ``status``, ``size`` (file bytes),
``uid``, ``layout_version``, ``params`` ({max_ranks, slots_per_rank, slot_size, n_buckets,
n_stripes} or null when unknown), ``live_ranks``, ``dead_ranks``, ``live_pids`` (lists),
``generation``, ``entries``, ``slots``, ``occupancy`` (entries / slots) (null unless made) and
``error`` (str or null).
"""
from __future__ import annotations

import argparse
import json
import os
import stat
import subprocess
import sys
import textwrap
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence

WIDTH = 100                 # the human output fits this many columns
CHAIN_TARGET = 2            # DESIGN 2: n_buckets is sized so the mean chain is at most 2
STUCK_ITEMS = 100           # stuck items listed in --json (counts are always complete)
SHOWN_LINES = 20            # stuck items / problems listed in the human form
JSON_SCHEMA = 1


class CliError(Exception):
    """Stops a command with one line on stderr and an exit code."""

    def __init__(self, message: str, code: int = 2):
        super().__init__(message)
        self.code = code


# ------------------------------------------------------------------------- formatting helpers

def _bytes(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        n /= 1024.0
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}"
    raise AssertionError  # pragma: no cover


def _num(n: float, width: int) -> str:
    """n right-aligned in width columns, with a k/M/G/T suffix when the digits do not fit."""
    s = f"{n:,}" if isinstance(n, int) else f"{n:,.1f}"
    if len(s) <= width:
        return s.rjust(width)
    for unit, scale in (("k", 1e3), ("M", 1e6), ("G", 1e9), ("T", 1e12), ("P", 1e15)):
        s = f"{n / scale:.1f}{unit}"
        if len(s) <= width:
            return s.rjust(width)
    return f"{n:.2g}"[:width].rjust(width)


def _wrap(text: str, indent: str = "  ") -> List[str]:
    return textwrap.wrap(text, WIDTH, initial_indent=indent, subsequent_indent=indent + "  ",
                         break_long_words=True, break_on_hyphens=False) or [indent]


def _fit(line: str) -> List[str]:
    """The 100-column promise, kept even for extreme params: a line that would not fit is
    wrapped at its own indentation (tables are laid out to fit; this is the safety net)."""
    if len(line) <= WIDTH:
        return [line]
    indent = line[:len(line) - len(line.lstrip())]
    return _wrap(line.strip(), indent)


def _out(lines: Sequence[str]) -> None:
    sys.stdout.write("".join(part + "\n" for line in lines for part in _fit(line)))
    sys.stdout.flush()


# ------------------------------------------------------------------------- opening segments

def _check_uuid(uuid: str) -> str:
    from ._segment import check_uuid
    try:
        return check_uuid(uuid)
    except ValueError as e:
        raise CliError(str(e)) from None


def _probe(uuid: str) -> Dict[str, Any]:
    """probe() with the CLI's errors: missing, unreadable and foreign are bad input (2)."""
    from . import UcmError
    from ._segment import probe
    _check_uuid(uuid)
    try:
        info = probe(uuid)
    except UcmError as e:               # SegmentNotFound, ForeignSegment (cannot open)
        raise CliError(str(e)) from None
    except OSError as e:
        raise CliError(f"segment {uuid!r} cannot be read: {e}") from None
    if info["uid"] != os.getuid():
        raise CliError(f"segment {uuid!r} belongs to uid {info['uid']}, not to us "
                       f"(uid {os.getuid()}); refusing to touch it")
    return info


def _refuse_unmade(uuid: str, info: Dict[str, Any]) -> None:
    """Turn a probe status other than made/making into the CLI's error."""
    from ._core import lib
    status = info["status"]
    header = info["header"]
    if status == "half-made":
        pid = header.get("creator_pid", 0)
        who = f" (pid {pid})" if pid else ""
        raise CliError(f"segment {uuid!r} is half-made: its creator{who} died before finishing "
                       f"it; `ucmcache rm {uuid}` or `ucmcache gc` removes it", 1)
    if status == "incompatible":
        raise CliError(f"segment {uuid!r} has layout version {header.get('version')}, this "
                       f"ucmcache reads version {lib.UCM_LAYOUT_VERSION}", 1)
    if status == "corrupt":
        if header.get("magic", 0) not in (0, lib.UCM_MAGIC):
            raise CliError(f"segment {uuid!r} is not a ucmcache segment (magic "
                           f"{header['magic']:#x}, expected {lib.UCM_MAGIC:#x})")
        raise CliError(f"segment {uuid!r} is corrupt: {info.get('error', 'bad header')}", 1)


@contextmanager
def _attached(uuid: str, *, writable: bool = False, timeout: float = 2.0) -> Iterator[Any]:
    """A mapped, validated segment (no rank taken), detached afterwards."""
    from . import UcmError
    from ._errors import CorruptSegment, IncompatibleSegment
    from ._segment import Segment
    info = _probe(uuid)
    _refuse_unmade(uuid, info)
    try:
        seg = Segment.attach(uuid, timeout=timeout, writable=writable)
    except (IncompatibleSegment, CorruptSegment) as e:   # includes HalfMadeSegment
        raise CliError(str(e), 1) from None
    except TimeoutError as e:
        raise CliError(str(e), 1) from None
    except UcmError as e:
        raise CliError(str(e)) from None
    except OSError as e:
        raise CliError(f"segment {uuid!r} cannot be mapped: {e}") from None
    try:
        yield seg
    finally:
        seg.detach()


@contextmanager
def _context(seg) -> Iterator[Any]:
    """A process-local C context on a segment, with no rank (as SlotCache.__init__ builds one)."""
    from ._core import ffi, lib
    ctx = lib.ucm_ctx_new(seg.base, seg.layout.total_size, seg.layout.to_c())
    if ctx == ffi.NULL:
        raise MemoryError("could not allocate a cache context")
    try:
        yield ctx
    finally:
        lib.ucm_ctx_free(ctx)


# ------------------------------------------------------------------------- facts

def _rank_liveness(seg) -> List[Dict[str, Any]]:
    from ._recovery import rank_alive, rank_pid, rank_state
    from ._stats import RANK_STATES
    from ._core import lib
    rows = []
    for r in range(seg.layout.max_ranks):
        state = rank_state(seg, r)
        alive = rank_alive(seg, r)
        rows.append({"rank": r, "state": RANK_STATES.get(state, f"unknown({state})"),
                     "pid": rank_pid(seg, r), "alive": alive,
                     "dead": state != lib.UCM_RANK_FREE and not alive})
    return rows


def _summary(seg) -> Dict[str, Any]:
    """The cheap facts (no slot scan): generation, exact entries/bytes, ranks."""
    from ._core import lib
    with _context(seg) as ctx:
        generation = int(lib.ucm_generation(ctx))
        entries = int(lib.ucm_acc_value(ctx, lib.UCM_R_ACC_ENTRIES))
        size_bytes = int(lib.ucm_acc_value(ctx, lib.UCM_R_ACC_BYTES))
    ranks = _rank_liveness(seg)
    return {"generation": generation, "entries": entries, "size_bytes": size_bytes,
            "ranks": ranks, "live": any(r["alive"] for r in ranks)}


def inspect_facts(uuid: str, seg) -> Dict[str, Any]:
    """Everything `inspect` shows, as the documented --json object."""
    import numpy as np
    from ._core import lib
    from ._ring import ring_counters
    from ._stats import COUNTER_NAMES, COUNTERS, rank_counters
    from ._verify import slot_fields, snapshot, verify_segment

    L = seg.layout
    rep = verify_segment(seg)
    summ = _summary(seg)
    f = slot_fields(snapshot(seg)["metas"])
    counters = rank_counters(seg)
    g32 = summ["generation"] & 0xFFFFFFFF

    state, ref = f["state"], f["reference"]
    linked = f["bucket"] != lib.UCM_INVALID_BUCKET
    claimed = (ref & np.uint64(lib.UCM_CLAIMED)) != 0
    pins = np.where(claimed, np.uint64(0), ref)
    ready = state == lib.UCM_READY
    current = ready & linked & (f["generation"] == g32)
    used = current | (state == lib.UCM_LOADING)
    loading_free = (state == lib.UCM_LOADING) & ~claimed

    ranks = []
    stuck_items: List[Dict[str, int]] = []
    stuck = {"pins": 0, "claims": 0, "loading": 0}
    spr = L.slots_per_rank
    for row in summ["ranks"]:
        r = row["rank"]
        bit = np.uint64(1 << r)
        pinned_by = np.flatnonzero((pins & bit) != 0)
        claimed_by = np.flatnonzero(claimed & ((ref & np.uint64(0xFF)) == r))
        loading_by = np.flatnonzero(loading_free & (f["loader"] == r))
        ranks.append(dict(row, slots_used=int(used[r * spr:(r + 1) * spr].sum()),
                          pins=len(pinned_by), claims=len(claimed_by),
                          ring=ring_counters(seg, r),
                          counters={name: int(counters[r, COUNTERS[name]])
                                    for name in COUNTER_NAMES}))
        if row["alive"]:
            continue
        # A rank that is not alive holds nothing legitimately: every hold it names is stuck.
        for kind, slots in (("pin", pinned_by), ("claim", claimed_by), ("loading", loading_by)):
            stuck[kind + "s" if kind != "loading" else kind] += len(slots)
            for s in slots[:STUCK_ITEMS]:
                stuck_items.append({"slot": int(s), "kind": kind, "rank": r})
    order = {"pin": 0, "claim": 1, "loading": 2}
    stuck_items.sort(key=lambda d: (d["slot"], order[d["kind"]]))
    stuck["items"] = stuck_items[:STUCK_ITEMS]

    chains = rep.facts["chains"]
    states = {name: int((state == v).sum()) for v, name in
              ((lib.UCM_EMPTY, "empty"), (lib.UCM_LOADING, "loading"), (lib.UCM_READY, "ready"),
               (lib.UCM_FAILED, "failed"))}
    states.update(stale=int((ready & ~(linked & (f["generation"] == g32))).sum()),
                  pinned=int((pins != 0).sum()), claimed=int(claimed.sum()))
    h = seg.header()
    return {
        "schema": JSON_SCHEMA,
        "uuid": uuid,
        "path": _shm_path(uuid),
        "status": _status(bool(summ["live"]), any(r["dead"] for r in summ["ranks"])),
        "header": {"layout_version": h["version"], "creator_pid": h["creator_pid"],
                   "creator_uid": h["creator_uid"], "max_ranks": L.max_ranks,
                   "slots_per_rank": L.slots_per_rank, "slot_size": L.slot_size,
                   "n_buckets": L.n_buckets, "n_stripes": L.n_stripes,
                   "total_size": L.total_size, "control_bytes": L.control_bytes,
                   "data_bytes": L.data_bytes},
        "generation": summ["generation"],
        "entries": summ["entries"],
        "size_bytes": summ["size_bytes"],
        "slots": L.n_slots,
        "occupancy": {"entries": summ["entries"], "slots": L.n_slots,
                      "fraction": summ["entries"] / L.n_slots},
        "slot_states": states,
        "chains": {"buckets": chains["buckets"], "nonempty": chains["nonempty"],
                   "mean": chains["mean"], "p99": chains["p99"], "max": chains["max"],
                   "target_mean": CHAIN_TARGET,
                   "histogram": [[int(k), int(v)] for k, v in sorted(chains["histogram"].items())
                                 if v]},
        "ranks": ranks,
        "totals": {name: int(counters[:, COUNTERS[name]].sum()) for name in COUNTER_NAMES},
        "stuck": stuck,
        "problems": list(rep.problems),
        "ok": rep.ok,
    }


def _shm_path(uuid: str) -> str:
    from ._segment import shm_path
    return shm_path(uuid)


# ------------------------------------------------------------------------- ls

def _names() -> List[str]:
    from ._segment import PREFIX, SHM_DIR
    try:
        return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(PREFIX))
    except FileNotFoundError:
        return []


def ls_row(name: str) -> Optional[Dict[str, Any]]:
    """One `ls` row for the /dev/shm name; None if it vanished meanwhile."""
    from . import UcmError
    from ._errors import SegmentNotFound
    from ._segment import PREFIX, SHM_DIR, Segment, check_uuid, file_kind, probe
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
    row.update(size=info["size"], uid=info["uid"], layout_version=h.get("version"),
               error=info.get("error"))
    if h.get("max_ranks"):
        row["params"] = {k: h[k] for k in ("max_ranks", "slots_per_rank", "slot_size",
                                           "n_buckets", "n_stripes")}
    if info["uid"] != os.getuid():
        row.update(status="foreign", error=f"belongs to uid {info['uid']}")
        return row
    if info["status"] != "made":
        row["status"] = info["status"]
        return row
    try:
        seg = Segment.attach(uuid, timeout=0, writable=False)
    except SegmentNotFound:
        return None
    except (UcmError, OSError, TimeoutError) as e:
        row.update(status="corrupt", error=str(e))
        return row
    try:
        s = _summary(seg)
        slots = seg.layout.n_slots
    finally:
        seg.detach()
    live = [r for r in s["ranks"] if r["alive"]]
    row.update(status=_status(bool(live), any(r["dead"] for r in s["ranks"])),
               live_ranks=[r["rank"] for r in live],
               dead_ranks=[r["rank"] for r in s["ranks"] if r["dead"]],
               live_pids=[r["pid"] for r in live], generation=s["generation"],
               entries=s["entries"], slots=slots, occupancy=s["entries"] / slots)
    return row


def _ls_lines(rows: List[Dict[str, Any]]) -> List[str]:
    head = (f"{'UUID':<24} {'STATUS':<12} {'SIZE':>10} {'LIVE':>4} {'DEAD':>4} "
            f"{'RANKS':>5} {'SLOTS/RANK':>10} {'SLOT SIZE':>10} {'GEN':>5} {'OCC':>6}")
    lines = [head]
    for r in rows:
        p = r["params"] or {}
        dash = "-"
        cells = (f"{r['status']:<12} {_bytes(r['size']) if r['size'] is not None else dash:>10} "
                 f"{len(r['live_ranks']) if r['live_ranks'] is not None else dash:>4} "
                 f"{len(r['dead_ranks']) if r['dead_ranks'] is not None else dash:>4} "
                 f"{p.get('max_ranks', dash):>5} "
                 f"{_num(p['slots_per_rank'], 10) if 'slots_per_rank' in p else dash:>10} "
                 f"{_bytes(p['slot_size']) if 'slot_size' in p else dash:>10} "
                 f"{_num(r['generation'], 5) if r['generation'] is not None else dash:>5} "
                 f"{format(r['occupancy'], '.1%') if r['occupancy'] is not None else dash:>6}")
        if len(r["uuid"]) <= 24:
            lines.append(f"{r['uuid']:<24} {cells}")
        else:                       # a long uuid gets its own line; it is never cut
            lines.append(r["uuid"])
            lines.append(f"{'':<24} {cells}")
        if r["error"]:
            lines.extend(_wrap(r["error"], " " * 4))
    if not rows:
        return ["(no ucmcache segments in /dev/shm)"]
    return lines


def cmd_ls(args) -> int:
    rows = [r for r in (ls_row(n) for n in _names()) if r is not None]
    if args.json:
        print(json.dumps(rows, indent=2, sort_keys=True))
    else:
        _out(_ls_lines(rows))
    return 0


# ------------------------------------------------------------------------- inspect

def _inspect_lines(d: Dict[str, Any]) -> List[str]:
    h = d["header"]
    out = [f"segment {d['uuid']}  status {d['status']}",
           f"  path {d['path']}",
           f"  layout v{h['layout_version']}  creator pid {h['creator_pid']} uid "
           f"{h['creator_uid']}  size {_bytes(h['total_size'])} (data {_bytes(h['data_bytes'])}"
           f", control {_bytes(h['control_bytes'])})",
           f"  params  max_ranks {h['max_ranks']}  slots_per_rank {h['slots_per_rank']}  "
           f"slot_size {h['slot_size']}  n_buckets {h['n_buckets']}  n_stripes {h['n_stripes']}",
           f"  generation {d['generation']}  entries {d['entries']}  size_bytes "
           f"{d['size_bytes']} ({_bytes(d['size_bytes'])})",
           ""]
    st = d["slot_states"]
    occ = d["occupancy"]
    out += [f"slots  {d['slots']} total, current entries {occ['entries']} "
            f"(occupancy {occ['fraction']:.1%})",
            f"  empty {st['empty']}  loading {st['loading']}  ready {st['ready']}  failed "
            f"{st['failed']}  |  pinned {st['pinned']}  claimed {st['claimed']}  stale "
            f"{st['stale']}",
            ""]
    c = d["chains"]
    verdict = "ok" if c["mean"] <= c["target_mean"] else "ABOVE TARGET"
    out += [f"chains  {c['buckets']} buckets, {c['nonempty']} non-empty  mean {c['mean']:.2f}  "
            f"p99 {c['p99']:.2f}  max {c['max']}  (target mean <= {c['target_mean']}: {verdict})"]
    hist = [(k, v) for k, v in c["histogram"] if k > 0]
    if hist:
        shown = hist[:11]
        rest = sum(v for _, v in hist[11:])
        top = max(v for _, v in shown)
        out.append(f"  {'length':>8} {'buckets':>12}")
        for k, v in shown:
            bar = "#" * max(1, round(50 * v / top))
            out.append(f"  {k:>8} {_num(v, 12)} {bar}")
        if rest:
            out.append(f"  {'>' + str(hist[10][0]):>8} {_num(rest, 12)}")
    out.append("")

    live = sum(r["alive"] for r in d["ranks"])
    dead = sum(r["dead"] for r in d["ranks"])
    out.append(f"ranks  {live} live, {dead} dead, {len(d['ranks']) - live - dead} free of "
               f"{len(d['ranks'])}")
    out.append(f"  {'rank':>4} {'state':<12} {'pid':>7} {'alive':<5} {'used':>7} {'pins':>6} "
               f"{'claims':>6} {'gets':>8} {'hits':>8} {'misses':>8} {'loads':>7} {'fails':>6}")
    hidden = 0
    for r in d["ranks"]:
        cnt = r["counters"]
        if r["state"] == "free" and not r["alive"] and not r["slots_used"] and not r["pins"] \
                and not r["claims"] and not any(cnt.values()):
            hidden += 1
            continue
        alive = "yes" if r["alive"] else ("DEAD" if r["dead"] else "no")
        out.append(f"  {r['rank']:>4} {r['state']:<12} {r['pid']:>7} {alive:<5} "
                   f"{_num(r['slots_used'], 7)} {_num(r['pins'], 6)} {_num(r['claims'], 6)} "
                   f"{_num(cnt.get('gets', 0), 8)} {_num(cnt.get('hits', 0), 8)} "
                   f"{_num(cnt.get('misses', 0), 8)} {_num(cnt.get('loads_started', 0), 7)} "
                   f"{_num(cnt.get('loads_failed', 0), 6)}")
    if hidden:
        out.append(f"  ({hidden} free rank(s) never used not shown)")
    t = d["totals"]
    gets = t.get("gets", 0)
    hit = f"{t.get('hits', 0) / gets:.1%}" if gets else "-"
    out.append(f"  totals: gets {t.get('gets', 0)}  hit {hit}  joins {t.get('joins', 0)}  loads "
               f"{t.get('loads_started', 0)}  fails {t.get('loads_failed', 0)}  evictions "
               f"{t.get('evictions', 0)}  bypasses {t.get('bypasses', 0)}  clears "
               f"{t.get('clears', 0)}")
    rings = [r for r in d["ranks"] if any(r.get("ring", {}).values())]
    if rings or t.get("prefetched", 0):
        out.append(f"  prefetch: prefetched {t.get('prefetched', 0)}  skipped "
                   f"{t.get('prefetch_skipped', 0)};  rings (rank: depth / posted / dropped / "
                   "already present):")
        out.extend(_wrap("  ".join(f"{r['rank']}: {r['ring']['depth']} / {r['ring']['posted']} / "
                                   f"{r['ring']['dropped']} / {r['ring']['already_present']}"
                                   for r in rings), "    "))
    if any(t.get(k, 0) for k in ("t2_hits", "t2_misses", "t2_writes", "t2_bypasses")):
        out.append(f"  tier 2: hits {t.get('t2_hits', 0)}  misses {t.get('t2_misses', 0)}  "
                   f"write-throughs {t.get('t2_writes', 0)}  bypasses {t.get('t2_bypasses', 0)}  "
                   f"lease waits {t.get('t2_lease_waits', 0)}  bad values "
                   f"{t.get('t2_bad_values', 0)}")
    out.append("")

    s = d["stuck"]
    n_stuck = s["pins"] + s["claims"] + s["loading"]
    if n_stuck:
        out.extend(_wrap(f"stuck  {s['pins']} pin(s), {s['claims']} claim(s), {s['loading']} "
                         f"Loading slot(s) held by dead ranks; `ucmcache recover {d['uuid']}` "
                         "reclaims them", ""))
        pid = {r["rank"]: r["pid"] for r in d["ranks"]}
        what = {"pin": "pinned by", "claim": "claimed by", "loading": "Loading, loader"}
        for it in s["items"][:SHOWN_LINES]:
            out.append(f"  slot {it['slot']}: {what[it['kind']]} dead rank {it['rank']} "
                       f"(pid {pid[it['rank']]})")
        if n_stuck > SHOWN_LINES:
            out.append(f"  ... {n_stuck - SHOWN_LINES} more")
    else:
        out.append("stuck  none")
    if d["problems"]:
        out.append(f"problems  {len(d['problems'])} (from verify)")
        for p in d["problems"][:SHOWN_LINES]:
            out.extend(_wrap(p))
        if len(d["problems"]) > SHOWN_LINES:
            out.append(f"  ... {len(d['problems']) - SHOWN_LINES} more")
    else:
        out.append("problems  none: all invariants hold")
    return out


def cmd_inspect(args) -> int:
    with _attached(args.uuid, timeout=args.timeout) as seg:
        d = inspect_facts(args.uuid, seg)
    if args.json:
        print(json.dumps(d, indent=2, sort_keys=True))
    else:
        _out(_inspect_lines(d))
    return 0


# ------------------------------------------------------------------------- watch

_RATES = (("gets/s", "gets"), ("loads/s", "loads_started"), ("evictions/s", "evictions"),
          ("fails/s", "loads_failed"), ("waits/s", "waits"))


def _watch_frame(uuid, seg, prev, now, frame, interval) -> List[str]:
    from ._stats import COUNTERS, rank_counters
    s = _summary(seg)
    snap = rank_counters(seg)
    live = sum(r["alive"] for r in s["ranks"])
    dead = sum(r["dead"] for r in s["ranks"])
    slots = seg.layout.n_slots
    lines = [f"ucmcache watch {uuid}"[:WIDTH],
             f"  every {interval:g} s  frame {frame}  {time.strftime('%H:%M:%S')}  "
             "(Ctrl-C stops)",
             f"  ranks {live} live / {dead} dead / {seg.layout.max_ranks}   generation "
             f"{s['generation']}",
             f"  entries {s['entries']} of {slots} ({s['entries'] / slots:.1%})   size "
             f"{_bytes(s['size_bytes'])}",
             "",
             f"  {'':<8} " + " ".join(f"{name:>11}" for name, _ in _RATES[:1]) +
             f" {'hit %':>7} " + " ".join(f"{name:>11}" for name, _ in _RATES[1:])]
    if prev is None:
        lines.append("  (rates appear from the next frame)")
        return lines
    psnap, ptime = prev
    dt = max(now - ptime, 1e-9)
    delta = (snap.astype("int64") - psnap.astype("int64")).clip(min=0)

    def row(label, d):
        gets = int(d[COUNTERS["gets"]])
        hits = int(d[COUNTERS["hits"]])
        hit = f"{hits / gets:.1%}" if gets else "-"
        rates = [int(d[COUNTERS[c]]) / dt for _, c in _RATES]
        return (f"  {label:<8} {_num(rates[0], 11)} {hit:>7} " +
                " ".join(_num(x, 11) for x in rates[1:]))

    lines.append(row("total", delta.sum(axis=0)))
    for r in s["ranks"]:
        if r["state"] != "free" or delta[r["rank"]].any():
            lines.append(row(f"rank {r['rank']}", delta[r["rank"]]))
    return lines


def cmd_watch(args) -> int:
    from ._stats import rank_counters
    if args.interval <= 0:
        raise CliError(f"--interval must be > 0 seconds, got {args.interval}")
    in_place = sys.stdout.isatty()
    with _attached(args.uuid, timeout=args.timeout) as seg:
        prev = None
        frame = 0
        try:
            while True:
                frame += 1
                now = time.monotonic()
                lines = _watch_frame(args.uuid, seg, prev, now, frame, args.interval)
                if in_place:
                    sys.stdout.write("\x1b[H\x1b[2J")
                elif frame > 1:
                    lines = [""] + lines
                _out(lines)
                prev = (rank_counters(seg), now)
                if args.count and frame >= args.count:
                    break
                time.sleep(args.interval)
        except KeyboardInterrupt:
            sys.stdout.write("\n")
    return 0


# ------------------------------------------------------------------------- verify, recover

def cmd_verify(args) -> int:
    from ._verify import verify_segment
    with _attached(args.uuid, timeout=args.timeout) as seg:
        rep = verify_segment(seg)
    if rep.ok:
        f = rep.facts
        _out([f"segment {args.uuid!r}: all invariants hold",
              f"  generation {f['generation']}  entries {f['entries']}  size_bytes "
              f"{f['size_bytes']}  slots {f['slots']}  chains mean {f['chains']['mean']:.2f} "
              f"max {f['chains']['max']}"])
        return 0
    lines = [f"segment {args.uuid!r}: {len(rep.problems)} problem(s)"]
    for p in rep.problems:
        lines.extend(_wrap(p))
    _out(lines)
    return 1


def cmd_recover(args) -> int:
    from ._recovery import recover_dead_ranks
    from ._verify import verify_segment
    with _attached(args.uuid, writable=True, timeout=args.timeout) as seg:
        with _context(seg) as ctx:
            # No rank of our own: recovery needs none (every hold names its rank, I5), and
            # taking one would count an attach in the segment's stats.
            report = recover_dead_ranks(seg, ctx, None)
        after = verify_segment(seg)
    lines = []
    if not report.ranks and not report.failed:
        lines.append(f"segment {args.uuid!r}: no dead ranks to recover")
    for why in report.failed:
        lines.extend(_wrap(f"not recovered yet: {why}"))
    for r in report.ranks:
        lines.append(f"recovered rank {r.rank} (pid {r.pid}): {r.pins} pin(s) dropped, "
                     f"{r.failed_loads} Loading slot(s) failed, {r.claims} claim(s) freed")
    if report.ranks:
        t = (sum(r.pins for r in report.ranks), sum(r.failed_loads for r in report.ranks),
             sum(r.claims for r in report.ranks))
        lines.append(f"total: {len(report.ranks)} rank(s), {t[0]} pin(s), {t[1]} load(s), "
                     f"{t[2]} claim(s) reclaimed")
    if after.ok:
        lines.append("verify: all invariants hold")
        _out(lines)
        return 0
    lines.append(f"verify after recovery: {len(after.problems)} problem(s) remain")
    for p in after.problems:
        lines.extend(_wrap(p))
    _out(lines)
    return 1


# ------------------------------------------------------------------------- metrics

def cmd_metrics(args) -> int:
    if args.once == (args.port is not None):
        raise CliError("give exactly one of --once or --port P")
    with _attached(args.uuid, timeout=args.timeout):
        pass  # a missing, half-made or foreign segment: its one-line error, here
    try:
        from . import metrics
    except ImportError as e:
        raise CliError(str(e)) from None
    if args.once:
        sys.stdout.write(metrics.render(args.uuid, timeout=args.timeout))
        return 0
    server, thread = metrics.serve(args.uuid, args.port, args.addr, timeout=args.timeout)
    _out([f"serving http://{args.addr}:{args.port}/metrics for segment {args.uuid!r} "
          "(Ctrl-C stops)"])
    try:
        thread.join()
    finally:
        server.shutdown()
    return 0


# ------------------------------------------------------------------------- rm, gc

@contextmanager
def _held_for_removal(uuid: str) -> Iterator[Dict[str, Any]]:
    """_segment.held_for_removal, its errors as one line for the CLI."""
    from . import UcmError
    from ._segment import held_for_removal
    try:
        cm = held_for_removal(uuid)
        held = cm.__enter__()
    except UcmError as e:
        raise CliError(str(e)) from None
    try:
        yield held
    finally:
        cm.__exit__(None, None, None)


def _unlink_if_same(uuid: str, fd: int) -> bool:
    from ._segment import unlink_if_same
    return unlink_if_same(uuid, fd)


def _live_pids(uuid: str) -> Dict[int, int]:
    """rank -> pid for the live ranks, if the segment can be read (else empty)."""
    from ._segment import Segment
    try:
        seg = Segment.attach(uuid, timeout=0, writable=False)
    except Exception:
        return {}
    try:
        return {r["rank"]: r["pid"] for r in _rank_liveness(seg) if r["alive"]}
    finally:
        seg.detach()


def cmd_rm(args) -> int:
    from . import SegmentNotFound
    from ._segment import Segment
    _check_uuid(args.uuid)
    if args.force:
        _probe(args.uuid)          # exists, ours
        try:
            Segment.unlink(args.uuid)
        except SegmentNotFound as e:
            raise CliError(str(e)) from None
        _out([f"removed {args.uuid} (forced)"])
        return 0
    pids = _live_pids(args.uuid)
    with _held_for_removal(args.uuid) as held:
        if held["busy_ranks"]:
            who = ", ".join(f"{r} (pid {pids[r]})" if r in pids else str(r)
                            for r in held["busy_ranks"])
            raise CliError(f"segment {args.uuid!r} has live rank(s) {who}: not removed; stop "
                           "them first or use --force (attached processes keep their mapping)", 1)
        if held["creator_busy"]:
            raise CliError(f"segment {args.uuid!r} is being created right now: not removed", 1)
        if not _unlink_if_same(args.uuid, held["fd"]):
            raise CliError(f"segment {args.uuid!r} vanished or was replaced meanwhile")
    _out([f"removed {args.uuid}"])
    return 0


def _status(live: bool, dead: bool) -> str:
    if live:
        return "live"
    return "orphan" if dead else "idle"


def cmd_gc(args) -> int:
    from ._core import lib
    from ._segment import PREFIX
    lines = []
    for name in _names():
        uuid = name[len(PREFIX):]
        if args.prefix and not uuid.startswith(args.prefix):
            continue
        row = ls_row(name)
        collect = ("orphan", "half-made", "idle") if args.idle else ("orphan", "half-made")
        if row is None or row["status"] not in collect:
            continue
        if args.dry_run:
            lines.append(f"would remove {uuid} ({row['status']})")
            continue
        try:
            with _held_for_removal(uuid) as held:
                # Re-check under the locks: still no live rank, nobody creating it, and still
                # the kind of segment we judged (made for an orphan, no magic for half-made).
                magic = held["header"].get("magic", 0)
                want = 0 if row["status"] == "half-made" else lib.UCM_MAGIC
                if held["busy_ranks"] or held["creator_busy"] or magic != want:
                    lines.append(f"kept {uuid}: it came alive meanwhile")
                    continue
                if _unlink_if_same(uuid, held["fd"]):
                    lines.append(f"removed {uuid} ({row['status']})")
        except CliError:
            continue                # vanished or not ours: nothing to collect
    if not lines:
        lines.append("nothing to remove")
    _out(lines)
    return 0


# ------------------------------------------------------------------------- create

def cmd_create(args) -> int:
    from . import UcmError
    from ._errors import SharedMemoryFull
    from ._layout import Layout, LayoutError
    from ._segment import Segment
    _check_uuid(args.uuid)
    try:
        layout = Layout.compute(slots_per_rank=args.slots_per_rank, slot_size=args.slot_size,
                                max_ranks=args.max_ranks, n_buckets=args.n_buckets,
                                n_stripes=args.n_stripes)
    except (LayoutError, TypeError) as e:
        raise CliError(f"bad params: {e}") from None
    try:
        # The segment only: no rank is taken, so nothing is attached when we exit.  The mode
        # was checked by argparse (_mode_arg).
        Segment.create(args.uuid, layout, mode=args.mode).detach()
    except SharedMemoryFull as e:
        raise CliError(str(e), 1) from None
    except UcmError as e:
        raise CliError(str(e)) from None
    except OSError as e:
        raise CliError(f"cannot create segment {args.uuid!r}: {e}", 1) from None
    _out([f"created {args.uuid}: {layout.max_ranks} ranks x {layout.slots_per_rank} slots x "
          f"{layout.slot_size} B, {layout.n_buckets} buckets, {layout.n_stripes} stripes, "
          f"{_bytes(layout.total_size)} at {_shm_path(args.uuid)}"])
    return 0


# ------------------------------------------------------------------------- demo, bench

def _bench_script() -> Path:
    import ucmcache
    return Path(ucmcache.__file__).resolve().parents[1] / "bench" / "run.py"


def cmd_demo(argv: List[str]) -> int:
    import importlib
    try:
        # Imported late: the demo is written separately and may be absent from a build.
        demo = importlib.import_module("ucmcache.demo")
    except ModuleNotFoundError as e:
        if e.name == "ucmcache.demo":
            raise CliError("the demo is not available: this ucmcache has no ucmcache.demo "
                           "module") from None
        raise CliError(f"the demo cannot run: it needs the module {e.name!r}, which is not "
                       "installed") from None
    main = getattr(demo, "main", None)
    if not callable(main):
        raise CliError("the demo is not available: ucmcache.demo has no main(argv)")
    rc = main(argv)
    return 0 if rc is None else int(rc)


def cmd_bench(argv: List[str]) -> int:
    script = _bench_script()
    if not script.is_file():
        raise CliError(f"the benchmarks are not available: {script} does not exist (they ship "
                       "with the source tree, not with an installed package)")
    try:
        return subprocess.call([sys.executable, str(script), *argv])
    except KeyboardInterrupt:
        return 130


# ------------------------------------------------------------------------- argument parsing

_PASS_THROUGH = {"demo": cmd_demo, "bench": cmd_bench}


class _Parser(argparse.ArgumentParser):
    """argparse with the CLI's promise for usage errors: one line on stderr, exit code 2.
    (Subparsers are made of the same class, so theirs keep it too.)"""

    def error(self, message: str):
        _error(f"{message} (`{self.prog} --help` shows the usage)")
        raise SystemExit(2)


def _mode_arg(text: str) -> int:
    """--mode: octal permission bits, checked by the rule Segment.create applies."""
    from ._segment import MAX_MODE, check_mode
    try:
        return check_mode(int(text, 8))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be octal permission bits from 0 to {MAX_MODE:o} (like 600), "
            f"got {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="ucmcache",
        description="See inside and operate ucmcache shared-memory segments (/dev/shm).",
        epilog="exit codes: 0 ok, 1 problem found, 2 usage or bad input")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    def cmd(name, help, fn):
        sp = sub.add_parser(name, help=help, description=help)
        sp.set_defaults(fn=fn)
        return sp

    def uuid_arg(sp):
        sp.add_argument("uuid", metavar="UUID", help="the segment's uuid ([A-Za-z0-9_-]{1,64})")
        sp.add_argument("--timeout", type=float, default=2.0, metavar="S",
                        help="wait at most S seconds for a segment still being made "
                             "(default 2)")

    sp = cmd("ls", "list every ucmcache segment in /dev/shm with its status", cmd_ls)
    sp.add_argument("--json", action="store_true", help="a JSON list (see the module docs)")

    sp = cmd("inspect", "show a segment: header, ranks, slot states, chains, stats, stuck items",
             cmd_inspect)
    uuid_arg(sp)
    sp.add_argument("--json", action="store_true", help="the stable JSON form (schema 1)")

    sp = cmd("watch", "show a segment's rates (gets/s, hit %%, loads/s, evictions/s) until "
             "Ctrl-C", cmd_watch)
    uuid_arg(sp)
    sp.add_argument("--interval", type=float, default=1.0, metavar="S",
                    help="seconds between refreshes (default 1)")
    sp.add_argument("--count", type=int, default=0, metavar="N",
                    help="stop after N frames (default: until Ctrl-C)")

    sp = cmd("verify", "check every invariant; exit 1 with the list if any is broken",
             cmd_verify)
    uuid_arg(sp)

    sp = cmd("recover", "recover dead ranks now (drop their pins and claims, fail their loads)",
             cmd_recover)
    uuid_arg(sp)

    sp = cmd("rm", "unlink a segment; refused while a live rank is attached", cmd_rm)
    sp.add_argument("uuid", metavar="UUID", help="the segment's uuid")
    sp.add_argument("--force", action="store_true",
                    help="unlink even with live ranks (they keep their mapping)")

    sp = cmd("gc", "unlink orphan and half-made segments (never one with a live rank)", cmd_gc)
    sp.add_argument("--prefix", default="", metavar="P", help="only uuids starting with P")
    sp.add_argument("--dry-run", action="store_true", help="say what would go, remove nothing")
    sp.add_argument("--idle", action="store_true",
                    help="also remove idle segments (no rank attached, none died)")

    sp = cmd("create", "create a segment (no rank stays attached)", cmd_create)
    sp.add_argument("uuid", metavar="UUID", help="the new segment's uuid")
    sp.add_argument("--slots-per-rank", type=int, required=True, metavar="N")
    sp.add_argument("--slot-size", type=int, required=True, metavar="B", help="bytes per slot")
    sp.add_argument("--max-ranks", type=int, default=8, metavar="R", help="default 8")
    sp.add_argument("--n-buckets", type=int, default=None, metavar="K",
                    help="a power of two (default: sized for a mean chain <= 2)")
    sp.add_argument("--n-stripes", type=int, default=64, metavar="S", help="default 64")
    sp.add_argument("--mode", type=_mode_arg, default="600", metavar="OCTAL",
                    help="the file's permission bits, 0 to 777 (default 600)")

    sp = cmd("metrics", "serve a segment's metrics in the Prometheus text format on "
             "/metrics (or print them once)", cmd_metrics)
    uuid_arg(sp)
    sp.add_argument("--port", type=int, default=None, metavar="P",
                    help="serve http://ADDR:P/metrics until Ctrl-C")
    sp.add_argument("--addr", default="0.0.0.0", metavar="A", help="default 0.0.0.0")
    sp.add_argument("--once", action="store_true",
                    help="print one scrape and exit (node_exporter's textfile collector)")

    sub.add_parser("demo", help="run the demo (ucmcache demo --help for its options)",
                   add_help=False)
    sub.add_parser("bench", help="run the benchmarks in bench/ (ucmcache bench --help)",
                   add_help=False)
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv and argv[0] in _PASS_THROUGH:
            # Everything after the command belongs to it, --help included.
            return _PASS_THROUGH[argv[0]](argv[1:])
        args = build_parser().parse_args(argv)
        return args.fn(args)
    except CliError as e:
        _error(str(e))
        return e.code
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # `ucmcache ls | head`: the reader left; say nothing more (and keep the interpreter's
        # final flush from complaining, as the Python docs' SIGPIPE note recommends).
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        except (OSError, ValueError):
            pass
        return 0
    except Exception as e:  # the promise: one line, never a traceback
        from . import UcmError
        if isinstance(e, (UcmError, OSError, ValueError, TimeoutError)):
            _error(str(e))
            return 2
        _error(f"internal error: {type(e).__name__}: {e} (set UCMCACHE_DEBUG=1 for a traceback)")
        if os.environ.get("UCMCACHE_DEBUG"):
            raise
        return 1


def _error(message: str) -> None:
    sys.stderr.write(f"ucmcache: error: {' '.join(message.split())}\n")
    sys.stderr.flush()


if __name__ == "__main__":
    sys.exit(main())
