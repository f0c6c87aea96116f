"""memoize's key tells functions apart (ucmcache/core/function_key.py, DESIGN 4.6): closures of
one factory, two lambdas of one module, a function redefined under its old name, different
defaults each get their own results, in one process and across processes; the same function in
two processes shares its entries (a set in its closure too, whose order follows each process's
hash seed); what the key cannot tell apart is refused when decorating, naming it.

(Before: the key was module.qualname only: triple(7) returned 14 after double(7), neg(5)
returned 6 after inc(5), and every process then read the wrong value.)
"""
import functools
import os
import threading

import pytest

import memoize_workers as mw

NS = "tests.memoize.v1"


def memo(c, fn):
    return c.memoize(NS)(fn)


def test_closures_of_one_factory_get_their_own_results(make_cache):
    c = make_cache(slot_size=256)
    double, triple = memo(c, mw.times(2)), memo(c, mw.times(3))
    assert double.__qualname__ == triple.__qualname__          # one name, two functions
    assert double(7)[0] == 14
    assert triple(7)[0] == 21
    assert double(7)[0] == 14 and len(c) == 2


def test_two_lambdas_of_one_module_get_their_own_results(make_cache):
    c = make_cache(slot_size=256)
    inc, neg = memo(c, mw.inc), memo(c, mw.neg)
    assert mw.inc.__qualname__ == mw.neg.__qualname__ == "<lambda>"
    assert inc(5)[0] == 6
    assert neg(5)[0] == -5
    assert len(c) == 2


def test_a_function_redefined_under_its_name_gets_its_own_results(make_cache):
    c = make_cache(slot_size=256)

    def f(x):
        return x + 1
    first = memo(c, f)

    def f(x):                                                   # noqa: F811  (a notebook's)
        return x * 10
    second = memo(c, f)
    assert first.__qualname__ == second.__qualname__
    assert first(5) == 6
    assert second(5) == 50
    assert memo(c, f)(5) == 50 and len(c) == 2                  # the same function: its entry


def test_defaults_and_keyword_defaults_are_in_the_key(make_cache):
    c = make_cache(slot_size=256)

    def scaled(factor):
        def f(x, k=factor, *, plus=0):
            return x * k + plus
        return f
    assert memo(c, scaled(2))(5) == 10
    assert memo(c, scaled(3))(5) == 15
    g = scaled(2)
    g.__kwdefaults__ = {"plus": 1}                              # replaced after decoration too
    mg = memo(c, scaled(2))
    assert mg(5) == 10
    assert memo(c, g)(5) == 11


def test_a_cell_rebound_after_decoration_is_seen(make_cache):
    """The function reads its cells when called: a nonlocal rebound after decoration makes
    another function, whose results must not be another factory's."""
    c = make_cache(slot_size=256)

    def make(n, then):
        @c.memoize(NS)
        def f(x):
            return n * x
        n = then                                                # rebound after decoration
        return f
    assert make(3, 3)(7) == 21
    assert make(2, 3)(7) == 21                                  # 3 * 7: its own, then shared
    assert make(3, 2)(7) == 14                                  # never the 21 of n == 3
    assert len(c) == 2


def test_a_function_in_a_closure_is_keyed_by_its_code(make_cache):
    """A closure over a local helper (which plain pickle refuses): the helper's code is in
    the key, so two helpers make two functions."""
    c = make_cache(slot_size=256)

    def using(helper):
        def f(x):
            return helper(x)
        return f
    assert memo(c, using(lambda x: x + 1))(5) == 6
    assert memo(c, using(lambda x: x - 1))(5) == 4
    # a function wrapped by another decorator: the inner function is keyed through its cell
    def deco(fn):
        @functools.wraps(fn)
        def wrapper(x):
            return fn(x)
        return wrapper
    assert memo(c, deco(lambda x: x * 2))(5) == 10
    assert memo(c, deco(lambda x: x * 3))(5) == 15


def test_a_recursive_memoized_closure_is_keyed(make_cache):
    c = make_cache(slot_size=256)

    def make(step):
        @c.memoize(NS)
        def fib(n):
            return n if n < 2 else fib(n - step) + fib(n - 2)
        return fib
    assert make(1)(11) == 89
    assert make(2)(11) == 32                                    # fib(n-2) twice: 2**5 * fib(1)
    assert make(1)(12) == 144


def test_what_cannot_be_told_apart_is_refused_naming_it(make_cache):
    c = make_cache(slot_size=256)
    lock = threading.Lock()

    def f(x):
        with lock:
            return x
    with pytest.raises(TypeError, match=r"^memoize cannot key .*\.f: its closure cell 'lock' "
                                        r"holds a lock that cannot be pickled"):
        c.memoize(NS)(f)

    def g(x, guard=lock):
        return x
    with pytest.raises(TypeError, match=r"its default of 'guard' holds a lock"):
        c.memoize(NS)(g)

    class Scaler:
        def __init__(self, k):
            self.k = k

        def scale(self, x):
            return self.k * x
    for callable_ in (Scaler(2).scale, functools.partial(pow, 2), Scaler, len.__call__):
        with pytest.raises(TypeError, match=r"^memoize caches plain functions \(def or lambda\) "
                                            r"and builtin functions, got "):
            c.memoize(NS)(callable_)
    assert len(c) == 0


def test_a_builtin_function_is_keyed_by_its_name(make_cache):
    import math
    c = make_cache(slot_size=256)
    assert c.memoize(NS)(math.factorial)(10) == 3628800
    assert c.memoize(NS)(math.isqrt)(10) == 3


def test_across_processes_the_same_function_shares_entries_and_another_does_not(make_cache,
                                                                                 procs):
    """This process computes double(7), inc(5) and vowel('e'); a second real process reads
    those three (their pid is ours) and computes triple(7), neg(5) and digit('e') itself."""
    c = make_cache(slot_size=256)
    me = os.getpid()
    assert mw.memoized(c, "double")(7) == (14, me)
    assert mw.memoized(c, "inc")(5) == (6, me)
    assert mw.memoized(c, "vowel")("e") == (True, me)
    _, q = procs.start(mw.call_each, c.uuid, [("double", 7), ("triple", 7), ("inc", 5),
                                              ("neg", 5), ("vowel", "e"), ("digit", "e")])
    got = procs.result(q)
    child = got[1][1]
    assert child != me
    assert got == [(14, me), (21, child), (6, me), (-5, child), (True, me), (False, child)]
    # and this process reads the child's entries
    assert mw.memoized(c, "triple")(7) == (21, child)
    assert mw.memoized(c, "neg")(5) == (-5, child)


def test_one_function_shares_entries_across_hash_seeds(make_cache, procs, monkeypatch):
    """Two real processes with different PYTHONHASHSEEDs memoize the same functions, each
    capturing a set inside an object pickle writes by its reduction (a namedtuple, a
    SimpleNamespace, a dataclass, a defaultdict) or a dict whose order came from a set: the
    second reads every entry the first stored.  (Before: the reduction's state was pickled in
    the seed's order, so each process had its own digest and computed its own entries.)"""
    c = make_cache(slot_size=256)
    calls = [(name, "the") for name in mw.SEEDED]
    got = []
    for seed in ("1", "2"):
        monkeypatch.setenv("PYTHONHASHSEED", seed)
        _, q = procs.start(mw.hash_and_call_each, c.uuid, calls)
        got.append(procs.result(q))
    (hash1, first), (hash2, second) = got
    assert hash1 != hash2                                       # the seeds did differ
    pid1 = first[0][1]
    assert first == [(True, pid1)] * len(calls)
    assert second == first                                      # every one the first's entry


def test_dict_order_is_not_in_the_key_but_an_ordered_dicts_is(make_cache):
    """A dict's order can come from a set (the hash seed's): equal dicts make one key, in any
    order; an OrderedDict's order is part of its value (its equality says so): two keys."""
    import collections
    c = make_cache(slot_size=256)

    def over(mapping):
        return lambda x: (list(mapping)[0], x)
    assert memo(c, over({"a": 1, "b": 2}))(0) == ("a", 0)
    assert memo(c, over({"b": 2, "a": 1}))(0) == ("a", 0)       # the first's entry
    assert len(c) == 1
    od = collections.OrderedDict
    assert memo(c, over(od(a=1, b=2)))(0) == ("a", 0)
    assert memo(c, over(od(b=2, a=1)))(0) == ("b", 0)
    assert len(c) == 3


def test_a_value_that_holds_itself_is_keyed(make_cache):
    """Cycles in captured values: a list holding itself (it recursed without end before: a
    TypeError at decoration), an object whose state holds it."""
    import types
    c = make_cache(slot_size=256)
    loop = [1]
    loop.append(loop)
    node = types.SimpleNamespace(n=2)
    node.me = node
    assert memo(c, lambda x: x * loop[0])(3) == 3
    assert memo(c, lambda x: x * node.me.n)(3) == 6


def test_a_class_redefined_in_a_notebook_gets_its_own_results(make_cache, monkeypatch):
    """A class in a closure cell, an instance of it, its bound method: pickle writes a class by
    its name, so a class redefined under its name (a notebook cell run again) kept the old
    one's entries (before: 10 again where 15 was due, for each of the three)."""
    import sys
    import types
    c = make_cache(slot_size=256)
    nb = types.ModuleType("ucm_test_notebook")               # a notebook's module
    monkeypatch.setitem(sys.modules, nb.__name__, nb)

    def run_cell(factor):
        exec(f"class Scaler:\n"
             f"    def apply(self, x):\n"
             f"        return {factor} * x\n", nb.__dict__)
        return nb.Scaler
    captures = {"the class": lambda cls: (lambda x: cls().apply(x)),
                "an instance": lambda cls: (lambda obj: lambda x: obj.apply(x))(cls()),
                "a bound method": lambda cls: (lambda m: lambda x: m(x))(cls().apply)}
    for what, capture in captures.items():
        assert memo(c, capture(run_cell(2)))(5) == 10, what
        assert memo(c, capture(run_cell(3)))(5) == 15, what
        c.clear()


def test_a_class_attribute_is_in_the_key(make_cache):
    """Two classes of one name differing in a class constant (or a static method): their own
    results.  An attribute that cannot be pickled (a lock) is keyed by its type: not refused."""
    import threading
    c = make_cache(slot_size=256)

    def make(k, lock_too):
        class Rule:
            FACTOR = k
            if lock_too:
                guard = threading.Lock()

            @staticmethod
            def scale(x):
                return x * Rule.FACTOR
        return lambda x: Rule.scale(x)
    assert memo(c, make(2, False))(5) == 10
    assert memo(c, make(3, False))(5) == 15
    assert memo(c, make(4, True))(5) == 20


def test_a_class_of_an_installed_module_is_keyed_by_its_name(make_cache):
    """An installed module's class (fractions.Fraction here) is keyed as pickle writes it; its
    instances by their values."""
    from fractions import Fraction
    c = make_cache(slot_size=256)

    def times(q):
        return lambda x: x * q
    assert memo(c, times(Fraction(1, 2)))(4) == 2
    assert memo(c, times(Fraction(1, 4)))(4) == 1
    assert memo(c, times(Fraction(1, 2)))(4) == 2 and len(c) == 2
