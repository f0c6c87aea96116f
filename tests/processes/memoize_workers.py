"""Functions for tests/core/test_memoize.py, importable in spawned children: each result carries
the pid of the process that computed it, so a caller tells its own computation from an entry
another process stored."""
import collections
import dataclasses
import enum
import os
import types

from ucmcache import SlotCache

from workers import run

NAMESPACE = "tests.memoize.v1"


def times(n):
    def f(x):
        return n * x, os.getpid()
    return f


double, triple = times(2), times(3)             # one factory: one qualname, two functions
inc = lambda x: (x + 1, os.getpid())            # noqa: E731  two lambdas of one module
neg = lambda x: (-x, os.getpid())               # noqa: E731


def member_of(words):
    def f(x):
        return x in words, os.getpid()
    return f


# A frozenset of str: its iteration order follows the hash seed, which differs per process;
# the key must not (the same function in two processes shares its entries).
vowel = member_of(frozenset("aeiou"))
digit = member_of(frozenset("0123456789"))

# Sets and dicts inside objects pickle writes by their reduction, and a dict whose order came
# from a set: each process's hash seed orders them its own way; the key must not follow it.
STOP = frozenset({"a", "an", "the", "of", "to", "in", "is", "it", "and", "or"})
Config = collections.namedtuple("Config", "stop")


@dataclasses.dataclass
class Allowed:
    words: set


class Kind(enum.Enum):
    STOP = STOP
    NONE = frozenset()


class Words(set):
    """A class of this (not installed) module, keyed by its attributes: one with a set."""
    LIMIT = {"x", "y", "z", "w"}

    def has(self, x):
        return super().__contains__(x)


def seeded():
    cfg, ns = Config(STOP), types.SimpleNamespace(stop=set(STOP), other=set(STOP))
    allowed, dd = Allowed(set(STOP)), collections.defaultdict(set, {"k": set(STOP)})
    ranks, words, kind = dict.fromkeys(set(STOP), 1), Words(STOP), Kind.STOP
    return {"namedtuple_cell": lambda x: (x in cfg.stop, os.getpid()),
            "namespace_cell": lambda x: (x in ns.stop, os.getpid()),
            "dataclass_cell": lambda x: (x in allowed.words, os.getpid()),
            "defaultdict_cell": lambda x: (x in dd["k"], os.getpid()),
            "dict_from_set_cell": lambda x: (x in ranks, os.getpid()),
            "class_cells": lambda x: (words.has(x) and x in kind.value, os.getpid())}


SEEDED = seeded()

FUNCTIONS = {"double": double, "triple": triple, "inc": inc, "neg": neg, "vowel": vowel,
             "digit": digit, **SEEDED}


def memoized(cache, name):
    return cache.memoize(NAMESPACE)(FUNCTIONS[name])


def _call_each(uuid, calls):
    """[(name, arg)] called memoized, in order: their (value, pid) results."""
    c = SlotCache.attach(uuid)
    try:
        return [memoized(c, name)(arg) for name, arg in calls]
    finally:
        c.close()


def call_each(q, *args):
    run(_call_each, q, *args)


def _hash_and_call_each(uuid, calls):
    """This process's hash of a str (its hash seed's mark) and _call_each's results."""
    return hash("ucmcache"), _call_each(uuid, calls)


def hash_and_call_each(q, *args):
    run(_hash_and_call_each, q, *args)
