"""The docs state each fact of the code once, and a drifted one fails here.

README.md, docs/ and bench/README.md are checked against what the code declares:
- the five layout tables (generated from the built core by scripts/gen-docs: up to date);
- prose facts: "at most N ranks", "max_ranks <= N", "N-byte `SlotMeta`";
- every "`UCM_NAME` = N", "N (UCM_NAME)" and "N bytes (UCM_NAME)" against csrc/ucm_core.h's value
  (cffi's ``lib``), and every "layout version N";
- the worked example of a layout (section 2) against ``Layout.compute``;
- the Prometheus counter names against ``ucmcache.metrics.COUNTER_METRICS`` and the disk tier's
  counter families;
- every ``UCM_*`` name the docs use (still in csrc/) and every ``t2_*`` counter (still counted);
- every repository path named in backquotes (csrc/, scripts/, tests/, ...) exists;
- what the code cites of the docs: each docs/ page it names, each "DESIGN 4.12" a heading;
- SlotCache's module docstring names every mixin module;
- every relative link (a file that exists; a ``#anchor`` that is a heading of its page).
docs/history.md is left out of the value checks: it states what earlier versions had.

Each checker returns the problems it found in a tree; the tests run it on this repository (no
problem) and on a copy in a temporary directory with one fact drifted (the problem is named),
so a checker that cannot fail fails here.
"""
import importlib.util
import pathlib
import re
import shutil

import pytest

from ucmcache.lowlevel import Layout, lib


def _root() -> pathlib.Path:
    here = pathlib.Path(__file__).resolve()
    for parent in here.parents:
        if (parent / "csrc" / "ucm_core.h").is_file() and (parent / "docs").is_dir():
            return parent
    raise RuntimeError(f"no repository root above {here}")


ROOT = _root()
HISTORY = "docs/history.md"


def _gen_docs():
    spec = importlib.util.spec_from_file_location("gen_docs", ROOT / "scripts" / "gen_docs.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def doc_files(root: pathlib.Path):
    """Every page a reader may follow: README.md, docs/**/*.md, bench/README.md."""
    files = [root / "README.md", root / "bench" / "README.md"]
    files += sorted((root / "docs").rglob("*.md"))
    return [f for f in files if f.is_file()]


def _prose(text: str) -> str:
    """The text without fenced code blocks (links and statements there are not the page's)."""
    return re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)


def _number(s: str) -> int:
    return int(s, 16) if s.lower().startswith("0x") else int(s.replace(",", ""))


# -- the checkers ----------------------------------------------------------------------------


def generated_table_problems(root: pathlib.Path):
    gen = _gen_docs()
    out = []
    for page in gen.pages(root):
        _, changed = gen.regenerate(page.read_text())
        out += [f"{page.relative_to(root)}: generated table {t} is out of date "
                f"(run scripts/gen-docs)" for t in changed]
    if not any("gen-docs: table" in p.read_text() for p in doc_files(root)):
        out.append("no generated layout table in docs/")
    return out


AFTER_NAME = re.compile(r"`(UCM_[A-Z0-9_]+)`? ?(?:=|\() ?(0x[0-9a-fA-F]+|[0-9][0-9,]*)\b(?![.*^<\w])")
NAME_BARE = re.compile(r"`(UCM_[A-Z0-9_]+)` (0x[0-9a-fA-F]+|[0-9][0-9,]*)\b(?![.*^<\w])")
BEFORE_NAME = re.compile(r"\b([0-9][0-9,]*)(?: bytes(?: each)?)? \(`?(UCM_[A-Z0-9_]+)`?\)")
# facts said in words: (pattern whose group 1 is the number, the constant it states)
PROSE = [
    (re.compile(r"layout version (\d+)", re.I), "UCM_LAYOUT_VERSION"),
    (re.compile(r"at most (\d+) ranks", re.I), "UCM_MAX_RANKS"),
    (re.compile(r"max_ranks <= (\d+)"), "UCM_MAX_RANKS"),
    (re.compile(r"\(at most (\d+);"), "UCM_MAX_RANKS"),
    (re.compile(r"(\d+)-byte `SlotMeta`"), "UCM_META_SIZE"),
]


def constant_problems(root: pathlib.Path):
    out = []
    for f in doc_files(root):
        rel = str(f.relative_to(root))
        if rel == HISTORY:
            continue
        text = f.read_text()
        found = [(m[1], m[2]) for m in AFTER_NAME.finditer(text)]
        found += [(m[1], m[2]) for m in NAME_BARE.finditer(text)]
        found += [(m[2], m[1]) for m in BEFORE_NAME.finditer(text)]
        found += [(name, m[1]) for pattern, name in PROSE for m in pattern.finditer(text)]
        for name, said in found:
            value = getattr(lib, name, None)
            if isinstance(value, int) and _number(said) != value:
                out.append(f"{rel}: says {name} is {said}; csrc/ucm_core.h has {value}")
    return out


def name_problems(root: pathlib.Path, disk_counters, stats_keys):
    """Names the docs use that the code must still have: every ``UCM_*`` (a name of csrc/), and
    every ``t2_*`` counter (a key of a segment's stats(), or one of the disk tier's)."""
    c_names = set()
    for src in (root / "csrc").glob("*.[ch]"):
        c_names |= set(re.findall(r"\bUCM_[A-Z0-9_]+\b", src.read_text()))
    counters = set(stats_keys) | {"t2_" + n[len("ucmcache_tier_"):-len("_total")] for n in disk_counters}
    out = []
    for f in doc_files(root):
        rel = str(f.relative_to(root))
        if rel == HISTORY:
            continue
        text = f.read_text()
        for name in sorted(set(re.findall(r"\bUCM_[A-Z0-9_]*[A-Z0-9]\b(?![*])", text)) - c_names):
            out.append(f"{rel}: names {name}, which csrc/ does not have")
        for name in sorted(set(re.findall(r"\bt2_[a-z0-9_]*[a-z0-9]\b", text)) - counters):
            out.append(f"{rel}: names the counter {name}, which no stats() or disk tier has")
    return out


NUM = r"\d+(?:,\d{3})*"   # 80,128: digits in groups of three
EXAMPLE = re.compile(r"Example: (\d+) ranks x ([\d,]+) slots x (\d+) KiB: (.*?bytes)\.", re.S)


def example_layout_problems(root: pathlib.Path):
    """Section 2's worked example: every offset it names, its arenas and its total."""
    page = root / "docs" / "design" / "words-and-layout.md"
    m = EXAMPLE.search(page.read_text())
    if not m:
        return [f"{page.relative_to(root)}: no worked example of a layout found"]
    lay = Layout.compute(max_ranks=int(m[1]), slots_per_rank=_number(m[2]),
                         slot_size=int(m[3]) * 1024)
    said = " ".join(m[4].split())
    out = []
    for name, value in re.findall(r"(\w+_off) (%s)" % NUM, said):
        if getattr(lay, name) != _number(value):
            out.append(f"example layout: {name} {value}, computed {getattr(lay, name):,}")
    arenas = re.search(r"(%s) arenas of (%s) slots" % (NUM, NUM), said)
    if not arenas or (_number(arenas[1]), _number(arenas[2])) != (lay.n_arenas, lay.arena_slots):
        out.append(f"example layout: arenas {arenas and arenas[0]!r}, computed {lay.n_arenas} "
                   f"arenas of {lay.arena_slots} slots")
    total = re.search(r"total (%s) bytes" % NUM, said)
    if not total or _number(total[1]) != lay.total_size:
        out.append(f"example layout: total {total and total[1]}, computed {lay.total_size:,}")
    return out


def _expand(text: str):
    """Names written with brace alternatives, `ucmcache_{a,b}_total`, spelled out."""
    names = set()
    for m in re.finditer(r"`(ucmcache_[a-z0-9_]*)\{([a-z0-9_,\s]+)\}([a-z0-9_]*)", text):
        for alt in m[2].split(","):
            names.add(m[1] + alt.strip() + m[3])
    return names


def counter_name_problems(root: pathlib.Path, disk_counters):
    """docs/operations.md's Prometheus counters against the ones ucmcache.metrics serves."""
    from ucmcache.metrics import COUNTER_METRICS
    page = root / "docs" / "operations.md"
    said = {n for n in _expand(page.read_text()) if n.endswith("_total")}
    served = {f"ucmcache_{k}_total" for k in COUNTER_METRICS} | set(disk_counters)
    out = [f"docs/operations.md names {n}, which ucmcache.metrics does not serve"
           for n in sorted(said - served)]
    out += [f"docs/operations.md does not name {n}, which ucmcache.metrics serves"
            for n in sorted(served - said)]
    return out


REPO_PATH = re.compile(r"`((?:csrc|scripts|bench|demos|e2e|tests|ucmcache|docs|\.ci)/[\w./*-]*)")
# Paths the docs may name before they exist (none now: every path named is checked).
NOT_YET: tuple = ()


def path_problems(root: pathlib.Path, not_yet=NOT_YET):
    """Every repository path the docs name in backquotes exists (a module may be named without
    its .py; a glob must match something)."""
    out = []
    for f in doc_files(root):
        rel = str(f.relative_to(root))
        if rel == HISTORY:
            continue
        for path in sorted(set(m.rstrip(".,") for m in REPO_PATH.findall(f.read_text()))):
            if path.startswith(not_yet):
                continue
            if "*" in path:
                ok = any(root.glob(path))
            else:
                ok = (root / path).exists() or (root / (path + ".py")).exists()
            if not ok:
                out.append(f"{rel}: names {path}, which is not in the repository")
    return out


CODE_DIRS = ("ucmcache", "csrc", "bench", "e2e", "demos", "scripts")


def _code_files(root: pathlib.Path):
    for d in CODE_DIRS:
        for f in sorted((root / d).rglob("*")):
            if f.suffix in (".py", ".c", ".h", "") and f.is_file() and "__pycache__" not in f.parts:
                yield f


def code_reference_problems(root: pathlib.Path):
    """What the code cites of the docs is there: each docs/ page it names, and each design section
    ("DESIGN 4.12") as a numbered heading of a page under docs/."""
    sections = set()
    for page in (root / "docs").rglob("*.md"):
        sections |= set(re.findall(r"^#{2,4} (\d+(?:\.\d+)?)\.? ", page.read_text(), re.M))
    out = []
    for f in _code_files(root):
        try:
            text = f.read_text()
        except UnicodeDecodeError:
            continue
        rel = f.relative_to(root)
        for page in sorted(set(re.findall(r"docs/[\w/.-]*\w\.md", text))):
            if not (root / page).is_file():
                out.append(f"{rel}: names {page}, which does not exist")
        for num in sorted(set(re.findall(r"DESIGN (\d+(?:\.\d+)?)", text))):
            if num not in sections:
                out.append(f"{rel}: cites DESIGN {num}, which no heading under docs/ numbers")
    return out


LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


def _slugs(page: pathlib.Path):
    """The anchors GitHub makes of a page's headings."""
    seen, out = {}, set()
    for line in _prose(page.read_text()).splitlines():
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        s = re.sub(r"[^\w\- ]", "", m[1].replace("`", "").lower()).replace(" ", "-")
        n = seen.get(s, 0)
        seen[s] = n + 1
        out.add(s if n == 0 else f"{s}-{n}")
    return out


def link_problems(root: pathlib.Path):
    out = []
    for f in doc_files(root):
        rel = f.relative_to(root)
        for target in LINK.findall(_prose(f.read_text())):
            if re.match(r"^[a-z]+:", target):          # http:, https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            dest = (f.parent / path).resolve() if path else f
            if not dest.exists():
                out.append(f"{rel}: link {target} leads nowhere")
            elif anchor and dest.suffix == ".md" and anchor not in _slugs(dest):
                out.append(f"{rel}: link {target}: no heading makes #{anchor}")
    return out


# -- on this repository -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def disk_counters(tmp_path_factory):
    """The disk tier's counter names as ucmcache.metrics serves them, from a fresh tier."""
    from ucmcache import DiskTier
    from ucmcache.metrics import tier_families
    path = tmp_path_factory.mktemp("tier")
    tier = DiskTier(str(path), capacity_bytes=1 << 20)
    try:
        return {f"{fam.name}_total" for fam in tier_families([str(path)]) if fam.type == "counter"}
    finally:
        tier.close()


def test_generated_tables_are_up_to_date():
    assert generated_table_problems(ROOT) == []


def test_constants_and_layout_version_as_the_header_says():
    assert constant_problems(ROOT) == []


def test_example_layout_is_what_the_core_computes():
    assert example_layout_problems(ROOT) == []


def test_metric_counter_names_are_the_served_ones(disk_counters):
    assert disk_counters, "the disk tier serves no counter families"
    assert counter_name_problems(ROOT, disk_counters) == []


@pytest.fixture
def stats_keys(make_cache):
    """The keys of a segment's stats() (its counters, by name)."""
    return set(make_cache(slots_per_rank=4, slot_size=64, max_ranks=1).stats())


def test_names_the_code_still_has(disk_counters, stats_keys):
    assert name_problems(ROOT, disk_counters, stats_keys) == []


def test_paths_the_docs_name_exist():
    assert path_problems(ROOT) == []


def test_what_the_code_cites_of_the_docs_is_there():
    assert code_reference_problems(ROOT) == []


def test_relative_links_resolve():
    assert link_problems(ROOT) == []


# -- each checker fails on a drifted copy --------------------------------------------------------


@pytest.fixture
def copy(tmp_path):
    """The repository's files (no virtual environments, builds or git) copied into a temporary
    tree, to drift one fact in."""
    skip = shutil.ignore_patterns(".git", ".venv*", "__pycache__", "*.so", "*.o", "build", "dist",
                                  "*.egg-info", ".mypy_cache", ".pytest_cache")
    shutil.copytree(ROOT, tmp_path / "repo", ignore=skip, symlinks=True)
    return tmp_path / "repo"


def _drift(path: pathlib.Path, old: str, new: str, count: int = 1):
    text = path.read_text()
    assert old in text, f"{old!r} not in {path}"
    path.write_text(text.replace(old, new, count))


def test_a_drifted_table_row_fails(copy):
    page = copy / "docs" / "design" / "words-and-layout.md"
    _drift(page, "| 36 | `state` | u32 |", "| 40 | `state` | u32 |")
    assert generated_table_problems(copy) == [
        "docs/design/words-and-layout.md: generated table slot_meta is out of date "
        "(run scripts/gen-docs)"]


def test_a_drifted_layout_version_fails(copy):
    v = lib.UCM_LAYOUT_VERSION
    page = copy / "docs" / "design" / "words-and-layout.md"
    _drift(page, f"`UCM_LAYOUT_VERSION` = {v}", f"`UCM_LAYOUT_VERSION` = {v - 1}")
    assert f"says UCM_LAYOUT_VERSION is {v - 1}" in " ".join(constant_problems(copy))
    # the generator puts it right (it sets every `UCM_NAME` = N in a generated table)
    assert generated_table_problems(copy)
    (copy / "README.md").write_text((copy / "README.md").read_text()
                                    + f"\nSegments of layout version {v + 1}.\n")
    assert f"README.md: says UCM_LAYOUT_VERSION is {v + 1}" in " ".join(constant_problems(copy))


def test_a_drifted_rank_limit_fails(copy):
    _drift(copy / "docs" / "engines" / "ucm.md", "(at most 63;", "(at most 64;")
    assert constant_problems(copy) == [
        f"docs/engines/ucm.md: says UCM_MAX_RANKS is 64; csrc/ucm_core.h has {lib.UCM_MAX_RANKS}"]


def test_a_drifted_constant_fails(copy):
    page = copy / "docs" / "design" / "words-and-layout.md"
    _drift(page, "Header, 256 bytes (UCM_HEADER_SIZE)", "Header, 512 bytes (UCM_HEADER_SIZE)")
    assert constant_problems(copy) == [
        f"docs/design/words-and-layout.md: says UCM_HEADER_SIZE is 512; csrc/ucm_core.h has "
        f"{lib.UCM_HEADER_SIZE}"]


def test_a_drifted_example_layout_fails(copy):
    page = copy / "docs" / "design" / "words-and-layout.md"
    _drift(page, "meta_off 80,128", "meta_off 80,192")
    assert example_layout_problems(copy) == ["example layout: meta_off 80,192, computed 80,128"]


def test_a_missing_or_extra_counter_name_fails(copy, disk_counters):
    page = copy / "docs" / "operations.md"
    _drift(page, "joins,", "")
    _drift(page, "write_dedups,", "write_dedups,cold_reads,")
    assert counter_name_problems(copy, disk_counters) == [
        "docs/operations.md names ucmcache_tier_cold_reads_total, which ucmcache.metrics does "
        "not serve",
        "docs/operations.md does not name ucmcache_joins_total, which ucmcache.metrics serves"]


def test_a_renamed_constant_or_counter_fails(copy, disk_counters, stats_keys):
    for src in (copy / "csrc").glob("*.[ch]"):             # the constant renamed in C
        src.write_text(src.read_text().replace("UCM_RING_DEPTH", "UCM_RING_SLOTS"))
    _drift(copy / "docs" / "tiers.md", "t2_lease_waits", "t2_lease_wait")
    problems = name_problems(copy, disk_counters, stats_keys)
    assert "docs/design/words-and-layout.md: names UCM_RING_DEPTH, which csrc/ does not have" in problems
    assert "docs/tiers.md: names the counter t2_lease_wait, which no stats() or disk tier has" in problems


def test_a_moved_file_fails(copy):
    assert path_problems(copy) == []
    (copy / "scripts" / "crashloop").rename(copy / "scripts" / "crash-loop")
    problems = path_problems(copy)
    assert problems and all("names scripts/crashloop," in p for p in problems), problems
    # a module of the layered package that is not there
    _drift(copy / "docs" / "api.md", "# API\n", "# API\n\n`ucmcache/core/no_such_module.py`\n")
    assert ("docs/api.md: names ucmcache/core/no_such_module.py, which is not in the repository"
            in path_problems(copy))


def test_a_lost_design_section_or_page_fails(copy):
    _drift(copy / "docs" / "design" / "arenas.md", "## 4.13 Delete", "## Delete")
    (copy / "docs" / "operations.md").rename(copy / "docs" / "cli.md")
    problems = code_reference_problems(copy)
    assert any(p.endswith("cites DESIGN 4.13, which no heading under docs/ numbers") for p in problems)
    assert any(p.endswith("names docs/operations.md, which does not exist") for p in problems)


def test_a_broken_link_fails(copy):
    _drift(copy / "README.md", "(docs/api.md)", "(docs/apis.md)")
    _drift(copy / "docs" / "design" / "README.md", "#8-known-limits", "#9-known-limits")
    assert link_problems(copy) == [
        "README.md: link docs/apis.md leads nowhere",
        "docs/design/README.md: link ../guarantees.md#9-known-limits: no heading makes "
        "#9-known-limits"]



def _defining_module(cls):
    """The module that defines ``cls`` (its ``__module__`` says where it is exported from):
    that of the functions in its own namespace."""
    import sys
    mods = {f.__module__ for f in vars(cls).values() if callable(f) and hasattr(f, "__module__")
            and getattr(f, "__qualname__", "").startswith(cls.__name__ + ".")}
    assert len(mods) == 1, mods
    return sys.modules[mods.pop()]


def mixin_problems(cls, module):
    """The modules of ``cls``'s mixins (its bases from ucmcache but the hit path's C base) that
    ``module``'s docstring does not name as ``name``."""
    named = set(re.findall(r"``(\w+)``", module.__doc__ or ""))
    out = []
    for base in cls.__mro__[1:]:
        mod = base.__module__
        if not mod.startswith("ucmcache.") or base.__name__ == "CacheBase":
            continue
        short = mod.rsplit(".", 1)[1]
        if short not in named:
            out.append(f"{module.__name__}'s docstring does not name the mixin module {short} "
                       f"({base.__name__})")
    return out


def test_slotcache_docstring_names_every_mixin():
    from ucmcache import SlotCache
    assert mixin_problems(SlotCache, _defining_module(SlotCache)) == []


def test_a_mixin_left_out_of_the_docstring_fails():
    import types
    from ucmcache import SlotCache
    real = _defining_module(SlotCache)
    short = next(b for b in SlotCache.__mro__ if b.__name__ == "Mapping").__module__.rsplit(".", 1)[1]
    drifted = types.ModuleType(real.__name__, real.__doc__.replace(f"``{short}``", "the mapping"))
    assert mixin_problems(SlotCache, drifted) == [
        f"{real.__name__}'s docstring does not name the mixin module {short} (Mapping)"]
