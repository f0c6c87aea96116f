"""The `ucmcache` command's usage and bad input: every command has help, usage errors exit 2 in
one line, unknown or malformed uuids, segments that are not ucmcache's, half made or
incompatible, create's mode, non-file entries in /dev/shm; bench and demo get their arguments;
`python -m ucmcache` is the command."""
import json
import os
import re
import subprocess
import sys
import types

import pytest

from cli_helpers import (CREATE, VERSION, assert_fits, assert_one_error_line,  # noqa: F401
                         ls_json, make_half_made, make_incompatible, make_not_ucmcache,
                         make_orphan, names, path_of, run)
from ucmcache import cli
from ucmcache.cli import _commands


# ------------------------------------------------------------------------- usage, bad input
# The matrices run main() in this process (same code, same streams, no interpreter start-up);
# one case of each kind also runs as a subprocess, where "never a traceback" is really at stake.

@pytest.fixture
def call(capsys):
    def call(*args):
        try:
            rc = cli.main([str(a) for a in args])
        except SystemExit as e:         # argparse: --help (0) and usage errors (2)
            rc = e.code
        out, err = capsys.readouterr()
        return subprocess.CompletedProcess(args, rc, out, err)
    return call


@pytest.mark.parametrize("command", ["ls", "inspect", "watch", "verify", "recover", "rm", "gc",
                                     "create"])
def test_every_command_has_help(command, call):
    r = call(command, "--help")
    assert r.returncode == 0 and r.stdout.startswith("usage: ucmcache " + command), r.stderr
    assert_fits(r.stdout)


def test_usage_errors_exit_2(call):
    r = run()
    assert_one_error_line(r, 2, r"the following arguments are required: COMMAND")
    for argv in (["frobnicate"], ["inspect"], ["watch", "x", "--interval", "zero"],
                 ["create", "x", "--slot-size", "64"]):
        assert_one_error_line(call(*argv), 2, r"--help` shows the usage\)$")


@pytest.mark.parametrize("argv", [["inspect"], ["inspect", "--json"], ["watch"], ["verify"],
                                  ["recover"], ["rm"], ["rm", "--force"]])
def test_unknown_or_malformed_uuid_is_one_line_exit_2(argv, names, call):
    missing = names("missing")
    r = call(*argv[:1], missing, *argv[1:])
    assert_one_error_line(r, 2, rf"^ucmcache: error: no ucmcache segment '{missing}'")
    r = call(*argv[:1], "../etc/passwd", *argv[1:])
    assert_one_error_line(r, 2, r"uuid must match")


def test_unknown_uuid_as_a_subprocess(names):
    missing = names("missing")
    assert_one_error_line(run("inspect", missing), 2,
                          rf"^ucmcache: error: no ucmcache segment '{missing}' "
                          rf"\({re.escape(path_of(missing))} does not exist\)$")


def test_not_a_ucmcache_segment_and_another_users_segment(names, call):
    alien, theirs = names("alien"), names("theirs")
    make_not_ucmcache(alien)
    not_ours = r"is not a ucmcache segment \(magic 0x123456789abcdef0"
    assert_one_error_line(run("inspect", alien), 2, not_ours)
    for argv in (["verify", alien], ["recover", alien], ["watch", alien, "--count", "1"]):
        assert_one_error_line(call(*argv), 2, not_ours)
    assert ls_json()[alien]["status"] == "corrupt"
    if os.getuid() != 0:
        pytest.skip("making another user's segment needs root")
    make_orphan(theirs)
    os.chown(path_of(theirs), 65534, 65534)
    assert_one_error_line(run("inspect", theirs), 2, r"belongs to uid 65534")
    for argv in (["verify", theirs], ["rm", theirs], ["rm", theirs, "--force"]):
        assert_one_error_line(call(*argv), 2, r"belongs to uid 65534")
    assert os.path.exists(path_of(theirs))
    assert ls_json()[theirs]["status"] == "foreign"
    assert call("gc", "--prefix", names.prefix).returncode == 0
    assert os.path.exists(path_of(theirs)) and os.path.exists(path_of(alien))


def test_half_made_and_incompatible_are_problems_exit_1(names):
    half, old = names("half"), names("old")
    make_half_made(half)
    make_incompatible(old)
    assert_one_error_line(run("inspect", half), 1, r"is half-made: its creator \(pid \d+\) died")
    assert_one_error_line(run("verify", half), 1, r"half-made")
    assert_one_error_line(run("inspect", old, "--json"), 1, r"layout version 99, this ucmcache "
                                                            rf"reads version {VERSION}$")
    assert_one_error_line(run("verify", old), 1, r"layout version 99")


def test_help_texts_print_percent_signs_once():
    r = run("watch", "--help")
    assert r.returncode == 0 and "hit %," in r.stdout and "%%" not in r.stdout


def test_metrics_port_out_of_range_is_one_line_exit_2(names):
    u = names()
    make_orphan(u)
    for port in (99999, 0, -1):
        assert_one_error_line(run("metrics", u, "--port", port), 2,
                              rf"--port must be a TCP port from 1 to 65535, got {port}")


def test_bench_passes_arguments_through(tmp_path, monkeypatch, capsys):
    script = tmp_path / "run.py"
    out = tmp_path / "argv.json"
    script.write_text(f"import json, sys\njson.dump(sys.argv[1:], open({str(out)!r}, 'w'))\n"
                      "sys.exit(3)\n")
    monkeypatch.setattr(_commands, "bench_script", lambda: script)
    assert cli.main(["bench", "--quick", "x"]) == 3
    assert json.loads(out.read_text()) == ["--quick", "x"]
    monkeypatch.setattr(_commands, "bench_script", lambda: tmp_path / "missing" / "run.py")
    assert cli.main(["bench"]) == 2
    assert re.fullmatch(r"ucmcache: error: the benchmarks are not available: \S+ does not "
                        r"exist \(they ship with the source tree, not with an installed package: "
                        r"run \./scripts/bench in a checkout of the repository\)\n",
                        capsys.readouterr().err)


def test_demo_is_imported_late_and_gets_its_arguments(monkeypatch, capsys):
    seen = []
    fake = types.ModuleType("ucmcache.demo")
    fake.main = lambda argv: seen.append(argv) or 5
    monkeypatch.setitem(sys.modules, "ucmcache.demo", fake)
    assert cli.main(["demo", "--help"]) == 5 and seen == [["--help"]]
    monkeypatch.setitem(sys.modules, "ucmcache.demo", None)     # as if not installed
    assert cli.main(["demo"]) == 2
    assert capsys.readouterr().err == ("ucmcache: error: the demo is not available: this "
                                       "ucmcache has no ucmcache.demo module\n")


USAGE = r" \(`ucmcache{sub} --help` shows the usage\)$"


@pytest.mark.parametrize("argv, pattern", [
    ([], r"^ucmcache: error: the following arguments are required: COMMAND" + USAGE.format(sub="")),
    (["frobnicate"], r"^ucmcache: error: argument COMMAND: invalid choice: 'frobnicate' \(choose "
                     r"from 'ls', .*\)" + USAGE.format(sub="")),
    (["inspect"], r"^ucmcache: error: the following arguments are required: UUID" +
                  USAGE.format(sub=" inspect")),
    (["rm", "--forse", "x"], r"^ucmcache: error: unrecognized arguments: --forse"),
    (CREATE + ["--mode", "7777"], r"^ucmcache: error: argument --mode: must be octal permission "
                                  r"bits from 0 to 777 \(like 600\), got '7777'" +
                                  USAGE.format(sub=" create")),
], ids=["no command", "unknown command", "missing uuid", "unknown option", "bad mode"])
def test_usage_errors_are_one_line(argv, pattern, names):
    """Run as a subprocess: stderr holds exactly one line, nothing else (no usage block)."""
    if argv[:1] == ["create"]:
        u = names("bad-mode")
        argv = argv[:1] + [u] + argv[1:]
    r = run(*argv)
    assert_one_error_line(r, 2, pattern)
    assert r.stdout == ""
    if argv[:1] == ["create"]:
        assert not os.path.lexists(path_of(u))


@pytest.mark.parametrize("mode", ["7777", "4755", "1777", "2700", "1000", "-1", "rw", "0x1ff",
                                  "", "8"])
def test_create_mode_is_permission_bits_only(mode, names, call):
    u = names("mode")
    r = call(CREATE[0], u, *CREATE[1:], f"--mode={mode}")
    assert_one_error_line(r, 2, r"^ucmcache: error: argument --mode: must be octal permission "
                                rf"bits from 0 to 777 \(like 600\), got {re.escape(repr(mode))}")
    assert not os.path.lexists(path_of(u))          # refused before any file was made


def test_non_file_entries_are_foreign_never_collected_and_refused(names, call):
    """Anyone can mkdir /dev/shm/ucmcache-x: ls shows it (and every real segment), gc keeps it,
    and commands naming it refuse it in one line."""
    idle = names("idle")
    make_orphan(idle)               # created and closed: idle, which gc --idle removes
    strays = {names.prefix + "dir": "directory", names.prefix + "fifo": "FIFO",
              names.prefix + "link": "symbolic link"}
    try:
        for u, kind in strays.items():
            {"directory": os.mkdir, "FIFO": os.mkfifo,
             "symbolic link": lambda p: os.symlink(path_of(idle), p)}[kind](path_of(u))
        rows = ls_json()
        assert rows[idle]["status"] == "idle"
        for u, kind in strays.items():
            assert rows[u]["status"] == "foreign"
            assert rows[u]["error"] == (f"a {kind}, not a shared-memory file: not a ucmcache "
                                        "segment")
        r = run("ls")
        assert r.returncode == 0 and r.stderr == "", r.stderr
        assert_fits(r.stdout)
        shown = {line.split()[0]: line.split()[1] for line in r.stdout.splitlines()[1:]
                 if line.startswith(names.prefix)}
        assert shown == {idle: "idle", **{u: "foreign" for u in strays}}
        for u, kind in strays.items():
            named = re.escape(f"segment {u!r}: {path_of(u)} is a {kind}, not a shared-memory "
                              "file, so not a ucmcache segment; refusing to use it")
            for argv in (["inspect", u], ["verify", u], ["recover", u], ["rm", u],
                         ["rm", u, "--force"]):
                assert_one_error_line(call(*argv), 2, rf"^ucmcache: error: {named}$")
        r = call("gc", "--prefix", names.prefix, "--idle")
        assert (r.returncode, r.stdout) == (0, f"removed {idle} (idle)\n"), r
        assert not os.path.lexists(path_of(idle))
        assert all(os.path.lexists(path_of(u)) for u in strays)
    finally:
        for u in strays:
            p = path_of(u)
            if os.path.isdir(p) and not os.path.islink(p):
                os.rmdir(p)
            elif os.path.lexists(p):
                os.unlink(p)


def test_python_dash_m_ucmcache_is_the_command():
    r = subprocess.run([sys.executable, "-m", "ucmcache", "--help"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.startswith("usage: ucmcache "), r.stdout + r.stderr
    r = subprocess.run([sys.executable, "-m", "ucmcache", "inspect", "../x"],
                       capture_output=True, text=True, timeout=60)
    assert_one_error_line(r, 2, r"uuid must match")
