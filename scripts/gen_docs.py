"""The docs' generated tables: the five layout tables of csrc/ucm_core.h, written into the
design pages from the built core, so a word's offset, width or count is stated once.

    ./scripts/gen-docs            rewrite every generated table in docs/ that is out of date
    ./scripts/gen-docs --check    rewrite nothing; exit 1 naming each table that is out of date

A generated table sits between two markers:

    <!-- gen-docs: table slot_meta (...) -->
    | off | word | type | meaning |
    ...
    <!-- gen-docs: end -->

Its rows come from ``ucmcache.lowlevel``'s dtypes, which the core builds from
``ucm_layout_fields()`` (the rows of UCM_<TABLE>_TABLE): one row per word, in address order.
Only the last column is written by hand: it is kept, by word name, when the table is rewritten
(a new word gets an empty meaning, a removed word's meaning goes), and every "`UCM_NAME` = N"
in it is set to the core's value of UCM_NAME.  tests/test_docs_facts.py runs the check.
"""
from __future__ import annotations

import pathlib
import re
import sys
from typing import Dict, List, Tuple

ROOT = pathlib.Path(__file__).resolve().parent.parent

# table name in the marker -> (lowlevel dtype name, the C table it comes from)
TABLES = {
    "header": ("HEADER", "UCM_HEADER_TABLE"),
    "rank": ("RANK_DESC", "UCM_RANK_TABLE"),
    "arena": ("ARENA_DESC", "UCM_ARENA_TABLE"),
    "slot_meta": ("SLOT_META", "UCM_SLOT_META_TABLE"),
    "ring": ("RING", "UCM_RING_TABLE"),
}
BEGIN = re.compile(r"^<!-- gen-docs: table (\w+)\b.*-->$", re.M)
END = "<!-- gen-docs: end -->"
CONSTANT = re.compile(r"`(UCM_[A-Z0-9_]+)` = (0x[0-9a-fA-F]+|[0-9][0-9,]*)")


def _rows(table: str) -> List[Tuple[int, str, str]]:
    """(offset, word, type) of each word of a layout table, in address order."""
    from ucmcache import lowlevel
    dtype = getattr(lowlevel, TABLES[table][0])
    rows = []
    for name in dtype.names:
        field, offset = dtype.fields[name][:2]
        base, shape = (field.subdtype if field.subdtype else (field, ()))
        kind = f"u{base.itemsize * 8}"
        count = 1
        for n in shape:
            count *= n
        rows.append((offset, name, kind if count == 1 else f"{kind} x{count:,}"))
    return sorted(rows)


def _constants(text: str) -> str:
    from ucmcache.lowlevel import lib

    def put(m: "re.Match[str]") -> str:
        value = getattr(lib, m[1], None)
        if not isinstance(value, int):
            return m[0]
        shown = hex(value) if m[2].startswith("0x") else (f"{value:,}" if "," in m[2] else str(value))
        return f"`{m[1]}` = {shown}"
    return CONSTANT.sub(put, text)


def render(table: str, meanings: Dict[str, str]) -> str:
    from ucmcache import lowlevel
    dtype = getattr(lowlevel, TABLES[table][0])
    head = (f"<!-- gen-docs: table {table} (from {TABLES[table][1]} in csrc/ucm_core.h, "
            f"{dtype.itemsize:,} bytes; edit only the meaning column, then run scripts/gen-docs) -->")
    lines = [head, "| off | word | type | meaning |", "|---:|---|---|---|"]
    for offset, name, kind in _rows(table):
        lines.append(f"| {offset} | `{name}` | {kind} | {_constants(meanings.get(name, ''))} |".rstrip()
                     .replace("|  |", "| |"))
    lines.append(END)
    return "\n".join(lines)


def _meanings(block: str) -> Dict[str, str]:
    out = {}
    for line in block.splitlines():
        m = re.match(r"^\| *\d+ *\| *`(\w+)` *\|[^|]*\|(.*)\|$", line)
        if m:
            out[m[1]] = m[2].strip()
    return out


def regenerate(text: str) -> Tuple[str, List[str]]:
    """The text with every generated table rewritten, and the names of those that changed."""
    out, changed, pos = [], [], 0
    for m in BEGIN.finditer(text):
        if m.start() < pos:
            continue
        table = m[1]
        if table not in TABLES:
            raise SystemExit(f"gen-docs: unknown table {table!r} (known: {', '.join(TABLES)})")
        end = text.find(END, m.start())
        if end < 0:
            raise SystemExit(f"gen-docs: table {table!r} has no {END!r}")
        old = text[m.start():end + len(END)]
        new = render(table, _meanings(old))
        if new != old:
            changed.append(table)
        out.append(text[pos:m.start()])
        out.append(new)
        pos = end + len(END)
    out.append(text[pos:])
    return "".join(out), changed


def pages(root: pathlib.Path = ROOT) -> List[pathlib.Path]:
    return sorted(p for p in (root / "docs").rglob("*.md") if BEGIN.search(p.read_text()))


def main(argv: List[str]) -> int:
    check = "--check" in argv
    root = ROOT
    stale = []
    for page in pages(root):
        text = page.read_text()
        new, changed = regenerate(text)
        if changed:
            stale.extend(f"{page.relative_to(root)}: table {t}" for t in changed)
            if not check:
                page.write_text(new)
    for s in stale:
        print(("out of date: " if check else "rewrote: ") + s)
    return 1 if (check and stale) else 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main(sys.argv[1:]))
