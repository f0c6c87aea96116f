"""Render: the ``ucmcache`` command's human forms of the facts _facts gathers.

Every line fits WIDTH columns: tables are laid out to fit, numbers too wide for their column
take a k/M/G/T suffix, and _fit wraps whatever would still not fit at its own indentation.
"""
from __future__ import annotations

import sys
import textwrap
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..core.stats import COUNTERS

WIDTH = 100                 # the human output fits this many columns
SHOWN_LINES = 20            # stuck items / problems listed in the human form
CHAIN_ROWS = 11             # chain lengths shown one per row; longer ones are summed in one
BAR = 50                    # the longest histogram bar, in '#'


# ------------------------------------------------------------------------- formatting helpers

def human_bytes(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    size = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        size /= 1024.0
        if size < 1024 or unit == "TiB":
            return f"{size:.1f} {unit}"
    raise AssertionError  # pragma: no cover


def num(n: float, width: int) -> str:
    """n right-aligned in width columns, with a k/M/G/T suffix when the digits do not fit."""
    s = f"{n:,}" if isinstance(n, int) else f"{n:,.1f}"
    if len(s) <= width:
        return s.rjust(width)
    for unit, scale in (("k", 1e3), ("M", 1e6), ("G", 1e9), ("T", 1e12), ("P", 1e15)):
        s = f"{n / scale:.1f}{unit}"
        if len(s) <= width:
            return s.rjust(width)
    return f"{n:.2g}"[:width].rjust(width)


def wrap(text: str, indent: str = "  ") -> List[str]:
    return textwrap.wrap(text, WIDTH, initial_indent=indent, subsequent_indent=indent + "  ",
                         break_long_words=True, break_on_hyphens=False) or [indent]


def _fit(line: str) -> List[str]:
    """The 100-column promise, kept even for extreme params: a line that would not fit is
    wrapped at its own indentation (tables are laid out to fit; this is the safety net)."""
    if len(line) <= WIDTH:
        return [line]
    indent = line[:len(line) - len(line.lstrip())]
    return wrap(line.strip(), indent)


def out(lines: Sequence[str]) -> None:
    sys.stdout.write("".join(part + "\n" for line in lines for part in _fit(line)))
    sys.stdout.flush()


def error(message: str) -> None:
    sys.stderr.write(f"ucmcache: error: {' '.join(message.split())}\n")
    sys.stderr.flush()


def _listed(problems: List[str], limit: Optional[int] = None) -> List[str]:
    """Problems, one wrapped item each; past `limit`, a count of the rest."""
    shown = problems if limit is None else problems[:limit]
    lines = [part for p in shown for part in wrap(p)]
    if len(problems) > len(shown):
        lines.append(f"  ... {len(problems) - len(shown)} more")
    return lines


# ------------------------------------------------------------------------- ls

def ls_lines(rows: List[Dict[str, Any]]) -> List[str]:
    if not rows:
        return ["(no ucmcache segments in /dev/shm)"]
    lines = [f"{'UUID':<24} {'STATUS':<12} {'SIZE':>10} {'LIVE':>4} {'DEAD':>4} "
             f"{'RANKS':>5} {'SLOTS/RANK':>10} {'SLOT SIZE':>10} {'GEN':>5} {'OCC':>6}"]
    for r in rows:
        p = r["params"] or {}
        dash = "-"
        cells = (f"{r['status']:<12} "
                 f"{human_bytes(r['size']) if r['size'] is not None else dash:>10} "
                 f"{len(r['live_ranks']) if r['live_ranks'] is not None else dash:>4} "
                 f"{len(r['dead_ranks']) if r['dead_ranks'] is not None else dash:>4} "
                 f"{p.get('max_ranks', dash):>5} "
                 f"{num(p['slots_per_rank'], 10) if 'slots_per_rank' in p else dash:>10} "
                 f"{human_bytes(p['slot_size']) if 'slot_size' in p else dash:>10} "
                 f"{num(r['generation'], 5) if r['generation'] is not None else dash:>5} "
                 f"{format(r['occupancy'], '.1%') if r['occupancy'] is not None else dash:>6}")
        if len(r["uuid"]) <= 24:
            lines.append(f"{r['uuid']:<24} {cells}")
        else:                       # a long uuid gets its own line; it is never cut
            lines.append(r["uuid"])
            lines.append(f"{'':<24} {cells}")
        if r["error"]:
            lines.extend(wrap(r["error"], " " * 4))
    return lines


# ------------------------------------------------------------------------- inspect

def _segment_lines(d: Dict[str, Any]) -> List[str]:
    h, st, occ = d["header"], d["slot_states"], d["occupancy"]
    return [f"segment {d['uuid']}  status {d['status']}",
            f"  path {d['path']}",
            f"  layout v{h['layout_version']}  creator pid {h['creator_pid']} uid "
            f"{h['creator_uid']}  size {human_bytes(h['total_size'])} (data "
            f"{human_bytes(h['data_bytes'])}, control {human_bytes(h['control_bytes'])})",
            f"  params  max_ranks {h['max_ranks']}  slots_per_rank {h['slots_per_rank']}  "
            f"slot_size {h['slot_size']}  n_buckets {h['n_buckets']}  n_stripes {h['n_stripes']}",
            f"  generation {d['generation']}  entries {d['entries']}  size_bytes "
            f"{d['size_bytes']} ({human_bytes(d['size_bytes'])})",
            "",
            f"slots  {d['slots']} total, current entries {occ['entries']} "
            f"(occupancy {occ['fraction']:.1%})",
            f"  empty {st['empty']}  loading {st['loading']}  ready {st['ready']}  failed "
            f"{st['failed']}  |  pinned {st['pinned']}  claimed {st['claimed']}  stale "
            f"{st['stale']}",
            ""]


def _chain_lines(c: Dict[str, Any]) -> List[str]:
    verdict = "ok" if c["mean"] <= c["target_mean"] else "ABOVE TARGET"
    lines = [f"chains  {c['buckets']} buckets, {c['nonempty']} non-empty  mean {c['mean']:.2f}  "
             f"p99 {c['p99']:.2f}  max {c['max']}  (target mean <= {c['target_mean']}: {verdict})"]
    hist = [(k, v) for k, v in c["histogram"] if k > 0]
    if hist:
        shown, rest = hist[:CHAIN_ROWS], sum(v for _, v in hist[CHAIN_ROWS:])
        top = max(v for _, v in shown)
        lines.append(f"  {'length':>8} {'buckets':>12}")
        lines += [f"  {k:>8} {num(v, 12)} {'#' * max(1, round(BAR * v / top))}" for k, v in shown]
        if rest:
            lines.append(f"  {'>' + str(hist[CHAIN_ROWS - 1][0]):>8} {num(rest, 12)}")
    return lines + [""]


def _rank_table_lines(ranks: List[Dict[str, Any]]) -> List[str]:
    live = sum(r["alive"] for r in ranks)
    dead = sum(r["dead"] for r in ranks)
    lines = [f"ranks  {live} live, {dead} dead, {len(ranks) - live - dead} free of {len(ranks)}",
             f"  {'rank':>4} {'state':<12} {'pid':>7} {'alive':<5} {'arenas':>6} {'used':>7} "
             f"{'pins':>6} {'claims':>6} {'gets':>7} {'hits':>7} {'misses':>7} {'loads':>7} "
             f"{'fails':>5}"]
    hidden = 0
    for r in ranks:
        cnt = r["counters"]
        if r["state"] == "free" and not r["alive"] and not r["arenas"] and not r["pins"] \
                and not r["claims"] and not any(cnt.values()):
            hidden += 1
            continue
        alive = "yes" if r["alive"] else ("DEAD" if r["dead"] else "no")
        lines.append(f"  {r['rank']:>4} {r['state']:<12} {r['pid']:>7} {alive:<5} "
                     f"{num(len(r['arenas']), 6)} {num(r['slots_used'], 7)} {num(r['pins'], 6)} "
                     f"{num(r['claims'], 6)} {num(cnt.get('gets', 0), 7)} "
                     f"{num(cnt.get('hits', 0), 7)} {num(cnt.get('misses', 0), 7)} "
                     f"{num(cnt.get('loads_started', 0), 7)} {num(cnt.get('loads_failed', 0), 5)}")
    if hidden:
        lines.append(f"  ({hidden} free rank(s) never used not shown)")
    return lines


def spans(items: List[int]) -> str:
    """Sorted ints as ranges: [0, 1, 2, 5, 7, 8] -> '0-2, 5, 7-8'."""
    out: List[str] = []
    last = 0        # read only once out has an item, i.e. after the first assignment below
    for i in items:
        if out and i == last + 1:
            first = out[-1].split("-")[0]
            out[-1] = f"{first}-{i}"
        else:
            out.append(str(i))
        last = i
    return ", ".join(out)


def _arena_lines(d: Dict[str, Any]) -> List[str]:
    a = d["arenas"]
    lines = [f"arenas  {a['count']} of {a['slots_each']} slot(s) each (a rank allocates only in "
             f"the arenas it owns), {a['free']} free"]
    for r in d["ranks"]:
        if r["arenas"]:
            tag = "" if r["alive"] else " (not alive: recovery frees them)"
            lines.extend(wrap(f"rank {r['rank']}: {len(r['arenas'])} ({r['arena_slots']} slots): "
                              f"{spans(r['arenas'])}{tag}"))
    return lines


def _totals_lines(ranks: List[Dict[str, Any]], t: Dict[str, int]) -> List[str]:
    gets = t.get("gets", 0)
    hit = f"{t.get('hits', 0) / gets:.1%}" if gets else "-"
    lines = [f"  totals: gets {gets}  hit {hit}  joins {t.get('joins', 0)}  loads "
             f"{t.get('loads_started', 0)}  fails {t.get('loads_failed', 0)}  evictions "
             f"{t.get('evictions', 0)}  bypasses {t.get('bypasses', 0)}  clears "
             f"{t.get('clears', 0)}"]
    rings = [r for r in ranks if any(r.get("ring", {}).values())]
    if rings or t.get("prefetched", 0):
        lines.append(f"  prefetch: prefetched {t.get('prefetched', 0)}  skipped "
                     f"{t.get('prefetch_skipped', 0)};  rings (rank: depth / posted / dropped / "
                     "already present):")
        lines.extend(wrap("  ".join(f"{r['rank']}: {r['ring']['depth']} / {r['ring']['posted']} "
                                    f"/ {r['ring']['dropped']} / {r['ring']['already_present']}"
                                    for r in rings), "    "))
    if any(t.get(k, 0) for k in ("t2_hits", "t2_misses", "t2_writes", "t2_bypasses")):
        lines.append(f"  tier 2: hits {t.get('t2_hits', 0)}  misses {t.get('t2_misses', 0)}  "
                     f"write-throughs {t.get('t2_writes', 0)}  bypasses "
                     f"{t.get('t2_bypasses', 0)}  lease waits {t.get('t2_lease_waits', 0)}  "
                     f"bad values {t.get('t2_bad_values', 0)}")
    return lines + [""]


def _stuck_lines(d: Dict[str, Any]) -> List[str]:
    s = d["stuck"]
    n_stuck = s["pins"] + s["claims"] + s["loading"]
    if not n_stuck:
        return ["stuck  none"]
    lines = wrap(f"stuck  {s['pins']} pin(s), {s['claims']} claim(s), {s['loading']} Loading "
                 f"slot(s) held by dead ranks; `ucmcache recover {d['uuid']}` reclaims them", "")
    pid = {r["rank"]: r["pid"] for r in d["ranks"]}
    what = {"pin": "pinned by", "claim": "claimed by", "loading": "Loading, loader"}
    for it in s["items"][:SHOWN_LINES]:
        lines.append(f"  slot {it['slot']}: {what[it['kind']]} dead rank {it['rank']} "
                     f"(pid {pid[it['rank']]})")
    if n_stuck > SHOWN_LINES:
        lines.append(f"  ... {n_stuck - SHOWN_LINES} more")
    return lines


def inspect_lines(d: Dict[str, Any]) -> List[str]:
    """The human form of inspect_facts' --json object."""
    lines = (_segment_lines(d) + _chain_lines(d["chains"]) + _rank_table_lines(d["ranks"]) +
             _totals_lines(d["ranks"], d["totals"]) + _arena_lines(d) + _stuck_lines(d))
    for t in d.get("tiers", {}).values():
        lines += tier_lines(t)
    if not d["problems"]:
        return lines + ["problems  none: all invariants hold"]
    return (lines + [f"problems  {len(d['problems'])} (from verify)"] +
            _listed(d["problems"], SHOWN_LINES))


# ------------------------------------------------------------------------- watch

RATES = (("gets/s", "gets"), ("loads/s", "loads_started"), ("evictions/s", "evictions"),
         ("fails/s", "loads_failed"), ("waits/s", "waits"))


def _rate_row(label: str, d: np.ndarray, dt: float) -> str:
    gets, hits = int(d[COUNTERS["gets"]]), int(d[COUNTERS["hits"]])
    hit = f"{hits / gets:.1%}" if gets else "-"
    rates = [int(d[COUNTERS[c]]) / dt for _, c in RATES]
    return f"  {label:<8} {num(rates[0], 11)} {hit:>7} " + " ".join(num(x, 11) for x in rates[1:])


def watch_lines(uuid: str, s: Dict[str, Any], snap: np.ndarray,
                prev: Optional[Tuple[np.ndarray, float]], now: float, frame: int,
                interval: float, slots: int) -> List[str]:
    """One frame of `watch`: the summary s, and rates from the counters' change since prev."""
    live = sum(r["alive"] for r in s["ranks"])
    dead = sum(r["dead"] for r in s["ranks"])
    lines = [f"ucmcache watch {uuid}"[:WIDTH],
             f"  every {interval:g} s  frame {frame}  {time.strftime('%H:%M:%S')}  "
             "(Ctrl-C stops)",
             f"  ranks {live} live / {dead} dead / {len(s['ranks'])}   generation "
             f"{s['generation']}",
             f"  entries {s['entries']} of {slots} ({s['entries'] / slots:.1%})   size "
             f"{human_bytes(s['size_bytes'])}",
             "",
             f"  {'':<8} " + " ".join(f"{name:>11}" for name, _ in RATES[:1]) +
             f" {'hit %':>7} " + " ".join(f"{name:>11}" for name, _ in RATES[1:])]
    if prev is None:
        return lines + ["  (rates appear from the next frame)"]
    psnap, ptime = prev
    dt = max(now - ptime, 1e-9)
    delta = (snap.astype("int64") - psnap.astype("int64")).clip(min=0)
    lines.append(_rate_row("total", delta.sum(axis=0), dt))
    for r in s["ranks"]:
        if r["state"] != "free" or delta[r["rank"]].any():
            lines.append(_rate_row(f"rank {r['rank']}", delta[r["rank"]], dt))
    return lines


# ------------------------------------------------------------------------- verify, recover

def verify_lines(uuid: str, rep) -> List[str]:
    if not rep.ok:
        return [f"segment {uuid!r}: {len(rep.problems)} problem(s)"] + _listed(rep.problems)
    f = rep.facts
    return [f"segment {uuid!r}: all invariants hold",
            f"  generation {f['generation']}  entries {f['entries']}  size_bytes "
            f"{f['size_bytes']}  slots {f['slots']}  chains mean {f['chains']['mean']:.2f} "
            f"max {f['chains']['max']}"]


def recover_lines(uuid: str, report, after) -> List[str]:
    """What recovery reclaimed (a RecoveryReport), then what verify says afterwards."""
    lines = []
    if not report.ranks and not report.failed:
        lines.append(f"segment {uuid!r}: no dead ranks to recover")
    for why in report.failed:
        lines.extend(wrap(f"not recovered yet: {why}"))
    for r in report.ranks:
        lines.append(f"recovered rank {r.rank} (pid {r.pid}): {r.pins} pin(s) dropped, "
                     f"{r.failed_loads} Loading slot(s) failed, {r.claims} claim(s) freed")
    if report.ranks:
        t = (sum(r.pins for r in report.ranks), sum(r.failed_loads for r in report.ranks),
             sum(r.claims for r in report.ranks))
        lines.append(f"total: {len(report.ranks)} rank(s), {t[0]} pin(s), {t[1]} load(s), "
                     f"{t[2]} claim(s) reclaimed")
    if after.ok:
        return lines + ["verify: all invariants hold"]
    return (lines + [f"verify after recovery: {len(after.problems)} problem(s) remain"] +
            _listed(after.problems))


# ------------------------------------------------------------------------- disk tiers


def tier_lines(t: Dict[str, Any]) -> List[str]:
    """A disk tier directory (ucmcache.disktier.facts.tier_facts) in a few lines."""
    c = t["counters"]
    lines = [f"tier {t['tier']}",
             f"  format v{t['format_version']}  {t['files']} block file(s)  "
             f"{human_bytes(t['bytes'])} (usage record {human_bytes(t['usage_bytes'])})  "
             + (f"capacity {human_bytes(t['capacity_bytes'])} ({t['capacity_bytes']} B)"
                if t.get("capacity_bytes") is not None else "capacity not recorded"),
             f"  hits {c['t2_hits']}  misses {c['t2_misses']}  bypasses {c['t2_bypasses']}  "
             f"bad {c['t2_bad_values']}",
             f"  writes {c['t2_writes']}  dedups {c['t2_write_dedups']}  drops "
             f"{c['t2_write_drops']}  write failures {c['t2_write_failures']}  evictions "
             f"{c['t2_evictions']}",
             f"  read {human_bytes(c['t2_read_bytes'])}  written "
             f"{human_bytes(c['t2_written_bytes'])}  evicted "
             f"{human_bytes(c['t2_evicted_bytes'])}"]
    for b in t.get("blocks", []):
        lines.append(f"  {b['block_id']}  offset {b['offset']}  {human_bytes(b['size'])}  "
                     f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(b['mtime_ns'] / 1e9))}")
    return lines + [""]
