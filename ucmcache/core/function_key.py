"""What memoize's key says of the function it caches (DESIGN 4.6, memoize's key): two
functions that may compute different results never share entries, in one process or across
processes.

``module.qualname`` alone does not tell functions apart: closures made by one factory (double
and triple), the lambdas of one module, a function redefined in a notebook all share a name.
So the key holds a digest of what the function computes with besides its arguments:

- its code: the bytecode, the constants (nested code objects, a lambda's or a comprehension's,
  by the same rule, recursively), the names it uses, its argument counts and flags; not its
  line numbers or file name (a function moved in its file keeps its entries);
- its defaults and keyword-only defaults, and the contents of its closure cells, as pickled
  values.  A function found among them (a helper captured by a closure, a decorated
  function's inner one) or anywhere inside them is keyed by the same rule, recursively (a cycle,
  a recursive closure, by its name).  So is a class of the caller's code found at any depth
  (captured; an instance's class, a bound method's instance's): pickle writes a class by its
  name only, and a class redefined in a notebook would keep the old one's entries.  Such a
  class is keyed by its module, name, metaclass and bases, and the attributes its body made, in
  their order: functions (and static/class methods, properties, cached properties) by their
  code, other values by this rule; one that cannot be pickled (a lock, a framework's compiled
  validator) by its type's name.  A class of an installed module (the standard library's,
  site-packages') or a static C type is keyed by its name, as pickle writes it: its code is the
  installed version's, as a module global's is (name the version in the namespace).

The digest is the same in every process that has the same function: nothing in it follows the
hash seed.  A set or frozenset is keyed by its items' sorted pickles; a dict by its items in its
keys' sorted order, not its insertion order (which a dict made from a set takes from the seed);
an OrderedDict keeps its order (its equality says the order matters).  So is an object pickle
writes by its reduction (a namedtuple, a dataclass, a SimpleNamespace, a defaultdict): the
arguments, state and items the reduction gives are keyed by the same rule, at any depth.

Refused, with TypeError naming what and why: a value among them that cannot be pickled (a
lock, an open file, a model object without pickle support), and callables that are not plain
functions (a bound method, a functools.partial, a callable object, a class: their state is not
a function's; wrap the call in a def).  A builtin function (math.sqrt) is keyed by its name.

Not in the key (the caller names them in the namespace): the module globals the function reads
(constants, other functions it calls by their global name, modules) and the state of mutable
objects it captured once they change in place.  A cell rebound, or ``__code__``/``__defaults__``
replaced, after decoration is seen: the digest is taken again at the next call (each call
checks those by identity, a few attribute reads).  Bytecode differs between Python versions,
so processes on different versions compute their own entries (never another's).
"""
from __future__ import annotations

import collections
import copyreg
import functools
import hashlib
import io
import os
import pickle
import site
import sys
import sysconfig
import types
from typing import Any, Callable, Optional, Tuple

_PERSON = b"ucmcache.fn.v2"     # the digest's personalisation: a new rule gets a new one
_EMPTY_CELL = ("<empty closure cell>",)


class _Sorted(tuple):
    """A set's items as sorted pickles: a private type, so no value of the caller's pickles the
    same way as a set does."""


class _Items(tuple):
    """A dict's items as (key, value) pairs in its keys' sorted order, for keys that are not
    all str, bytes or numbers."""


class _Function(tuple):
    """A function as the digest of its parts (or its name, for a cycle)."""


def _function_ref(digest: bytes) -> _Function:  # (what a pickled function reduces to)
    return _Function((digest,))


def _memoized_ref(namespace: str, digest: bytes) -> _Function:
    return _Function((namespace, digest))


def _class_ref(digest: bytes) -> _Function:  # (what a class of the caller's code reduces to)
    return _Function(("class", digest))


def _proxy_ref(mapping: dict) -> types.MappingProxyType:  # (a read-only view of a dict)
    return types.MappingProxyType(mapping)


def _set_ref(cls: type, items: Any, state: Any) -> Any:  # (a set's subclass: its items sorted)
    return cls(items)


class _Member(tuple):
    """A class attribute that wraps functions (a staticmethod, classmethod, property, cached
    property; pickle refuses each) as its kind and its functions."""


class _TypeName(tuple):
    """A class attribute that cannot be pickled, as its type's name."""


# The module's own reduction functions: pickled by their names, never keyed by their code.
_OWN_FUNCTIONS = frozenset((_function_ref, _memoized_ref, _class_ref, _proxy_ref, _set_ref))
_OWN_TYPES = frozenset((_Sorted, _Items, _Function, _Member, _TypeName))
_ATOMS = frozenset((str, bytes, int, float, bool, type(None)))


class _KeyPickler(pickle.Pickler):
    """pickle, with every function and code object replaced by its digest (the rule above), at
    any depth, where plain pickle would write a function's name only, or fail on a lambda."""

    def __init__(self, file: Any, seen: set):
        super().__init__(file, protocol=4)
        self.seen = seen

    def reducer_override(self, obj: Any) -> Any:
        t = type(obj)
        if t is types.FunctionType:
            if obj in _OWN_FUNCTIONS:
                return NotImplemented
            memo = getattr(obj, "_ucm_memoized", None)
            if memo is not None:          # another memoized function: its namespace and function
                namespace, fn = memo
                return _memoized_ref, (namespace, _function_digest(fn, self.seen))
            return _function_ref, (_function_digest(obj, self.seen),)
        if t is types.CodeType:
            return _function_ref, (_digest(_code_parts(obj), self.seen),)
        if isinstance(obj, type):
            if obj in _OWN_TYPES or _by_name(obj):
                return NotImplemented      # pickle writes it by its name
            return _class_ref, (_class_digest(obj, self.seen),)
        if t in _OWN_TYPES:
            return NotImplemented
        if t is types.MappingProxyType:    # (pickle refuses it: a dataclass's field metadata)
            return _proxy_ref, (_canon(dict(obj), self.seen),)
        return _canonical_reduction(obj, self.seen)


# Where installed modules live: the standard library and site-packages of this interpreter.
_INSTALLED = tuple({os.path.join(os.path.realpath(d), "") for d in (
    *(sysconfig.get_paths().get(k) for k in ("stdlib", "platstdlib", "purelib", "platlib")),
    *getattr(site, "getsitepackages", lambda: [])()) if d})


@functools.lru_cache(maxsize=None)
def _installed_file(path: str) -> bool:
    return os.path.realpath(path).startswith(_INSTALLED)


def _by_name(cls: type) -> bool:
    """Whether a class is keyed by its name, as pickle writes it: a static C type, or a class
    found under its name in a module of the standard library or site-packages (its code is
    the installed version's).  Not: a class of the caller's code (a script's, a notebook's, a
    module of the caller's project), nor one not found under its name (made in a function,
    redefined since)."""
    if not cls.__flags__ & _HEAPTYPE:
        return True
    module = sys.modules.get(getattr(cls, "__module__", None) or "")
    if module is None:
        return False
    found: Any = module
    for part in cls.__qualname__.split("."):
        found = getattr(found, part, None)
    if found is not cls:
        return False
    spec = getattr(module, "__spec__", None)
    if getattr(spec, "origin", None) in ("built-in", "frozen"):
        return True
    path = getattr(module, "__file__", None)
    return isinstance(path, str) and _installed_file(path)


_HEAPTYPE = 1 << 9                  # Py_TPFLAGS_HEAPTYPE: a class made at run time, not static C
# Class attributes not keyed: those the type machinery makes (the descriptors of __dict__,
# __weakref__ and slots: the slots are in __slots__), and caches a process adds as it runs
# (copyreg's __slotnames__ at an instance's first pickling, abc's registry), which would make
# the key differ between processes.
_MADE_BY_TYPE = (types.GetSetDescriptorType, types.MemberDescriptorType,
                 types.WrapperDescriptorType, types.MethodDescriptorType,
                 types.ClassMethodDescriptorType)
_CACHES = frozenset(("__slotnames__", "_abc_impl"))


def _class_digest(cls: type, seen: set) -> bytes:
    """The digest of a class of the caller's code (the module's rule); a class already being
    keyed (a method's __class__ cell, an enum's members) by its name."""
    name = f"{cls.__module__}.{cls.__qualname__}"
    if id(cls) in seen:
        return f"<recursive class {name}>".encode()
    seen.add(id(cls))
    try:
        members = tuple((attr, _member(value, seen)) for attr, value in vars(cls).items()
                        if attr not in _CACHES and not isinstance(value, _MADE_BY_TYPE))
        return _digest(("class", type(cls), cls.__module__, cls.__qualname__, cls.__bases__,
                        members), seen)
    finally:
        seen.discard(id(cls))


def _member(value: Any, seen: set) -> Any:
    """A class attribute as it is keyed: a wrapper of functions as its functions, a value that
    cannot be pickled as its type's name, any other value by its digest."""
    if isinstance(value, (staticmethod, classmethod)):
        return _Member((type(value).__name__, value.__func__))
    if isinstance(value, property):
        return _Member(("property", value.fget, value.fset, value.fdel))
    if isinstance(value, functools.cached_property):
        return _Member(("cached_property", value.func))
    if type(value) is types.FunctionType or type(value) in _ATOMS:
        return value
    try:
        return _Member(("value", _digest(value, seen)))  # (pickled once, here)
    except RecursionError:
        raise
    except Exception:
        t = type(value)
        return _TypeName((f"{t.__module__}.{t.__qualname__}",))


def _canonical_reduction(obj: Any, seen: set) -> Any:
    """obj's reduction as pickle would take it (copyreg's table, else __reduce_ex__), with its
    arguments, state and items canonical (_canon): pickle does not hand the containers in them
    to reducer_override, so a set in a namedtuple's fields or a dataclass's state, a dict's
    order in a SimpleNamespace or a defaultdict's items, would be pickled as the hash seed
    left them."""
    if isinstance(obj, (set, frozenset)):  # a subclass: its reduction lists the seed's order
        return _set_ref, (type(obj), _canon(frozenset(obj), seen),
                          _canon(getattr(obj, "__dict__", None), seen))
    reduce = copyreg.dispatch_table.get(type(obj))
    rv = reduce(obj) if reduce is not None else obj.__reduce_ex__(4)
    if not isinstance(rv, tuple):
        return NotImplemented              # a global's name: pickle writes it as it is
    rv = list(rv)
    rv[1] = _canon(rv[1], seen)
    if len(rv) > 2:
        rv[2] = _canon(rv[2], seen)
    if len(rv) > 3 and rv[3] is not None:
        rv[3] = iter([_canon(x, seen) for x in rv[3]])
    if len(rv) > 4 and rv[4] is not None:
        pairs = [(_canon(k, seen), _canon(v, seen)) for k, v in rv[4]]
        if not isinstance(obj, collections.OrderedDict):
            pairs.sort(key=lambda kv: _dumps(kv[0], seen))
        rv[4] = iter(pairs)
    return tuple(rv)


def _canon(obj: Any, seen: set, memo: Optional[dict] = None) -> Any:
    """obj with every set made its items' sorted pickles and every dict's items put in its
    keys' sorted order, through the containers pickle does not hand to reducer_override (a
    set's order follows the hash seed, and so does a dict's made from one: they would differ
    between processes).  A list or dict that holds itself is made once (``memo``), so a cycle
    stays a cycle for pickle's memo instead of recursing."""
    t = type(obj)
    if t is not tuple and t is not list and t is not dict and t is not set \
            and t is not frozenset:
        return obj
    if memo is None:
        memo = {}
    done = memo.get(id(obj))
    if done is not None:
        return done
    if t is tuple:
        out: Any = tuple(_canon(x, seen, memo) for x in obj)
    elif t is list:
        out = memo[id(obj)] = []
        out.extend(_canon(x, seen, memo) for x in obj)
    elif t is dict:
        if all(type(k) in _ATOMS for k in obj):
            out = memo[id(obj)] = {}       # still a dict: pickle checks a NEWOBJ_EX's kwargs
            for k in sorted(obj, key=lambda k: pickle.dumps(k, protocol=4)):
                out[k] = _canon(obj[k], seen, memo)
        else:
            # Keys whose canonical forms could be equal (a frozenset's and a tuple's): the
            # pairs, ordered by their keys' pickles.
            pairs = sorted(((_canon(k, seen, memo), _canon(v, seen, memo))
                            for k, v in obj.items()), key=lambda kv: _dumps(kv[0], seen))
            out = _Items(pairs)
    else:
        out = _Sorted((t.__name__, tuple(sorted(_dumps(x, seen) for x in obj))))
    memo[id(obj)] = out
    return out


def _dumps(obj: Any, seen: set) -> bytes:
    buf = io.BytesIO()
    _KeyPickler(buf, seen).dump(_canon(obj, seen))
    return buf.getvalue()


class _HashWriter:
    """A file for the pickler that hashes what it is given and keeps none of it: a large value
    in a closure (a model) costs its pickling time once, not its size again in memory."""

    __slots__ = ("h",)

    def __init__(self) -> None:
        self.h = hashlib.blake2b(digest_size=16, person=_PERSON)

    def write(self, b: Any) -> int:
        self.h.update(b)
        return len(b)


def _digest(parts: Any, seen: set) -> bytes:
    out = _HashWriter()
    _KeyPickler(out, seen).dump(_canon(parts, seen))
    return out.h.digest()


def _code_parts(code: types.CodeType) -> tuple:
    """What a code object computes, without where it sits (line numbers, file name)."""
    return ("code", code.co_argcount, code.co_posonlyargcount, code.co_kwonlyargcount,
            code.co_flags, code.co_code, code.co_consts, code.co_names, code.co_varnames,
            code.co_freevars, code.co_cellvars, getattr(code, "co_exceptiontable", b""))


def _cell_contents(fn: types.FunctionType) -> tuple:
    out = []
    for cell in fn.__closure__ or ():
        try:
            out.append(cell.cell_contents)
        except ValueError:
            out.append(_EMPTY_CELL)  # not assigned yet (a recursive closure, at decoration)
    return tuple(out)


def _function_digest(fn: types.FunctionType, seen: set) -> bytes:
    """The digest of fn's parts; a function already being keyed (a cycle) by its name."""
    if id(fn) in seen:
        return f"<recursive {fn.__module__}.{fn.__qualname__}>".encode()
    seen.add(id(fn))
    try:
        return _digest(_parts(fn, _cell_contents(fn)), seen)
    finally:
        seen.discard(id(fn))


def _parts(fn: types.FunctionType, cells: tuple) -> tuple:
    return ("function", fn.__module__, fn.__qualname__, _code_parts(fn.__code__),
            fn.__defaults__, fn.__kwdefaults__, cells)


def _name(fn: Any) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', type(fn).__name__)}"


class FunctionKey:
    """A function's part of memoize's key, kept current: ``digest()`` answers the digest of
    its parts (the module's rule), taken when made and again when a closure cell was rebound
    or its code or defaults were replaced since (checked by identity at every call)."""

    __slots__ = ("fn", "name", "_code", "_defaults", "_kwdefaults", "_cells", "_digest")

    def __init__(self, fn: Callable[..., Any]):
        self.name = _name(fn)
        if type(fn) is types.BuiltinFunctionType and (
                fn.__self__ is None or isinstance(fn.__self__, types.ModuleType)):
            self.fn = None                      # C code: its name says what it computes
            self._digest = _digest(("builtin", self.name), set())
            return
        if type(fn) is not types.FunctionType:
            raise TypeError(
                f"memoize caches plain functions (def or lambda) and builtin functions, got "
                f"{self.name}, a {type(fn).__name__}: what it computes with besides its "
                "arguments (an instance, bound arguments) would not be in the key; call it "
                "from a memoized def and pass that state as arguments")
        self.fn = fn
        self._code: Optional[types.CodeType] = None
        self._defaults: Any = None
        self._kwdefaults: Any = None
        self._cells: Tuple[Any, ...] = ()
        self._digest = b""
        self._take(fn)

    def digest(self) -> bytes:
        fn = self.fn
        if fn is not None and (fn.__code__ is not self._code or fn.__defaults__ is not
                               self._defaults or fn.__kwdefaults__ is not self._kwdefaults or
                               not self._cells_same(fn)):
            self._take(fn)
        return self._digest

    def _cells_same(self, fn: types.FunctionType) -> bool:
        closure = fn.__closure__
        if not closure:
            return True
        for cell, was in zip(closure, self._cells):
            try:
                now = cell.cell_contents
            except ValueError:
                now = _EMPTY_CELL
            if now is not was:
                return False
        return True

    def _take(self, fn: types.FunctionType) -> None:
        """The digest of fn as it is now, with what it was taken from (for digest's check);
        a part that cannot be pickled is named in the TypeError."""
        code, defaults, kwdefaults = fn.__code__, fn.__defaults__, fn.__kwdefaults__
        cells = _cell_contents(fn)
        seen = {id(fn)}
        try:
            digest = _digest(_parts(fn, cells), seen)
        except RecursionError:
            raise TypeError(f"memoize cannot key {self.name}: its closure cells or defaults "
                            "nest too deeply to pickle") from None
        except Exception as e:
            raise TypeError(f"memoize cannot key {self.name}: {self._culprit(fn, cells, e)}; "
                            "memoize tells functions apart by their code, defaults and closure "
                            "cells as pickled values: pass such a value as an argument, or "
                            "read it from a module global (globals are not in the key: name "
                            "what they mean in the namespace)") from None
        # One tuple assignment each, the digest last: another thread's digest() meanwhile
        # sees the old parts with the old digest or takes them again itself.
        self._code, self._defaults, self._kwdefaults, self._cells = code, defaults, \
            kwdefaults, cells
        self._digest = digest

    @staticmethod
    def _culprit(fn: types.FunctionType, cells: tuple, error: Exception) -> str:
        """Which part of fn could not be pickled, named for the error."""
        code = fn.__code__
        named = [(f"closure cell {n!r}", v) for n, v in zip(code.co_freevars, cells)]
        pos = code.co_varnames[:code.co_argcount]
        named += [(f"default of {n!r}", v)
                  for n, v in zip(pos[len(pos) - len(fn.__defaults__ or ()):],
                                  fn.__defaults__ or ())]
        named += [(f"default of {n!r}", v) for n, v in (fn.__kwdefaults__ or {}).items()]
        for what, value in named:
            try:
                _dumps(value, {id(fn)})
            except Exception as e:
                return f"its {what} holds a {type(value).__name__} that cannot be pickled ({e})"
        return f"it cannot be pickled ({error})"
