"""Commands: the ``ucmcache`` subcommands, their argument parser, and main().

Each ``cmd_*`` opens what it needs through _facts, gathers, and prints through _render; a
CliError anywhere becomes one line on stderr and its exit code (see the package docs).
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence

from ..core.errors import SegmentNotFound, SharedMemoryFull, UcmError
from ..core.layout import LayoutError
from ..core.recovery import recover_dead_ranks
from ..lowlevel import (MAX_MODE, PREFIX, Layout, Segment, check_mode, held_for_removal, lib,
                        names_file, shm_path, unlink_if_same)
from ..core.stats import rank_counters
from ..core.table import reader_context
from ..core.verify import verify_segment
from . import _render as render
from ._facts import (CliError, attached, check_uuid_arg, inspect_facts, live_pids, ls_row,
                     probe_segment, segment_names, summary)


# ------------------------------------------------------------------------- ls, inspect, watch

def _show(facts: Any, as_json: bool, lines: Callable[[Any], List[str]]) -> int:
    """Print the facts in their --json form, or as their human lines."""
    if as_json:
        print(json.dumps(facts, indent=2, sort_keys=True))
    else:
        render.out(lines(facts))
    return 0


def cmd_ls(args) -> int:
    rows = [r for r in (ls_row(n) for n in segment_names()) if r is not None]
    return _show(rows, args.json, render.ls_lines)


def cmd_inspect(args) -> int:
    with attached(args.uuid, timeout=args.timeout) as seg:
        d = inspect_facts(args.uuid, seg)
    if args.tier:
        d["tiers"] = _tiers(args.tier)
    return _show(d, args.json, render.inspect_lines)


# ------------------------------------------------------------------------- disk tiers

def _tiers(paths: List[str]) -> Dict[str, Any]:
    from ..tiers.disk.facts import NotATierDirectory, many_tier_facts
    try:
        return many_tier_facts(paths)
    except NotATierDirectory as e:
        raise CliError(str(e)) from None


def _tier_dir(path: str, allow_other_user: bool = False):
    from ..tiers.disk import ForeignTierDirectory
    from ..tiers.disk.facts import NotATierDirectory, open_dir
    try:
        return open_dir(path, allow_other_user=allow_other_user)
    except NotATierDirectory as e:
        raise CliError(str(e)) from None
    except ForeignTierDirectory as e:
        raise CliError(f"{e} (here: --allow-other-user)") from None


def cmd_tier_ls(args) -> int:
    from ..tiers.disk.facts import NotATierDirectory, tier_facts
    try:
        d = tier_facts(args.path, files=args.files)
    except NotATierDirectory as e:
        raise CliError(str(e)) from None
    return _show(d, args.json, render.tier_lines)


def cmd_tier_verify(args) -> int:
    t = _tier_dir(args.path, args.allow_other_user)
    r = t.verify(remove_bad=args.remove_bad)
    if args.json:
        print(json.dumps({"tier": t.label, "ok": r.ok, "removed": r.removed,
                          "bad": [{"path": p, "why": w} for p, w in r.bad]}, indent=2))
    else:
        lines = [f"tier {t.label}", f"  {r.ok} block file(s) ok, {len(r.bad)} bad"
                 + (f", {r.removed} removed" if r.removed else "")]
        lines += [f"  {os.path.relpath(p, t.root)}: {w}" for p, w in r.bad[:SHOWN_BAD]]
        if len(r.bad) > SHOWN_BAD:
            lines.append(f"  ... and {len(r.bad) - SHOWN_BAD} more (--json lists all)")
        render.out(lines)
    return 1 if r.bad and not args.remove_bad else 0


SHOWN_BAD = 20


def cmd_tier_trim(args) -> int:
    if args.to < 0:
        raise CliError(f"--to must be >= 0 bytes, got {args.to}")
    t = _tier_dir(args.path, args.allow_other_user)
    removed, left = t.trim(args.to)
    render.out([f"tier {t.label}", f"  removed {removed} block file(s), least recently used "
                f"first; {render.human_bytes(left)} left"])
    return 0


def cmd_watch(args) -> int:
    if args.interval <= 0:
        raise CliError(f"--interval must be > 0 seconds, got {args.interval}")
    in_place = sys.stdout.isatty()
    with attached(args.uuid, timeout=args.timeout) as seg:
        prev = None
        frame = 0
        try:
            while True:
                frame += 1
                now = time.monotonic()
                if not names_file(args.uuid, seg.lock_fd):
                    # removed (or removed and made again): its counters are frozen, say so
                    raise CliError(f"segment {args.uuid!r} was removed or replaced while "
                                   "watched: watch stops", 1)
                snap = rank_counters(seg)
                lines = render.watch_lines(args.uuid, summary(seg), snap, prev, now, frame,
                                           args.interval, seg.layout.n_slots)
                if in_place:
                    sys.stdout.write("\x1b[H\x1b[2J")
                elif frame > 1:
                    lines = [""] + lines
                render.out(lines)
                prev = (snap, now)
                if args.count and frame >= args.count:
                    break
                time.sleep(args.interval)
        except KeyboardInterrupt:
            sys.stdout.write("\n")
    return 0


# ------------------------------------------------------------------------- verify, recover

def cmd_verify(args) -> int:
    with attached(args.uuid, timeout=args.timeout) as seg:
        rep = verify_segment(seg)
    render.out(render.verify_lines(args.uuid, rep))
    return 0 if rep.ok else 1


def cmd_recover(args) -> int:
    with attached(args.uuid, writable=True, timeout=args.timeout) as seg:
        with reader_context(seg) as ctx:
            # No rank of our own: recovery needs none (every hold names its rank, I5), and
            # taking one would count an attach in the segment's stats.
            report = recover_dead_ranks(seg, ctx, None)
        after = verify_segment(seg)
    render.out(render.recover_lines(args.uuid, report, after))
    return 0 if after.ok else 1


# ------------------------------------------------------------------------- metrics

def cmd_metrics(args) -> int:
    if args.once == (args.port is not None):
        raise CliError("give exactly one of --once or --port P")
    if args.port is not None and not 1 <= args.port <= 65535:
        raise CliError(f"--port must be a TCP port from 1 to 65535, got {args.port}")
    with attached(args.uuid, timeout=args.timeout):
        pass  # a missing, half-made or foreign segment: its one-line error, here
    try:
        # Imported here: it needs prometheus_client, an optional extra the other commands
        # do without.
        from .. import metrics
    except ImportError as e:
        raise CliError(str(e)) from None
    if args.tier:
        _tiers(args.tier)  # not a tier directory: its one-line error, here
    if args.once:
        sys.stdout.write(metrics.render(args.uuid, timeout=args.timeout, tiers=args.tier))
        return 0
    server, thread = metrics.serve(args.uuid, args.port, args.addr, timeout=args.timeout,
                                   tiers=args.tier)
    render.out([f"serving http://{args.addr}:{args.port}/metrics for segment {args.uuid!r} "
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
    try:
        cm = held_for_removal(uuid)
        held = cm.__enter__()
    except UcmError as e:
        raise CliError(str(e)) from None
    try:
        yield held
    finally:
        cm.__exit__(None, None, None)


def cmd_rm(args) -> int:
    check_uuid_arg(args.uuid)
    if args.force:
        probe_segment(args.uuid)          # exists, ours
        try:
            Segment.unlink(args.uuid)
        except SegmentNotFound as e:
            raise CliError(str(e)) from None
        render.out([f"removed {args.uuid} (forced)"])
        return 0
    pids = live_pids(args.uuid)
    with _held_for_removal(args.uuid) as held:
        if held["busy_ranks"]:
            who = ", ".join(f"{r} (pid {pids[r]})" if r in pids else str(r)
                            for r in held["busy_ranks"])
            raise CliError(f"segment {args.uuid!r} has live rank(s) {who}: not removed; stop "
                           "them first or use --force (attached processes keep their mapping)", 1)
        if held["creator_busy"]:
            raise CliError(f"segment {args.uuid!r} is being created right now: not removed", 1)
        if not unlink_if_same(args.uuid, held["fd"]):
            raise CliError(f"segment {args.uuid!r} vanished or was replaced meanwhile")
    render.out([f"removed {args.uuid}"])
    return 0


def _collect(uuid: str, status: str) -> Optional[str]:
    """Remove one segment gc judged `status`, re-checked under its locks; what happened."""
    try:
        with _held_for_removal(uuid) as held:
            # Re-check under the locks: still no live rank, nobody creating it, and still
            # the kind of segment we judged (made for an orphan, no magic for half-made).
            want = 0 if status == "half-made" else lib.UCM_MAGIC
            if held["busy_ranks"] or held["creator_busy"] or held["header"].get("magic", 0) != want:
                return f"kept {uuid}: it came alive meanwhile"
            if unlink_if_same(uuid, held["fd"]):
                return f"removed {uuid} ({status})"
    except CliError:
        pass                        # vanished or not ours: nothing to collect
    return None


def cmd_gc(args) -> int:
    collect = ("orphan", "half-made", "idle") if args.idle else ("orphan", "half-made")
    lines = []
    for name in segment_names():
        uuid = name[len(PREFIX):]
        if args.prefix and not uuid.startswith(args.prefix):
            continue
        row = ls_row(name)
        if row is None or row["status"] not in collect:
            continue
        line = f"would remove {uuid} ({row['status']})" if args.dry_run else \
            _collect(uuid, row["status"])
        if line:
            lines.append(line)
    render.out(lines or ["nothing to remove"])
    return 0


# ------------------------------------------------------------------------- create

def cmd_create(args) -> int:
    check_uuid_arg(args.uuid)
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
    render.out([f"created {args.uuid}: {layout.max_ranks} ranks x {layout.slots_per_rank} "
                f"slots x {layout.slot_size} B, {layout.n_buckets} buckets, {layout.n_stripes} "
                f"stripes, {render.human_bytes(layout.total_size)} at {shm_path(args.uuid)}"])
    return 0


# ------------------------------------------------------------------------- demo, bench

def bench_script() -> Path:
    """bench/run.py beside the package (present in a source tree, not in an installed one)."""
    return Path(__file__).resolve().parents[2] / "bench" / "run.py"


def cmd_demo(argv: List[str]) -> int:
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
    script = bench_script()
    if not script.is_file():
        raise CliError(f"the benchmarks are not available: {script} does not exist (they ship "
                       "with the source tree, not with an installed package: run ./scripts/bench "
                       "in a checkout of the repository)")
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
        render.error(f"{message} (`{self.prog} --help` shows the usage)")
        raise SystemExit(2)


def _mode_arg(text: str) -> int:
    """--mode: octal permission bits, checked by the rule Segment.create applies."""
    try:
        return check_mode(int(text, 8))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be octal permission bits from 0 to {MAX_MODE:o} (like 600), "
            f"got {text!r}") from None


def _segment_commands(cmd, uuid_arg) -> None:
    """The commands that read or operate one segment by uuid."""
    sp = cmd("inspect", "show a segment: header, ranks, slot states, chains, stats, stuck items",
             cmd_inspect)
    uuid_arg(sp)
    sp.add_argument("--json", action="store_true", help="the stable JSON form (schema 1)")
    sp.add_argument("--tier", action="append", default=[], metavar="PATH",
                    help="also show this disk tier directory (repeatable)")

    sp = cmd("watch", "show a segment's rates (gets/s, hit %%, loads/s, evictions/s) until "
             "Ctrl-C", cmd_watch)
    uuid_arg(sp)
    sp.add_argument("--interval", type=float, default=1.0, metavar="S",
                    help="seconds between refreshes (default 1)")
    sp.add_argument("--count", type=int, default=0, metavar="N",
                    help="stop after N frames (default: until Ctrl-C)")

    uuid_arg(cmd("verify", "check every invariant; exit 1 with the list if any is broken",
                 cmd_verify))
    uuid_arg(cmd("recover", "recover dead ranks now (drop their pins and claims, fail their "
                 "loads)", cmd_recover))


def _lifecycle_commands(cmd) -> None:
    """The commands that make and remove segments."""
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


def _metrics_command(cmd, uuid_arg) -> None:
    """The Prometheus exporter."""
    sp = cmd("metrics", "serve a segment's metrics in the Prometheus text format on "
             "/metrics (or print them once)", cmd_metrics)
    uuid_arg(sp)
    sp.add_argument("--port", type=int, default=None, metavar="P",
                    help="serve http://ADDR:P/metrics until Ctrl-C")
    sp.add_argument("--addr", default="0.0.0.0", metavar="A", help="default 0.0.0.0")
    sp.add_argument("--once", action="store_true",
                    help="print one scrape and exit (node_exporter's textfile collector)")
    sp.add_argument("--tier", action="append", default=[], metavar="PATH",
                    help="also report this disk tier directory's counters (repeatable)")


def _tier_command(sub) -> None:
    """ucmcache tier ls|verify|trim PATH: a disk tier directory (ucmcache.DiskTier)."""
    tp = sub.add_parser("tier", help="list, verify or trim a disk tier directory",
                        description="list, verify or trim a disk tier directory "
                                    "(ucmcache.DiskTier's path)")
    tsub = tp.add_subparsers(dest="action", metavar="ACTION")
    tsub.required = True
    sp = tsub.add_parser("ls", help="its block files, bytes and t2_* counters")
    sp.add_argument("path", metavar="PATH")
    sp.add_argument("--files", action="store_true", help="list every block file, newest first")
    sp.add_argument("--json", action="store_true", help="as JSON")
    sp.set_defaults(fn=cmd_tier_ls)
    sp = tsub.add_parser("verify", help="read and check every block file; exit 1 if any is bad")
    sp.add_argument("path", metavar="PATH")
    sp.add_argument("--remove-bad", action="store_true", help="remove the bad ones (exit 0)")
    sp.add_argument("--json", action="store_true", help="as JSON")
    _allow_other_user(sp)
    sp.set_defaults(fn=cmd_tier_verify)
    sp = tsub.add_parser("trim", help="remove least recently used block files down to a size")
    sp.add_argument("path", metavar="PATH")
    sp.add_argument("--to", type=int, required=True, metavar="BYTES",
                    help="the bytes the block files may take afterwards")
    _allow_other_user(sp)
    sp.set_defaults(fn=cmd_tier_trim)


def _allow_other_user(sp) -> None:
    sp.add_argument("--allow-other-user", action="store_true",
                    help="use a directory another user owns or can write (as "
                         "DiskTier(allow_other_user=True): their block files count as good)")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="ucmcache",
        description="See inside and operate ucmcache shared-memory segments (/dev/shm).",
        epilog="exit codes: 0 ok, 1 problem found, 2 usage or bad input")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    def cmd(name, help, fn):
        # help is %-formatted by argparse, a description is not: "%%" there would print as is
        sp = sub.add_parser(name, help=help, description=help.replace("%%", "%"))
        sp.set_defaults(fn=fn)
        return sp

    def uuid_arg(sp):
        sp.add_argument("uuid", metavar="UUID", help="the segment's uuid ([A-Za-z0-9_-]{1,64})")
        sp.add_argument("--timeout", type=float, default=2.0, metavar="S",
                        help="wait at most S seconds for a segment still being made "
                             "(default 2)")

    sp = cmd("ls", "list every ucmcache segment in /dev/shm with its status", cmd_ls)
    sp.add_argument("--json", action="store_true", help="a JSON list (see the module docs)")
    _segment_commands(cmd, uuid_arg)
    _lifecycle_commands(cmd)
    _metrics_command(cmd, uuid_arg)
    _tier_command(sub)
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
        render.error(str(e))
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
        if isinstance(e, (UcmError, OSError, ValueError, TimeoutError)):
            render.error(str(e))
            return 2
        render.error(f"internal error: {type(e).__name__}: {e} (set UCMCACHE_DEBUG=1 for a "
                     "traceback)")
        if os.environ.get("UCMCACHE_DEBUG"):
            raise
        return 1
