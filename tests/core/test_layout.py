"""The layout tables of csrc/ucm_core.h reach Python whole: every row as a constant and a dtype
field, no two rows sharing a byte, and the bytes of this layout version pinned."""
import hashlib
import mmap
import zlib

import numpy as np
import pytest

from ucmcache.lowlevel import ffi, lib
from ucmcache.core.layout import ARENA_DESC, HEADER, RANK_DESC, RING, SLOT_META, Layout

# The table rows' digest for each layout version: a change of the bytes (a word moved, widened,
# added or removed) must come with a new UCM_LAYOUT_VERSION, and its digest recorded here.
# Version 7 moved no byte: it gave the flags word a bit (UCM_F_DELETE_CHECKED), whose meaning the
# fingerprint carries.  Its digest changed once without a byte moving, when the PrefetchRing's
# words (the same offsets as the #defines before) became a table too; the other tables' rows still
# digest to version 6's value.
ROWS_DIGEST = {6: "ae066e36a5487c01", 7: "d5e4a040df7f066b"}

PREFIX = {"header": "H", "rank": "R", "arena": "A", "slot_meta": "M", "ring": "RING"}
DTYPES = {"header": HEADER, "rank": RANK_DESC, "arena": ARENA_DESC, "slot_meta": SLOT_META,
          "ring": RING}


def rows():
    n = ffi.new("uint32_t *")
    table = lib.ucm_layout_fields(n)
    return [(ffi.string(r.table).decode(), r.table_size, ffi.string(r.name).decode(), r.offset,
             r.item_size, r.count) for r in (table[i] for i in range(n[0]))]


def test_every_row_is_a_constant_and_a_dtype_field_at_its_offset():
    for table, size, name, offset, item, count in rows():
        assert getattr(lib, f"UCM_{PREFIX[table]}_{name}") == offset, (table, name)
        dtype = DTYPES[table]
        assert dtype.itemsize == size
        field, at = dtype.fields[name.lower()][:2]
        assert at == offset and field.itemsize == item * count, (table, name)


@pytest.mark.parametrize("table", sorted(PREFIX))
def test_rows_fit_their_table_aligned_and_apart(table):
    used = np.zeros(DTYPES[table].itemsize, dtype=bool)
    for t, size, name, offset, item, count in rows():
        if t != table:
            continue
        assert offset % item == 0, f"{name} is not aligned to its width"
        assert offset + item * count <= size, f"{name} runs past its table"
        assert not used[offset:offset + item * count].any(), f"{name} overlaps another row"
        used[offset:offset + item * count] = True


def test_this_layout_versions_bytes_are_the_ones_recorded():
    digest = hashlib.sha256(repr(rows()).encode()).hexdigest()[:16]
    assert ROWS_DIGEST.get(lib.UCM_LAYOUT_VERSION) == digest, (
        f"the layout tables changed (digest {digest}) but UCM_LAYOUT_VERSION is still "
        f"{lib.UCM_LAYOUT_VERSION}: bump it and record the new digest")


def test_layout_fields_are_the_c_structs():
    assert list(Layout.__dataclass_fields__) == [n for n, _ in ffi.typeof("ucm_layout").fields]
    layout = Layout.compute(max_ranks=2, slots_per_rank=4, slot_size=100)
    assert Layout.compute(max_ranks=2, slots_per_rank=4, slot_size=100) == layout
    c = layout.to_c()
    assert all(getattr(c, n) == getattr(layout, n) for n in Layout.__dataclass_fields__)
    assert layout.ring_size == RING.itemsize == lib.UCM_RING_SIZE, "rings are laid out by their table"


def test_segment_init_writes_every_word_attach_checks():
    layout = Layout.compute(max_ranks=2, slots_per_rank=4, slot_size=100, n_stripes=2)
    buf = mmap.mmap(-1, layout.total_size)     # page-aligned and zeroed, as a new segment
    base = ffi.cast("char *", ffi.from_buffer(buf))
    assert lib.ucm_segment_init(base, layout.to_c(), 1234, 56) == 0
    h = np.frombuffer(bytes(buf[:HEADER.itemsize]), dtype=HEADER)[0]
    assert h["magic"] == 0, "the magic waits for ucm_segment_publish"
    assert (h["creator_pid"], h["creator_uid"], h["version"], h["generation"]) == (
        1234, 56, lib.UCM_LAYOUT_VERSION, 1)
    assert [int(h[f]) for f in ("max_ranks", "n_stripes", "slots_per_rank", "slot_size",
                                "n_buckets", "total_size")] == [
        layout.max_ranks, layout.n_stripes, layout.slots_per_rank, layout.slot_size,
        layout.n_buckets, layout.total_size]
    assert h["layout_fp"] == lib.ucm_layout_fingerprint()
    assert h["params_crc"] == lib.ucm_params_crc(base) == zlib.crc32(
        bytes(buf[lib.UCM_H_VERSION:lib.UCM_LINE]))
    metas = np.frombuffer(buf, dtype=SLOT_META, count=layout.n_slots, offset=layout.meta_off)
    assert (metas["bucket"] == lib.UCM_INVALID_BUCKET).all()
    assert (metas["prev"] == lib.UCM_NIL).all() and (metas["next"] == lib.UCM_NIL).all()
    heads = np.frombuffer(buf, dtype="<u4", count=layout.n_buckets, offset=layout.bucket_off)
    assert (heads == lib.UCM_NIL).all()
    lib.ucm_segment_publish(base)
    assert lib.ucm_load64(base, lib.UCM_H_MAGIC) == lib.UCM_MAGIC
    del metas, heads, base


def test_every_step_result_is_named_by_the_core():
    from ucmcache.core.results import code_name
    named = {code: code_name(code) for code in range(-2, 64)}
    known = {code: name for code, name in named.items() if not name.startswith("unknown")}
    assert known[lib.UCM_OK] == "UCM_OK" and known[lib.UCM_IN_FLIGHT] == "UCM_IN_FLIGHT"
    assert all(getattr(lib, name) == code for code, name in known.items())
    assert sorted(known) == list(range(len(known))), "results are 0, 1, 2, ... with no gap"
    assert code_name(-1) == "unknown result -1" and code_name(1 << 40) == f"unknown result {1 << 40}"


def test_the_hit_stub_declares_exactly_what_the_c_types_have():
    # _hit.pyi is written by hand beside csrc/ucm_hit.c's member and method tables: a field or
    # method added, renamed or dropped in C without the stub fails here.
    import ast
    import pathlib

    import ucmcache._hit as hit
    stub = ast.parse((pathlib.Path(hit.__file__).parent / "_hit.pyi").read_text())
    for node in stub.body:
        if not isinstance(node, ast.ClassDef) or not hasattr(getattr(hit, node.name), "__dict__"):
            continue
        declared = {n.target.id for n in node.body if isinstance(n, ast.AnnAssign)}
        declared |= {n.name for n in node.body if isinstance(n, ast.FunctionDef)}
        made = set(vars(getattr(hit, node.name)))
        assert {n for n in declared if not n.startswith("__")} == \
            {n for n in made if not n.startswith("__")}, node.name


def test_the_hit_stub_declares_every_field_of_the_c_field_tables():
    # HandleBase's and BatchBase's fields are declared once, in csrc/ucm_hit.c's HANDLE_FIELDS and
    # BATCH_FIELDS (_hit.FIELDS, the tables as data): each one Python reaches is in _hit.pyi and
    # made as the table says (a member, or a getset over it); a C-only one is in neither; every
    # other field the stub declares for those types is a getset of the type.
    import ast
    import pathlib

    import ucmcache._hit as hit
    stub = ast.parse((pathlib.Path(hit.__file__).parent / "_hit.pyi").read_text())
    classes = {n.name: n for n in stub.body if isinstance(n, ast.ClassDef)}
    made_as = {"MEMBER": "member_descriptor", "GETSET": "getset_descriptor"}
    assert set(hit.FIELDS) == {"HandleBase", "BatchBase"}
    for type_name, rows in hit.FIELDS.items():
        declared = {n.target.id for n in classes[type_name].body if isinstance(n, ast.AnnAssign)}
        made = vars(getattr(hit, type_name))
        for name, access in rows:
            if access == "C":
                assert name not in declared and name not in made, f"{type_name}.{name}"
            else:
                assert name in declared, f"{type_name}.{name}: in the C table, not in _hit.pyi"
                assert type(made[name]).__name__ == made_as[access], f"{type_name}.{name}"
        others = declared - {name for name, _ in rows}
        assert {type(made.get(n)).__name__ for n in others} <= {"getset_descriptor"}, \
            f"{type_name}: {sorted(others)} in _hit.pyi, not in the C table"
