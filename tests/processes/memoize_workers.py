"""Functions for tests/test_memoize.py, importable in spawned children: each result carries
the pid of the process that computed it, so a caller tells its own computation from an entry
another process stored."""
import os

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

FUNCTIONS = {"double": double, "triple": triple, "inc": inc, "neg": neg, "vowel": vowel,
             "digit": digit}


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
