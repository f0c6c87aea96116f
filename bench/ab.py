"""A/B throughput of this tree against a base commit, in the same run (scenarios 3
and 5: "no worse than the base").

    .venv/bin/python -m bench.ab                       # base d654dfe, 3 rounds, scenarios 3,5
    .venv/bin/python -m bench.ab --quick               # tiny sizes, 1 round: checks the harness
    .venv/bin/python -m bench.ab --base REF --rounds 5 --scenarios 3,5 --time-scale 4

The base is checked out in a temporary detached git worktree and its C core built in place
(`setup.py build_ext --inplace`, as the editable install of this tree built its own), then
`python -P -m bench.run --scenarios S --repeat 1 --systems ucmcache --no-floor --no-chart
--time-scale T` runs alternately for the base and for this tree.  Both sides run THIS tree's
bench harness (bench/run.py, systems.py, ...): only the `ucmcache` package and its built `_core`
differ.  Each side's PYTHONPATH is a directory of ours holding nothing but a link `ucmcache` to
that side's package, then this tree's root (for `bench`); -P keeps the cwd off sys.path, so the
root's own `ucmcache` is never reached first (check_import verifies where `bench`, `ucmcache` and
`_core` come from).  --time-scale (default 4) multiplies scenarios 3 and 5's measurement windows
(1.5 s and 1 s in bench/run.py): a window of 4-6 s averages out more of the other work on a
shared machine than one of 1-1.5 s.  A round is one base run and one new run back to back, the order
alternating from round to round (base new, new base, base new, ...), so a drift in the machine's
load falls on both sides; each figure's ratio new/base is computed within a round and reported
as the median [min-max] over the rounds.  Judged figures: scenario 3's 2-process hit-heavy mix
and scenario 5's churn, 4 KiB and 64 KiB; scenario 3's 1-process figures are shown, not judged.

The two sides' processes are not byte for byte alike even when the commits are: their paths,
PYTHONPATH and TMPDIR differ in length ("base" vs "new", a worktree vs this tree), and that moves
where the heap puts a bytes object.  The 64 KiB payload's data landed at a side-dependent
alignment, the same in every round (48 mod 64 on one side and 32 on the other: new/base 1.12; or
both 48 mod 64 but 1392 and 304 mod 4096, the slot being page-aligned: 1.10 at 2 processes),
and with the copy's source at 16 mod 32 instead of a page start the 64 KiB mix ran ~14% slower
here (same environment, only the source moved): an A/A run (--base X --new X) read new/base
0.84-0.89 at 64 KiB, every round, and 1.0 at 4 KiB.  The mixes (bench/systems.py
HandleClient.mix) therefore copy from a page-aligned copy of the payload (bench/common.py
page_aligned): the source's place in its page is the same on both sides and in every run.
An A/A run is this harness's control: its medians should sit within a few % of 1 (on a busy
machine single rounds still swing by tens of %).

Writes bench/results/ab.md and ab.json (--out DIR to put them elsewhere); exits 0 when every
judged figure is no worse, 1 when one is worse, undecided or missing, 2 when the harness itself
failed.  The worktree, its build and the
temporary directories are removed whatever happened.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(BENCH_DIR)
DEFAULT_BASE = "d654dfe"  # main before the arena branch
DEFAULT_TIME_SCALE = 4.0  # scenario 3's 1.5 s window -> 6 s, scenario 5's 1 s -> 4 s
THRESHOLD = 0.95  # a 2-core shared machine: run-to-run noise of a few % is normal
RUN_TIMEOUT_S = 900.0
# a scenario's knobs that must be equal on both sides, or the figures are not comparable
CONFIG_KEYS = ("sizes", "s3_", "s5_")
CORE_SOURCES = ("csrc/ucm_core.c", "csrc/ucm_core.h", "csrc/_build.py")


def log(msg: str) -> None:
    print(msg, flush=True)


# ====================================================================== trees


@dataclass
class Tree:
    """One side of the comparison: a source tree with its own package and built C core."""
    side: str                 # "base" or "new"
    path: str
    commit: str
    ref: str = ""             # the git ref asked for ("" for this tree as it is)
    worktree: bool = False    # a temporary worktree of ours: built here, removed at the end
    dirty: bool = False       # uncommitted changes under csrc/ or ucmcache/ (this tree only)
    pkgdir: str = ""          # a directory of ours holding only a link `ucmcache` -> the package
    imports: Dict[str, str] = field(default_factory=dict)
    core_sha: str = ""        # the loaded .so's sha256 when checked: a rebuild mid-A/B shows


def git(*args: str, cwd: str = ROOT) -> str:
    r = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        raise RuntimeError(f"git {' '.join(args)} failed: {r.stderr.strip()}")
    return r.stdout.strip()


def add_worktree(side: str, ref: str, parent: str) -> Tree:
    commit = git("rev-parse", "--verify", f"{ref}^{{commit}}")
    path = os.path.join(parent, side)
    git("worktree", "add", "--detach", path, commit)
    return Tree(side, path, commit, ref=ref, worktree=True)


def remove_worktree(path: str) -> None:
    """--force: the tree holds its build (untracked, ignored files)."""
    try:
        git("worktree", "remove", "--force", path)
    except Exception as e:
        log(f"[ab] git worktree remove failed ({e}); removing the directory and pruning")
        shutil.rmtree(path, ignore_errors=True)
        try:
            git("worktree", "prune")
        except Exception as e2:
            log(f"[ab] git worktree prune failed: {e2}")


def this_tree() -> Tree:
    dirty = bool(git("status", "--porcelain", "--", "csrc", "ucmcache"))
    return Tree("new", ROOT, git("rev-parse", "HEAD"), dirty=dirty)


def make_pkgdir(tree: Tree, parent: str) -> None:
    """A directory holding nothing but a link `ucmcache` -> the tree's package: first on the
    side's PYTHONPATH, it gives that side's ucmcache (and its `_core`) and no `bench`, which comes
    from this tree's root, next on the path.  Removing the directory removes the link only."""
    pkg = os.path.join(tree.path, "ucmcache")
    if not os.path.isfile(os.path.join(pkg, "__init__.py")):
        raise RuntimeError(f"the {tree.side} tree has no ucmcache package: {pkg}")
    tree.pkgdir = os.path.join(parent, f"pkg-{tree.side}")
    os.makedirs(tree.pkgdir)
    os.symlink(pkg, os.path.join(tree.pkgdir, "ucmcache"), target_is_directory=True)


def tree_env(tree: Tree, tmpdir: Optional[str] = None) -> Dict[str, str]:
    """PYTHONPATH = the side's package directory, then this tree's root (for `bench`; its own
    ucmcache comes after the side's and is never reached): an inherited PYTHONPATH could name
    another ucmcache.  The editable install of this tree in .venv is a meta-path finder placed
    after the path finder, so the path wins (check_import verifies it).  TMPDIR inside ours:
    what a run ended from outside leaves in its temporary directory goes with ours."""
    env = dict(os.environ)
    env.pop("PYTHONSAFEPATH", None)  # -P says it; nothing else of the caller's
    env["PYTHONPATH"] = os.pathsep.join([tree.pkgdir, ROOT])
    if tmpdir is not None:
        env["TMPDIR"] = tmpdir
    return env


def side_python(*args: str) -> List[str]:
    """-P: no cwd (or script directory) first on sys.path, where ROOT's own ucmcache would sit
    before the side's (`python -m` puts the cwd first)."""
    return [sys.executable, "-P", *args]


def build_core(tree: Tree, log_path: str) -> None:
    """The same build as the editable install's (setuptools + cffi_modules, an abi3 module), so
    both sides' cffi wrappers are compiled alike."""
    env = dict(os.environ)
    env["PYTHONPATH"] = tree.path
    with open(log_path, "w") as f:
        r = subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace"], cwd=tree.path,
                           env=env, stdout=f, stderr=subprocess.STDOUT, timeout=600)
    if r.returncode != 0:
        raise RuntimeError(f"building the C core of {tree.side} ({tree.path}) failed; "
                           f"log:\n{_tail(log_path)}")


# bench.run and the old design's module (imported by every run's cleanup) import what the
# harness needs of ucmcache at import time: a package too old for this harness fails here, before
# any run, rather than in every run
_IMPORT_CHECK = ("import json, bench, bench.run, bench.systems, bench.baselines.oldlock, ucmcache, "
                 "ucmcache._core as c; print(json.dumps({'bench': bench.__file__, "
                 "'bench_run': bench.run.__file__, 'ucmcache': ucmcache.__file__, "
                 "'core': c.__file__}))")


def check_import(tree: Tree, cwd: str) -> Dict[str, str]:
    """What a run of this side will load, the way it will load it (same interpreter flags,
    environment and a cwd with nothing importable): `bench` must be this tree's harness, the
    package and its .so the side's own, or the comparison compares nothing."""
    r = subprocess.run(side_python("-c", _IMPORT_CHECK), cwd=cwd, env=tree_env(tree),
                       capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        raise RuntimeError(f"import for the {tree.side} side failed: {r.stderr.strip()}")
    got = json.loads(r.stdout.strip().splitlines()[-1])
    want = {"bench": BENCH_DIR, "bench_run": BENCH_DIR, "ucmcache": os.path.join(tree.path,
            "ucmcache"), "core": os.path.join(tree.path, "ucmcache")}
    wrong = {k: v for k, v in got.items()
             if not os.path.realpath(v).startswith(os.path.realpath(want[k]) + os.sep)}
    if wrong:
        raise RuntimeError(f"the {tree.side} side loads files from the wrong tree: "
                           + ", ".join(f"{k} {v} (want under {want[k]})"
                                       for k, v in wrong.items()))
    return {k: os.path.realpath(v) for k, v in got.items()}


def file_sha(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def core_changed(tree: Tree) -> Optional[str]:
    """Why the tree's .so is no longer the one checked at the start (this tree is shared with
    whoever rebuilds it), or None: a run of another build is not a figure of this A/B."""
    try:
        if file_sha(tree.imports["core"]) == tree.core_sha:
            return None
    except OSError as e:
        return f"{tree.imports['core']} cannot be read: {e}"
    return f"{tree.imports['core']} was rebuilt during the A/B: this run is not counted"


def stale_core(tree: Tree) -> Optional[str]:
    """Why the tree's loaded .so is older than its C sources (it would measure the last build,
    not the code in the tree), or None."""
    so_mtime = os.path.getmtime(tree.imports["core"])
    newer = [s for s in CORE_SOURCES
             if os.path.exists(os.path.join(tree.path, s))
             and os.path.getmtime(os.path.join(tree.path, s)) > so_mtime]
    if not newer:
        return None
    return (f"{tree.imports['core']} is older than {', '.join(newer)}: rebuild it "
            f"(.venv/bin/pip install -e . --no-build-isolation, or setup.py build_ext --inplace)")


# ====================================================================== runs


def bench_args(scenarios: str, quick: bool, time_scale: float) -> List[str]:
    """The bench.run arguments of every run, either side."""
    a = ["--scenarios", scenarios, "--repeat", "1", "--systems", "ucmcache", "--no-floor",
         "--no-chart", "--time-scale", f"{time_scale:g}"]
    return a + (["--quick"] if quick else [])


def run_bench(tree: Tree, scenarios: str, quick: bool, time_scale: float, outdir: str,
              log_path: str) -> Tuple[Dict[str, Any], int]:
    """One `python -P -m bench.run` (this tree's harness) with the side's package; returns its
    latest.json and the run's pid.  cwd = the run's own output directory (nothing importable
    there).  The run gets its own session so that a timeout or ^C here ends it and its forked
    workers (one process group, ours) instead of orphaning them."""
    cmd = side_python("-m", "bench.run", *bench_args(scenarios, quick, time_scale),
                      "--out", outdir)
    with open(log_path, "w") as f:
        proc = subprocess.Popen(cmd, cwd=outdir, env=tree_env(tree, outdir), stdout=f,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=RUN_TIMEOUT_S)
        finally:
            if proc.poll() is None:
                _end_group(proc)
            left = sweep_segments(proc.pid)  # a run ended from outside cleans up nothing
            if left:
                log(f"[ab] removed segments the {tree.side} run left in /dev/shm: {left}")
    if rc != 0:
        raise RuntimeError(f"bench.run on {tree.side} exited {rc}; log:\n{_tail(log_path)}")
    with open(os.path.join(outdir, "latest.json")) as f:
        return json.load(f), proc.pid


def _end_group(proc: subprocess.Popen) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)  # the group the run leads: our child and its workers
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=5)
            return
        except subprocess.TimeoutExpired:
            continue


def sweep_segments(pid: int) -> List[str]:
    """Segments of a run that did not clean up (killed): bench names them bench-<its pid>-...,
    so only that run's are touched, never other users' of /dev/shm."""
    mark = f"bench-{pid}-"
    gone = []
    try:
        names = os.listdir("/dev/shm")
    except OSError:
        return gone
    for name in names:
        if mark in name:
            try:
                os.unlink(os.path.join("/dev/shm", name))
                gone.append(name)
            except OSError:
                pass
    return gone


def _tail(path: str, n: int = 30) -> str:
    try:
        with open(path) as f:
            return "".join(f.readlines()[-n:])
    except OSError:
        return "(no log)"


def schedule(rounds: int) -> List[Tuple[int, str]]:
    """(round, side) in run order: base new, new base, base new, ... (the order within a round
    alternates, so neither side always runs first on a machine warming up or loading up)."""
    order = []
    for r in range(rounds):
        pair = ["base", "new"] if r % 2 == 0 else ["new", "base"]
        order += [(r, s) for s in pair]
    return order


# ====================================================================== figures


# (figure id, label, judged); ids are filled per size: s3_2p_4096, s5_65536, ...
def figure_defs(sizes: List[str]) -> List[Tuple[str, str, bool]]:
    defs = []
    for kind, label, judged in (("s3_2p", "3 hit-heavy mix, 2 procs", True),
                                ("s5", "5 churn, 2 procs", True),
                                ("s3_1p", "3 hit-heavy mix, 1 proc", False)):
        for size in sorted(sizes, key=int):
            defs.append((f"{kind}_{size}", f"{label}, {int(size) // 1024} KiB", judged))
    return defs


def extract(res: Dict[str, Any]) -> Dict[str, Dict[str, float]]:
    """ucmcache's ops/s and hit rate per figure of one run's latest.json."""
    out: Dict[str, Dict[str, float]] = {}
    for size, blk in res.get("s3_mix", {}).get("by_size", {}).items():
        u = blk.get("systems", {}).get("ucmcache", {})
        for p in ("1p", "2p"):
            if isinstance(u.get(p), dict) and u[p].get("ops_per_s"):
                out[f"s3_{p}_{size}"] = {"ops_per_s": u[p]["ops_per_s"],
                                         "hit_rate": u[p]["hit_rate"]}
    for size, blk in res.get("s5_churn", {}).get("by_size", {}).items():
        u = blk.get("systems", {}).get("ucmcache", {})
        if u.get("ops_per_s"):
            out[f"s5_{size}"] = {"ops_per_s": u["ops_per_s"], "hit_rate": u["hit_rate"]}
    return out


def config_of(res: Dict[str, Any]) -> Dict[str, Any]:
    cfg = res.get("meta", {}).get("config", {})
    return {k: v for k, v in cfg.items() if k.startswith(CONFIG_KEYS)}


def spread(vals: List[float]) -> Dict[str, Optional[float]]:
    if not vals:
        return {"median": None, "min": None, "max": None, "n": 0}
    return {"median": statistics.median(vals), "min": min(vals), "max": max(vals), "n": len(vals)}


def summarize(runs: List[Dict[str, Any]], rounds: int, threshold: float) -> List[Dict[str, Any]]:
    """One row per figure: each side's ops/s over its runs, the per-round ratios new/base (a
    round without both runs gives no ratio) and the verdict."""
    sizes = sorted({k.rsplit("_", 1)[1] for r in runs for k in r.get("figures", {})}, key=int)
    rows = []
    for fid, label, judged in figure_defs(sizes):
        per = {s: {r["round"]: r["figures"][fid] for r in runs
                   if r["side"] == s and fid in r.get("figures", {})} for s in ("base", "new")}
        if not per["base"] and not per["new"]:
            continue
        ratios = [per["new"][i]["ops_per_s"] / per["base"][i]["ops_per_s"]
                  for i in range(rounds) if i in per["new"] and i in per["base"]]
        rows.append(_row(fid, label, judged, per, ratios, threshold))
    return rows


def verdict_of(judged: bool, rs: Dict[str, Any], threshold: float) -> str:
    """The rule of rule_text.  A median under the threshold while some round has new >= base
    says the rounds disagree (the noise is larger than the effect): that is not shown no worse,
    but not shown worse either, and more rounds (or a quieter machine) decide it.  One round
    alone shows nothing either way (a single run varies by tens of % on a shared machine)."""
    if not judged:
        return "shown, not judged"
    if rs["median"] is None:
        return "MISSING"
    if rs["median"] >= threshold:
        return "no worse"
    if rs["n"] < 2:
        return "UNDECIDED (one round)"
    return "UNDECIDED (rounds disagree)" if rs["max"] >= 1.0 else "WORSE"


def _row(fid: str, label: str, judged: bool, per: Dict[str, Dict[int, Dict[str, float]]],
         ratios: List[float], threshold: float) -> Dict[str, Any]:
    rs = spread(ratios)
    return {
        "figure": fid, "label": label, "judged": judged,
        "verdict": verdict_of(judged, rs, threshold),
        "base_ops_per_s": spread([v["ops_per_s"] for v in per["base"].values()]),
        "new_ops_per_s": spread([v["ops_per_s"] for v in per["new"].values()]),
        "base_hit_rate": spread([v["hit_rate"] for v in per["base"].values()])["median"],
        "new_hit_rate": spread([v["hit_rate"] for v in per["new"].values()])["median"],
        "ratio": rs, "ratios_by_round": [round(x, 4) for x in ratios],
        "rounds_new_ge_base": sum(1 for x in ratios if x >= 1.0),
    }


# ====================================================================== report


def _ops(s: Dict[str, Any]) -> str:
    if s["median"] is None:
        return "—"
    txt = f"{s['median']:,.0f}"
    return txt if s["n"] < 2 else f"{txt} [{s['min']:,.0f}-{s['max']:,.0f}]"


def _ratio(s: Dict[str, Any]) -> str:
    if s["median"] is None:
        return "—"
    txt = f"{s['median']:.3f}"
    return txt if s["n"] < 2 else f"{txt} [{s['min']:.3f}-{s['max']:.3f}]"


def _hr(x: Optional[float]) -> str:
    return "—" if x is None else f"{x:.3f}"


def rule_text(threshold: float) -> str:
    return (f"a figure is **no worse** when the median over the rounds of its per-round ratio "
            f"new/base is >= {threshold:.2f} (a round = one base run and one new run back to back; "
            f"the machine is shared and noisy, so a few % either way is noise); under that, "
            f"**WORSE** when every round (of at least 2) has new < base, else **UNDECIDED** (the "
            f"rounds disagree, or one round: rerun with more --rounds or on a quieter machine)")


def table_lines(rows: List[Dict[str, Any]]) -> List[str]:
    # "rounds new >= base" beside the median: how one-sided the rounds are, which the median
    # alone does not say when single runs vary by tens of %
    L = ["| figure | base ops/s median [min-max] | new ops/s median [min-max] | "
         "new/base: median of per-round ratios [min-max] | rounds new >= base | verdict | "
         "hit rate base → new |",
         "|---|---:|---:|---:|---:|---|---|"]
    for r in rows:
        L.append(f"| {r['label']} | {_ops(r['base_ops_per_s'])} | {_ops(r['new_ops_per_s'])} | "
                 f"{_ratio(r['ratio'])} | {r['rounds_new_ge_base']}/{r['ratio']['n']} | "
                 f"{r['verdict']} | {_hr(r['base_hit_rate'])} → {_hr(r['new_hit_rate'])} |")
    return L


def _side_name(side: Dict[str, Any]) -> str:
    if side["tree"] == "temporary worktree":
        return f"{side['ref']}, built in a temporary worktree"
    return "this tree" + (", with uncommitted changes under csrc/ or ucmcache/"
                          if side["dirty"] else "")


def markdown(doc: Dict[str, Any]) -> str:
    m = doc["meta"]
    base, new = m["base"], m["new"]
    L = [f"# A/B: {_side_name(new)} vs {base['ref']} (scenarios {m['scenarios']})", ""]
    if m["quick"]:
        L += ["**Quick run (`--quick`): tiny sizes, checks the harness; the numbers mean little.**",
              ""]
    L += [f"Base: `{base['commit'][:12]}` ({base['ref']}), built in a temporary worktree. "
          f"New: `{new['commit'][:12]}` ({_side_name(new)}).",
          f"{m['rounds']} round(s) of `python -P -m bench.run "
          f"{' '.join(bench_args(m['scenarios'], m['quick'], m['time_scale']))}` per side, run "
          f"order {' '.join(s for _, s in schedule(m['rounds']))}; both sides run this tree's "
          f"bench harness (bench/run.py, systems.py, ...), only the `ucmcache` package and its "
          f"C core differ. Measurement windows: scenario 3 {m.get('s3_time_s')} s, scenario 5 "
          f"{m.get('s5_time_s')} s per figure (--time-scale {m['time_scale']:g}).",
          "", "Rule: " + rule_text(m["threshold"]) + ". Scenario 3's 1-process figures are shown, "
          "not judged.", "", f"**Overall: {doc['verdict']}**", ""]
    L += table_lines(doc["rows"])
    L += ["", "Per run (ops/s):", "",
          "| round | side | load before | " + " | ".join(r["label"] for r in doc["rows"]) + " |",
          "|---:|---|---|" + "---:|" * len(doc["rows"])]
    for run in doc["runs"]:
        figs = run.get("figures", {})
        cells = [f"{figs[r['figure']]['ops_per_s']:,.0f}" if r["figure"] in figs else
                 ("error" if run.get("error") else "—") for r in doc["rows"]]
        L.append(f"| {run['round'] + 1} | {run['side']} | {run.get('load_before')} | "
                 + " | ".join(cells) + " |")
    errs = [r for r in doc["runs"] if r.get("error")]
    if errs:
        L += ["", "Errors:", ""] + [f"- round {r['round'] + 1} {r['side']}: "
                                     f"{r['error'].splitlines()[0]}" for r in errs]
    if m.get("warnings"):
        L += ["", "Warnings:", ""] + [f"- {w}" for w in m["warnings"]]
    L += ["", f"{m['cores']} cores, load {m['load_before']} before, {m['load_after']} after; "
          f"{m['wall_s']} s in all ({m['started']}).", "",
          f"Rerun: `{m['command']}`", ""]
    return "\n".join(L)


def write_atomic(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


# ====================================================================== main


def parse(argv: Optional[List[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.ab", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", default=DEFAULT_BASE,
                   help=f"the base git ref (default {DEFAULT_BASE})")
    p.add_argument("--new", default=None,
                   help="a git ref to measure instead of this tree as it is (built in a "
                        "temporary worktree too; for a tree others are editing)")
    p.add_argument("--rounds", type=int, default=None,
                   help="rounds of one base and one new run (default 3; --quick: 1)")
    p.add_argument("--scenarios", default="3,5", help="comma list of 3 and/or 5 (default 3,5)")
    p.add_argument("--quick", action="store_true", help="bench.run --quick (tiny sizes)")
    p.add_argument("--time-scale", type=float, default=DEFAULT_TIME_SCALE,
                   help="bench.run --time-scale: multiplies scenarios 3 and 5's measurement "
                        f"windows (default {DEFAULT_TIME_SCALE:g}: 6 s and 4 s per figure)")
    p.add_argument("--threshold", type=float, default=THRESHOLD,
                   help=f"lowest median ratio new/base counted as no worse (default {THRESHOLD})")
    p.add_argument("--out", default=os.path.join(BENCH_DIR, "results"),
                   help="directory for ab.md / ab.json")
    return p.parse_args(argv)


def prepare(trees: List[Tree], tmp: str, warnings: List[str]) -> None:
    empty = os.path.join(tmp, "cwd-check")  # a cwd with nothing importable
    os.makedirs(empty, exist_ok=True)
    for t in trees:
        if t.worktree:
            t0 = time.monotonic()
            build_core(t, os.path.join(tmp, f"build-{t.side}.log"))
            log(f"[ab] built the {t.side} side's C core in {time.monotonic() - t0:.1f} s")
        make_pkgdir(t, tmp)
        t.imports = check_import(t, empty)
        t.core_sha = file_sha(t.imports["core"])
        log(f"[ab] {t.side}: {t.commit[:12]} imports {t.imports['ucmcache']}, "
            f"{t.imports['core']}; harness {t.imports['bench_run']}")
        why = stale_core(t)
        if why:
            raise RuntimeError(f"the {t.side} tree's C core is stale: {why}")
        if t.dirty:
            warnings.append("the new tree has uncommitted changes under csrc/ or ucmcache/: "
                            "the figures are of the tree as it was, not of a commit")


def run_all(trees: Dict[str, Tree], args: argparse.Namespace, rounds: int,
            tmp: str) -> List[Dict[str, Any]]:
    runs = []
    order = schedule(rounds)
    for i, (rnd, side) in enumerate(order):
        outdir = os.path.join(tmp, f"r{rnd}-{side}")
        os.makedirs(outdir)
        rec: Dict[str, Any] = {"round": rnd, "side": side, "load_before": _loadavg()}
        t0 = time.monotonic()
        try:
            res, pid = run_bench(trees[side], args.scenarios, args.quick, args.time_scale,
                                 outdir, os.path.join(tmp, f"r{rnd}-{side}.log"))
            changed = core_changed(trees[side])  # after the run: it may have loaded either
            if changed:
                raise RuntimeError(changed)
            rec["figures"] = extract(res)
            rec["config"] = config_of(res)
            rec["pid"] = pid
        except (RuntimeError, OSError, ValueError, subprocess.SubprocessError) as e:
            rec["error"] = f"{type(e).__name__}: {e}"  # costs its round's ratio, not the others
        rec["wall_s"] = round(time.monotonic() - t0, 1)
        runs.append(rec)
        figs = ", ".join(f"{k} {v['ops_per_s']:,.0f}"
                         for k, v in sorted(rec.get("figures", {}).items()))
        log(f"[ab] run {i + 1}/{len(order)} round {rnd + 1} {side:<4} ({rec['wall_s']} s, load "
            f"{rec['load_before']}): {figs or 'ERROR ' + rec.get('error', '')}")
    return runs


def config_warnings(runs: List[Dict[str, Any]]) -> List[str]:
    cfg = {r["side"]: r["config"] for r in runs if "config" in r}
    if len(cfg) == 2 and cfg["base"] != cfg["new"]:
        diff = sorted(k for k in set(cfg["base"]) | set(cfg["new"])
                      if cfg["base"].get(k) != cfg["new"].get(k))
        return [f"the two sides' runs configured scenarios 3/5 differently: {diff}"]
    return []


def _loadavg() -> List[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def side_meta(t: Tree) -> Dict[str, Any]:
    return {"ref": t.ref or None, "commit": t.commit, "tree": "temporary worktree" if t.worktree
            else t.path, "dirty": t.dirty, "ucmcache": t.imports.get("ucmcache"),
            "core": t.imports.get("core"), "core_sha256": t.core_sha,
            "harness": t.imports.get("bench_run")}


def overall(verdicts: List[str]) -> str:
    if not verdicts or any(v in ("WORSE", "MISSING") for v in verdicts):
        return "WORSE (or a figure missing)"
    return "no worse" if all(v == "no worse" for v in verdicts) else "UNDECIDED"


def busy_warnings(runs: List[Dict[str, Any]], cores: int) -> List[str]:
    """A 1-minute load above the core count while the runs ran: other work shared the cores,
    which is where most of the spread comes from."""
    loads = [r["load_before"][0] for r in runs if r.get("load_before")]
    if loads and max(loads) > cores:
        return [f"the machine was busy: 1-minute load up to {max(loads)} on {cores} cores before "
                f"the runs (other processes shared the cores; the figures are noisy)"]
    return []


def main(argv: Optional[List[str]] = None) -> int:
    args = parse(argv)
    rounds = args.rounds if args.rounds is not None else (1 if args.quick else 3)
    scen = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    if rounds < 1 or not scen or any(s not in ("3", "5") for s in scen):
        print("--rounds must be >= 1 and --scenarios a comma list of 3 and/or 5", file=sys.stderr)
        return 2
    if not args.time_scale > 0:  # also refuses nan
        print("--time-scale must be > 0", file=sys.stderr)
        return 2
    args.scenarios = ",".join(scen)
    args_txt = " ".join(argv if argv is not None else sys.argv[1:])
    t_start = time.monotonic()
    meta: Dict[str, Any] = {
        "command": ".venv/bin/python -m bench.ab" + (" " + args_txt if args_txt else ""),
        "started": time.strftime("%Y-%m-%d %H:%M:%S %z"), "quick": args.quick,
        "rounds": rounds, "scenarios": args.scenarios, "threshold": args.threshold,
        "time_scale": args.time_scale, "harness": "this tree's bench/ (both sides)",
        "cores": os.cpu_count(), "load_before": _loadavg(),
        "python": platform.python_version(), "platform": platform.platform(), "warnings": []}
    # a plain SIGTERM would end us without running the finally blocks (worktrees, temporary
    # directories and the running bench's process group would stay behind)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    tmp = tempfile.mkdtemp(prefix="ucmab-")
    made: List[Tree] = []  # worktrees to remove, whatever happens
    try:
        base = add_worktree("base", args.base, tmp)
        made.append(base)
        new = add_worktree("new", args.new, tmp) if args.new else this_tree()
        if new.worktree:
            made.append(new)
        for t in (base, new):
            where = f"{t.ref} in {t.path}" if t.worktree else f"this tree {t.path}"
            log(f"[ab] {t.side}: {where} ({t.commit[:12]}{', dirty' if t.dirty else ''})")
        prepare([base, new], tmp, meta["warnings"])
        runs = run_all({"base": base, "new": new}, args, rounds, tmp)
    except (RuntimeError, subprocess.SubprocessError, OSError) as e:
        log(f"[ab] FAILED: {e}")
        return 2
    finally:
        for t in made:
            remove_worktree(t.path)
        shutil.rmtree(tmp, ignore_errors=True)
    meta["warnings"] += config_warnings(runs) + busy_warnings(runs, os.cpu_count() or 1)
    cfg = next((r["config"] for r in runs if r.get("config")), {})
    meta["s3_time_s"], meta["s5_time_s"] = cfg.get("s3_time"), cfg.get("s5_time")
    meta["base"] = side_meta(base)
    meta["new"] = side_meta(new)
    meta["load_after"] = _loadavg()
    meta["wall_s"] = round(time.monotonic() - t_start, 1)
    rows = summarize(runs, rounds, args.threshold)
    verdict = overall([r["verdict"] for r in rows if r["judged"]])
    doc = {"meta": meta, "rule": rule_text(args.threshold).replace("**", ""),
           "verdict": verdict, "rows": rows, "runs": runs}
    os.makedirs(args.out, exist_ok=True)
    write_atomic(os.path.join(args.out, "ab.json"), json.dumps(doc, indent=1, default=str))
    write_atomic(os.path.join(args.out, "ab.md"), markdown(doc))
    log("")
    log("Rule: " + doc["rule"])
    for line in table_lines(rows):
        log(line)
    log(f"Overall: {doc['verdict']}")
    for w in meta["warnings"]:
        log(f"warning: {w}")
    log(f"wrote {os.path.join(args.out, 'ab.md')}, ab.json in {meta['wall_s']} s")
    return 0 if verdict == "no worse" else 1


if __name__ == "__main__":
    sys.exit(main())
