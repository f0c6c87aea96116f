"""The package's layers, read from every module's imports (ast, nothing imported): arrows run only
downward.  The core (ucmcache/core/) imports nothing of the tiers, engines, CLI or the package's
top modules, only the C extensions (the tier interface the cache calls is the core's own,
ucmcache/core/tier.py, which the tiers implement); a tier imports the core and the tiers'
shared modules (breaker, write_through), never another tier or an engine; an engine imports no
tier.
Every import is counted, at any depth (a lazy import inside a function is an arrow too)."""
import ast
import os
import re

import pytest

PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
    __file__)))), "ucmcache")
EXTENSIONS = {"ucmcache._core", "ucmcache._hit", "ucmcache._crc"}
TOP = {"ucmcache", "ucmcache.__main__", "ucmcache.lowlevel", "ucmcache.metrics", "ucmcache.demo"}
SHARED_TIER = {"ucmcache.tiers", "ucmcache.tiers.breaker", "ucmcache.tiers.write_through"}


def modules(package=PACKAGE):
    """{dotted name: (path, is a package)} of every .py/.pyi module under the package."""
    found = {}
    root = os.path.dirname(package)
    for folder, dirs, files in os.walk(package):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        for name in files:
            if not name.endswith((".py", ".pyi")):
                continue
            path = os.path.join(folder, name)
            dotted = os.path.relpath(path, root).rsplit(".", 1)[0].replace(os.sep, ".")
            is_pkg = dotted.endswith(".__init__")
            found[dotted[: -len(".__init__")] if is_pkg else dotted] = (path, is_pkg)
    return found


def layer(mod):
    """The layer a module belongs to: core, a tiers' shared piece, one tier
    (disk, redis: the old package paths are the same tiers), engine, cli, extension, top."""
    if mod in EXTENSIONS:
        return "extension"
    if mod in SHARED_TIER:
        return "tiers"
    for old, tier in (("ucmcache.tiers.disk", "tier disk"), ("ucmcache.disktier", "tier disk"),
                      ("ucmcache.tiers.redis", "tier redis"), ("ucmcache.tier2", "tier redis")):
        if mod == old or mod.startswith(old + "."):
            return tier
    if mod.startswith("ucmcache.cli"):
        return "cli"
    if (mod.startswith("ucmcache.engines") or mod in ("ucmcache.vllm", "ucmcache.ucm")
            or re.match(r"ucmcache\._(vllm|ucm)_", mod)):
        return "engine"
    if mod in TOP:
        return "top"
    return "core"   # ucmcache/core/, and a flat protocol module (ucmcache/_x.py) where one is


def imports(mod, path, is_pkg, known):
    """The package's modules that `mod` imports: each `from P import n` names P.n where that is
    a module, else P; relative imports resolved against mod's package."""
    tree = ast.parse(open(path).read(), path)
    here = mod.split(".") if is_pkg else mod.split(".")[:-1]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[: len(here) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for a in node.names:
                sub = f"{target}.{a.name}"
                out.add(sub if sub in known or sub in EXTENSIONS else target)
    return {m for m in out if m == "ucmcache" or m.startswith("ucmcache.")}


def wrong_arrows(package=PACKAGE):
    """Every import that runs against the layers, as 'importer -> imported: why'."""
    known = modules(package)
    wrong = []
    for mod, (path, is_pkg) in sorted(known.items()):
        mine = layer(mod)
        for target in sorted(imports(mod, path, is_pkg, known)):
            theirs = layer(target)
            why = None
            if mine == "core" and theirs not in ("core", "extension"):
                why = f"the core imports the {theirs} layer"
            elif mine == "tiers" and theirs not in ("core", "extension", "tiers"):
                why = f"a tiers' shared module imports the {theirs} layer"
            elif mine.startswith("tier ") and theirs not in (
                    "core", "extension", "tiers", mine):
                why = f"the {mine[5:]} tier imports the {theirs} layer"
            elif mine == "engine" and (theirs.startswith("tier") or theirs in ("cli", "top")):
                why = f"an engine imports the {theirs} layer"
            if why:
                wrong.append(f"{mod} -> {target}: {why}")
    return wrong


def test_arrows_run_only_downward():
    assert wrong_arrows() == []


def test_every_layer_is_found():
    """The check reads the package it should: each layer has modules, so a rename that the
    layer() table misses does not pass an empty check."""
    found = {layer(m) for m in modules()}
    assert {"core", "tiers", "tier disk", "tier redis", "engine", "cli",
            "top"} <= found, found


@pytest.mark.parametrize("arrow,why", [
    ("from ..tiers.disk.tier import DiskTier", "the core imports the tier disk layer"),
    ("from .. import vllm", "the core imports the engine layer"),
    ("def f():\n    from ..cli import main", "the core imports the cli layer"),
    ("from ..metrics import serve", "the core imports the top layer"),
])
def test_an_upward_arrow_is_found(tmp_path, arrow, why):
    """The check fails where it should: a core module that imports up (at once or lazily)."""
    pkg = tmp_path / "ucmcache"
    for sub in ("core", "tiers", "tiers/disk", "cli"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "vllm.py").write_text("")
    (pkg / "metrics.py").write_text("")
    (pkg / "tiers" / "disk" / "tier.py").write_text("")
    (pkg / "core" / "cache.py").write_text(arrow + "\n")
    assert [w.split(": ", 1)[1] for w in wrong_arrows(str(pkg))] == [why]


def test_one_tier_importing_another_is_found(tmp_path):
    """disk -> redis (as ucmcache/disktier/tier.py imported tier2.breaker) is a wrong arrow;
    disk -> the shared breaker is not."""
    pkg = tmp_path / "ucmcache"
    for sub in ("tiers", "tiers/disk", "tiers/redis"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "tiers" / "breaker.py").write_text("")
    (pkg / "tiers" / "redis" / "client.py").write_text("")
    (pkg / "tiers" / "disk" / "tier.py").write_text(
        "from ..breaker import Breaker\nfrom ..redis.client import RedisTier\n")
    assert wrong_arrows(str(pkg)) == [
        "ucmcache.tiers.disk.tier -> ucmcache.tiers.redis.client: the disk tier imports the "
        "tier redis layer"]
