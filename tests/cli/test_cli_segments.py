"""The `ucmcache` command, run as a subprocess against segments that workers hold in known states.

Workers (tests/processes/cli_workers.py) are spawned processes that attach, put slots into the states a
test asks for, signal through an Event and wait on another (bounded).  Every segment a test makes
has a unique uuid and is removed at teardown, pass or fail; /dev/shm is left as found.
"""
import json
import multiprocessing as mp
import os
import re
import signal
import stat
import struct
import subprocess
import sys
import types

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "processes"))  # cli_workers

import cli_workers  # noqa: E402
from cli_helpers import (CREATE, PARAMS, VERSION, WAIT, assert_fits,  # noqa: E402,F401
                         assert_one_error_line, ls_json, make_half_made, make_incompatible,
                         make_orphan, names, path_of, run)
from ucmcache import SlotCache  # noqa: E402
from ucmcache.cli import _render  # noqa: E402
from ucmcache.lowlevel import lib  # noqa: E402

SPAWN = mp.get_context("spawn")


def inspect_json(u):
    r = run("inspect", u, "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


# ------------------------------------------------------------------------- fixtures

class Worker:
    """A spawned cli_workers.hold process; start it through the `workers` fixture."""

    def __init__(self, uuid, kinds):
        self.info_q = SPAWN.Queue()
        self.ready = SPAWN.Event()
        self.release = SPAWN.Event()
        self.proc = SPAWN.Process(target=cli_workers.hold, daemon=True,
                                  args=(uuid, tuple(kinds), self.info_q, self.ready,
                                        self.release, WAIT))
        self.killed = False
        self.proc.start()

    def wait_ready(self):
        assert self.ready.wait(WAIT), "worker did not get ready in time"
        status, info = self.info_q.get(timeout=WAIT)
        assert status == "ok", info
        self.rank, self.pid, self.slots = info["rank"], info["pid"], info["slots"]

    def stop(self):
        """Let it close cleanly."""
        self.release.set()
        self.proc.join(WAIT)
        assert self.proc.exitcode == 0, self.proc.exitcode

    def kill(self):
        # A multiprocessing Event must never be set after a process waiting on it was killed:
        # notify_all() would wait forever for the dead sleeper to acknowledge.  So `release`
        # is this worker's alone, and teardown leaves a killed worker's untouched.
        self.killed = True
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join(WAIT)
        assert self.proc.exitcode == -signal.SIGKILL


@pytest.fixture
def workers():
    started = []

    def start(uuid, kinds=()):
        w = Worker(uuid, kinds)
        started.append(w)       # before waiting: teardown reaps it even if it never gets ready
        w.wait_ready()
        return w

    yield start
    for w in started:       # release every gate, then make sure nothing outlives the test
        if not w.killed:
            w.release.set()
    for w in started:
        w.proc.join(WAIT)
        if w.proc.is_alive():
            w.proc.kill()
            w.proc.join(WAIT)


def test_create_then_ls_shows_params_and_orphan(names):
    u = names("made")
    r = run("create", u, "--slots-per-rank", 8, "--slot-size", 128, "--max-ranks", 2)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"created {u}: 2 ranks x 8 slots x 128 B")
    row = ls_json()[u]
    assert row["status"] == "idle"         # created, no rank attached, none died
    assert row["params"] == {"max_ranks": 2, "slots_per_rank": 8, "slot_size": 128,
                             "n_buckets": 1 << 14, "n_stripes": 64}
    assert (row["live_ranks"], row["dead_ranks"], row["generation"], row["entries"],
            row["slots"], row["occupancy"]) == ([], [], 1, 0, 16, 0.0)
    assert row["size"] == os.path.getsize(path_of(u)) and row["layout_version"] == VERSION
    assert_one_error_line(run("create", u, "--slots-per-rank", 8, "--slot-size", 128), 2,
                          r"already exists")
    assert_one_error_line(run("create", names("bad"), "--slots-per-rank", 8, "--slot-size", 0),
                          2, r"bad params: slot_size must be")
    assert not os.path.exists(path_of(names.prefix + "bad"))


def test_ls_statuses(names, workers):
    live, orphan, dead, half, old = (names(t) for t in ("live", "orphan", "dead", "half", "old"))
    for u in (live, orphan, dead):
        make_orphan(u)
    make_half_made(half)
    make_incompatible(old)
    w = workers(live, ["ready"])
    workers(dead, ["pinned"]).kill()

    rows = ls_json()
    assert {u: rows[u]["status"] for u in (live, orphan, dead, half, old)} == {
        live: "live", orphan: "idle", dead: "orphan", half: "half-made", old: "incompatible"}
    assert rows[live]["live_ranks"] == [w.rank] and rows[live]["live_pids"] == [w.pid]
    assert rows[live]["entries"] == 1 and rows[live]["occupancy"] == 1 / 64
    assert rows[dead]["dead_ranks"] == [0] and rows[dead]["live_ranks"] == []
    assert rows[old]["layout_version"] == 99 and rows[half]["params"] is None

    r = run("ls")
    assert r.returncode == 0
    assert_fits(r.stdout)
    line = {u: next(x for x in r.stdout.splitlines() if x.startswith(u + " ")) for u in
            (live, orphan, half, old)}
    size = re.escape(_render.human_bytes(os.path.getsize(path_of(live))))
    assert re.match(rf"{live} +live +{size} +1 +0 +4 +16 +64 B +1 +1\.6%$", line[live])
    assert re.match(rf"{half} +half-made +4\.0 KiB +- +- +- +- +- +- +-$", line[half])
    assert " incompatible " in line[old]


def test_ls_shows_no_sizes_from_a_header_it_cannot_trust(names):
    # A garbage header's words must not be printed as sizes (they were: "9363658.1T").  Three files:
    # random bytes; ucmcache's magic and version over garbage params (attach's checks fail);
    # another layout version (its words may mean other things).
    noise, bad, old = names("noise"), names("badparams"), names("oldlayout")
    rng = __import__("random").Random(26)
    for u in (noise, bad):
        fd = os.open(path_of(u), os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.write(fd, bytes(rng.getrandbits(8) for _ in range(4096)))
            if u == bad:
                os.pwrite(fd, struct.pack("<QI", lib.UCM_MAGIC, VERSION), lib.UCM_H_MAGIC)
        finally:
            os.close(fd)
    make_incompatible(old)
    rows = ls_json()
    assert {u: rows[u]["status"] for u in (noise, bad, old)} == {
        noise: "corrupt", bad: "corrupt", old: "incompatible"}
    assert [rows[u]["params"] for u in (noise, bad, old)] == [None, None, None]
    assert (rows[noise]["layout_version"], rows[bad]["layout_version"],
            rows[old]["layout_version"]) == (None, VERSION, 99)
    r = run("ls")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    for u, status in ((noise, "corrupt"), (bad, "corrupt"), (old, "incompatible")):
        i = next(i for i, x in enumerate(lines) if x == u or x.startswith(u + " "))
        cells = lines[i][len(u):] if lines[i] != u else lines[i + 1]  # a long uuid: own line
        # the file's own size (4.0 KiB, or the made segment's), then dashes only
        assert re.match(rf" +{status} +\d+\.\d (KiB|MiB) +- +- +- +- +- +- +-$", cells), cells


def test_ls_keeps_long_uuids_whole_within_100_columns(names):
    u = names("x" * (64 - len(names.prefix)))
    assert len(u) == 64
    make_orphan(u)
    r = run("ls")
    assert_fits(r.stdout)
    lines = r.stdout.splitlines()
    i = lines.index(u)
    assert lines[i + 1].split()[0] == "idle"


# ------------------------------------------------------------------------- inspect, verify

def test_inspect_json_of_a_live_segment(names, workers):
    u = names()
    make_orphan(u)
    w = workers(u, cli_workers.KINDS)
    d = inspect_json(u)
    assert d["schema"] == 1 and d["uuid"] == u and d["path"] == path_of(u)
    assert d["status"] == "live" and d["ok"] and d["problems"] == []
    assert d["header"]["layout_version"] == VERSION
    assert {k: d["header"][k] for k in PARAMS} == PARAMS
    assert d["header"]["total_size"] == os.path.getsize(path_of(u))
    assert d["header"]["control_bytes"] + d["header"]["data_bytes"] == d["header"]["total_size"]
    size = len(b"value of ready") + len(b"value of pinned")
    assert (d["generation"], d["entries"], d["size_bytes"], d["slots"]) == (1, 2, size, 64)
    assert d["occupancy"] == {"entries": 2, "slots": 64, "fraction": 2 / 64}
    assert d["slot_states"] == {"empty": 60, "loading": 1, "ready": 2, "failed": 1, "stale": 0,
                                "pinned": 2, "claimed": 0}
    c = d["chains"]
    assert c["target_mean"] == 2 and c["buckets"] == 1 << 14
    assert sum(n for _, n in c["histogram"]) == c["buckets"]
    assert c["nonempty"] == 4 and c["max"] >= 1 and c["mean"] >= 1
    assert d["stuck"] == {"pins": 0, "claims": 0, "loading": 0, "items": []}

    assert [r["rank"] for r in d["ranks"]] == list(range(4))
    me = d["ranks"][w.rank]
    assert (me["state"], me["pid"], me["alive"], me["dead"]) == ("ready", w.pid, True, False)
    assert (me["slots_used"], me["pins"], me["claims"]) == (3, 2, 0)  # ready, pinned, loading
    assert me["arenas"] == list(range(32)) and me["arena_slots"] == 64  # the only rank: all
    assert d["arenas"] == {"count": 32, "slots_each": 2, "free": 0}
    cnt = me["counters"]
    assert (cnt["gets"], cnt["misses"], cnt["hits"]) == (4, 4, 0)
    assert (cnt["loads_started"], cnt["loads_ready"], cnt["loads_failed"]) == (4, 2, 1)
    assert d["totals"]["gets"] == 4
    others = [r for r in d["ranks"] if r["rank"] != w.rank]
    assert all(r["state"] == "free" and not r["alive"] and not r["dead"] for r in others)

    r = run("inspect", u)
    assert r.returncode == 0, r.stderr
    assert_fits(r.stdout)
    out = r.stdout
    assert f"segment {u}  status live" in out
    assert "  empty 60  loading 1  ready 2  failed 1  |  pinned 2  claimed 0  stale 0" in out
    assert re.search(r"target mean <= 2: ok", out)
    assert re.search(rf"^ +{w.rank} ready +{w.pid} yes +32 +3 +2 +0 +4 +0 +4 +4 +1$", out, re.M)
    assert f"  rank {w.rank}: 32 (64 slots): 0-31\n" in out
    assert "stuck  none" in out and "problems  none: all invariants hold" in out
    assert run("verify", u).returncode == 0
    w.stop()
    assert ls_json()[u]["status"] == "idle"      # its worker closed cleanly


def test_kill_holding_a_pin_then_verify_and_recover(names, workers):
    u = names()
    make_orphan(u)
    w = workers(u, cli_workers.KINDS)
    w.kill()

    d = inspect_json(u)
    me = d["ranks"][w.rank]
    assert (me["alive"], me["dead"], me["pid"], me["pins"]) == (False, True, w.pid, 2)
    assert d["status"] == "orphan" and not d["ok"]
    assert {k: d["stuck"][k] for k in ("pins", "claims", "loading")} == {
        "pins": 2, "claims": 0, "loading": 1}
    items = {(i["slot"], i["kind"], i["rank"]) for i in d["stuck"]["items"]}
    assert items == {(w.slots["pinned"], "pin", w.rank), (w.slots["loading"], "pin", w.rank),
                     (w.slots["loading"], "loading", w.rank)}
    r = run("inspect", u)
    assert_fits(r.stdout)
    assert f"  slot {w.slots['pinned']}: pinned by dead rank {w.rank} (pid {w.pid})" in r.stdout
    assert (f"stuck 2 pin(s), 0 claim(s), 1 Loading slot(s) held by dead ranks; `ucmcache "
            f"recover {u}` reclaims them") in " ".join(r.stdout.split())     # wrapped at 100

    r = run("verify", u)
    assert r.returncode == 1, r.stdout
    # the rank, its pin, its Loading slot, its pinned Loading slot, its arenas
    assert r.stdout.startswith(f"segment {u!r}: 5 problem(s)")
    assert f"arena(s) owned by rank {w.rank}, which is not alive" in r.stdout
    assert f"slot {w.slots['pinned']}: pinned by rank(s) [{w.rank}] that are not alive" in r.stdout
    assert f"slot {w.slots['loading']}: Loading, but its loader rank {w.rank}" in r.stdout

    r = run("recover", u)
    assert r.returncode == 0, r.stdout + r.stderr
    assert (f"recovered rank {w.rank} (pid {w.pid}): 2 pin(s) dropped, 1 Loading slot(s) "
            "failed, 0 claim(s) freed") in r.stdout
    assert "verify: all invariants hold" in r.stdout
    assert run("verify", u).returncode == 0
    r = run("recover", u)
    assert r.returncode == 0 and "no dead ranks to recover" in r.stdout

    d = inspect_json(u)
    assert d["ok"] and d["ranks"][w.rank]["state"] == "free"
    assert d["stuck"] == {"pins": 0, "claims": 0, "loading": 0, "items": []}
    st = d["slot_states"]
    assert (st["pinned"], st["loading"], st["failed"], st["ready"]) == (0, 0, 2, 2)
    assert d["entries"] == 2
    # Capacity is whole: a new process can take the rank and fill every slot of it.
    with SlotCache.attach(u, rank=w.rank) as c:
        for i in range(PARAMS["slots_per_rank"]):
            with c.get(i.to_bytes(16, "little")) as h:
                if h.owner:
                    h.ready(1)


def test_human_form_fits_100_columns_even_with_extreme_numbers(names, workers, capsys):
    u = names("x" * (64 - len(names.prefix)))
    make_orphan(u)
    workers(u, ["pinned", "loading"]).kill()
    d = inspect_json(u)
    big = 10 ** 15
    d["header"].update(max_ranks=63, slots_per_rank=2 ** 31 // 63, slot_size=2 ** 31,
                       n_buckets=2 ** 24, n_stripes=2 ** 16, total_size=big, data_bytes=big,
                       creator_pid=4194304, creator_uid=2 ** 32 - 1)
    d.update(generation=big, entries=big, size_bytes=big, slots=big)
    d["chains"]["histogram"] = [[k, big] for k in range(40)]
    for r in d["ranks"]:
        r.update(pid=4194304, slots_used=big, pins=big, claims=big, state="initializing",
                 counters={k: big for k in r["counters"]})
    d["totals"] = {k: big for k in d["totals"]}
    d["problems"] = ["x" * 300, " ".join(["word"] * 100)]
    _render.out(_render.inspect_lines(d))
    out = capsys.readouterr().out
    assert_fits(out)
    assert u in out.splitlines()[0]


# ------------------------------------------------------------------------- watch

def test_watch_prints_rates(names, workers):
    u = names()
    make_orphan(u)
    w = workers(u, ["ready"])
    r = run("watch", u, "--interval", "0.05", "--count", "3")
    assert r.returncode == 0, r.stderr
    assert_fits(r.stdout)
    assert r.stdout.count(f"ucmcache watch {u}") == 3 and "frame 3" in r.stdout
    assert "(rates appear from the next frame)" in r.stdout
    assert re.search(r"gets/s +hit % +loads/s +evictions/s", r.stdout)
    assert re.search(r"^  total +0\.0 +- +0\.0 +0\.0", r.stdout, re.M)
    assert re.search(rf"^  rank {w.rank} ", r.stdout, re.M)
    assert "ranks 1 live / 0 dead / 4" in r.stdout and "entries 1 of 64" in r.stdout
    assert_one_error_line(run("watch", u, "--interval", "0"), 2, r"--interval must be > 0")


def test_watch_stops_with_one_line_once_its_segment_is_removed(names):
    u = names()
    make_orphan(u)
    p = subprocess.Popen([sys.executable, "-m", "ucmcache.cli", "watch", u, "--interval",
                          "0.05"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        first = p.stdout.readline()  # a frame was printed: the watch is under way
        assert f"ucmcache watch {u}" in first, first
        SlotCache.unlink(u)
        out, err = p.communicate(timeout=WAIT)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(WAIT)
    r = types.SimpleNamespace(returncode=p.returncode, stdout=first + out, stderr=err)
    assert_one_error_line(r, 1, r"was removed or replaced while watched: watch stops")


def test_rm_refuses_a_live_segment_unless_forced(names, workers):
    u = names()
    make_orphan(u)
    w = workers(u, ["pinned"])
    r = run("rm", u)
    assert_one_error_line(r, 1, rf"has live rank\(s\) {w.rank} \(pid {w.pid}\): not removed")
    assert os.path.exists(path_of(u))
    r = run("rm", u, "--force")
    assert r.returncode == 0 and r.stdout == f"removed {u} (forced)\n"
    assert not os.path.exists(path_of(u))
    w.stop()     # the attached worker keeps its mapping and closes cleanly


def test_rm_removes_orphans_and_half_made(names, workers):
    dead, half = names("dead"), names("half")
    make_orphan(dead)
    workers(dead, ["pinned", "loading"]).kill()
    make_half_made(half)
    for u in (dead, half):
        r = run("rm", u)
        assert r.returncode == 0 and r.stdout == f"removed {u}\n", r.stderr
        assert not os.path.exists(path_of(u))


def test_gc_removes_orphans_and_half_made_never_a_live_one(names, workers):
    live, orphan, dead, half, old = (names(t) for t in ("live", "orphan", "dead", "half", "old"))
    for u in (live, orphan, dead):
        make_orphan(u)
    make_half_made(half)
    make_incompatible(old)
    w = workers(live, ["pinned", "loading"])
    workers(dead, ["pinned"]).kill()

    r = run("gc", "--prefix", names.prefix, "--dry-run")
    assert r.returncode == 0
    assert sorted(r.stdout.splitlines()) == sorted(
        [f"would remove {dead} (orphan)", f"would remove {half} (half-made)"])
    assert all(os.path.exists(path_of(u)) for u in (live, orphan, dead, half, old))

    r = run("gc", "--prefix", names.prefix)
    assert r.returncode == 0
    assert sorted(r.stdout.splitlines()) == sorted(
        [f"removed {dead} (orphan)", f"removed {half} (half-made)"])
    assert os.path.exists(path_of(live)) and os.path.exists(path_of(old))
    assert os.path.exists(path_of(orphan))             # idle (pre-created): kept by default
    assert not any(os.path.exists(path_of(u)) for u in (dead, half))
    assert run("gc", "--prefix", names.prefix, "--idle").stdout == f"removed {orphan} (idle)\n"
    d = inspect_json(live)
    assert d["ok"] and d["ranks"][w.rank]["pins"] == 2     # untouched

    assert run("gc", "--prefix", names.prefix).stdout == "nothing to remove\n"
    w.stop()
    assert run("gc", "--prefix", names.prefix).stdout == "nothing to remove\n"  # idle now
    assert run("gc", "--prefix", names.prefix, "--idle").stdout == f"removed {live} (idle)\n"


def test_inspect_shows_prefetch_rings_and_tier2_counters(names):
    from ucmcache.lowlevel import lib
    u = names()
    make_orphan(u)
    with SlotCache.attach(u) as c:
        c.prefetch([i.to_bytes(16, "little") for i in range(5)])
        lib.ucm_stat_add(c._ctx, lib.UCM_ST_T2_HITS, 3)  # as a tier-2 hit would
        d = inspect_json(u)
        me = d["ranks"][c.rank]
        assert me["ring"] == {"depth": 5, "posted": 5, "dropped": 0, "already_present": 0}
        assert me["counters"]["t2_hits"] == 3
        r = run("inspect", u)
        assert r.returncode == 0, r.stderr
        assert_fits(r.stdout)
        assert re.search(rf"rings \(rank: depth / posted / dropped / already present\):\n +"
                         rf"{c.rank}: 5 / 5 / 0 / 0", r.stdout)
        assert "tier 2: hits 3  misses 0" in r.stdout


def test_create_mode_sets_the_permission_bits(names):
    u = names("mode")
    umask = os.umask(0)
    os.umask(umask)
    r = run(CREATE[0], u, *CREATE[1:], "--mode", "640")
    assert r.returncode == 0, r.stderr
    assert stat.S_IMODE(os.stat(path_of(u)).st_mode) == 0o640 & ~umask
