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
    metrics UUID (--once | --port P) the Prometheus text format, printed once or served
    tier ls|verify|trim PATH         a disk tier directory: its blocks and counters, check
                                     every file, remove least recently used ones
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
           "arenas": [int, ...],    # the arenas it owns (it allocates only in those)
           "arena_slots": int,      # their slots
           "slots_used": int,       # slots of its arenas holding a current entry or a load
           "pins": int,             # slots it pins now
           "claims": int,           # slots it has claimed now
           "ring": {"depth": int, "posted": int, "dropped": int,     # its prefetch ring
                    "already_present": int},
           "counters": {name: int, ...}}],   # gets, hits, misses, loads_started, t2_hits, ...
      "arenas": {"count": int, "slots_each": int,   # the last may have fewer
                 "free": int},      # owned by no rank
      "totals": {name: int, ...},   # counters summed over ranks
      "stuck": {"pins": int, "claims": int, "loading": int,   # holds of ranks that are dead
                "items": [{"slot": int, "kind": "pin" | "claim" | "loading", "rank": int},
                          ...]},    # the first 100
      "problems": [str, ...],       # ucmcache.verify's list
      "ok": bool,                   # problems is empty
      "tiers": {"disk:<path>": {    # only with --tier PATH (each given)
          "tier": str, "path": str, "format_version": int,
          "capacity_bytes": int | None, # recorded in the directory when it was made
          "files": int, "bytes": int,   # block files found by a scan, their bytes
          "usage_bytes": int,           # the tier's shared usage record
          "counters": {"t2_hits": int, ...}}}   # summed over every process that used it
    }

``ls --json`` gives a list of objects: ``uuid``, ``path``, ``status``, ``size`` (file bytes),
``uid``, ``layout_version``, ``params`` ({max_ranks, slots_per_rank, slot_size, n_buckets,
n_stripes} or null when unknown), ``live_ranks``, ``dead_ranks``, ``live_pids`` (lists),
``generation``, ``entries``, ``slots``, ``occupancy`` (entries / slots) (null unless made) and
``error`` (str or null).

The package: _facts gathers from a segment (the dicts above), _render turns them into the human
forms, _commands runs the commands (argument parsing and main).
"""
from ._commands import build_parser, main
from ._facts import CliError, inspect_facts, ls_row

__all__ = ["main", "build_parser", "CliError", "inspect_facts", "ls_row"]
