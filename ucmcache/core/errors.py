"""The error hierarchy: one base class, a subclass per thing that can go wrong."""


class UcmError(Exception):
    """Base of every error ucmcache raises on purpose."""


class CacheFull(UcmError):
    """Allocation found no slot it could claim: every candidate in the rank's range is pinned."""


class LoadFailed(UcmError):
    """The owner of a Loading slot published Failed (or died); carries the owner's message."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class SegmentExists(UcmError):
    """create() found a complete segment under that uuid."""


class SegmentNotFound(UcmError):
    """No segment with that uuid exists in /dev/shm."""


class IncompatibleSegment(UcmError):
    """The segment is a ucmcache segment, but of another layout version or other params."""


class CorruptSegment(UcmError):
    """The segment's words are not what any ucmcache could have written."""


class HalfMadeSegment(CorruptSegment):
    """The segment's creator died before it finished; create() replaces it."""


class ForeignSegment(UcmError):
    """The segment belongs to another user (refused unless allow_other_user=True)."""


class SharedMemoryFull(UcmError):
    """/dev/shm has too little room for the segment asked for."""


class RankUnavailable(UcmError):
    """The rank asked for is held by a live process, or every rank is."""


class HandleClosed(UcmError):
    """A closed handle (or one released by close()) was used."""


class NotAttached(UcmError):
    """The cache was closed, or this process was forked from the one that attached it."""


class LockTimeout(UcmError, TimeoutError):
    """A bucket's stripe lock, or a slot being rewritten, stayed held past the deadline; the
    message names the stripe and its holder (rank, pid, stopped or gone)."""


class Unsupported(UcmError):
    """The call cannot be done as this cache is configured (delete with a tier 2 beneath it:
    the tier would serve the deleted bytes again at the next get)."""
