"""Typed errors of kvgraph.

Every caller mistake raises a subclass of :class:`KVCacheError` (itself a
``ValueError``) whose message names the offending value and the limit it broke.
Methods that raise leave the object they were called on exactly as it was.
"""

from __future__ import annotations


class KVCacheError(ValueError):
    """Root of the KV-cache error hierarchy."""


class InvalidParamsError(KVCacheError):
    """A ``KVCacheParams`` field or a manager size is out of range."""


class UnknownSequenceError(KVCacheError):
    """A seq_id that was never claimed or has already been released."""


class DuplicateSequenceError(KVCacheError):
    """A seq_id that is already claimed (double claim) or repeated in one batch."""


class NoFreeSlotsError(KVCacheError):
    """``claim`` asked for more sequences than ``slots_remaining``."""


class BatchTypeError(KVCacheError, TypeError):
    """A batch (or one of its elements) of the wrong type, e.g. a bare seq_id for a ``KVRequest``."""


class BatchSizeError(KVCacheError):
    """A batch larger than ``max_batch_size`` (or empty where one is required)."""


class SequenceLengthError(KVCacheError):
    """A step would take a sequence past ``max_seq_len``."""


class CacheInputError(KVCacheError):
    """Tensors whose dtype, device or shape do not match the cache."""


class StepError(KVCacheError):
    """``step`` for a sequence that was not fetched, or commits more tokens than were reserved."""


class OutOfPagesError(KVCacheError):
    """``fetch`` needs more free pages than the pool has; ``can_fetch`` would have said no.

    Not a bug in itself: a scheduler asks ``can_fetch`` first and waits or preempts.
    """


class BindingError(RuntimeError):
    """A compiled kvgraph callable ran without bound KV inputs, or with ones that do not fit the graph."""


class LoweringError(RuntimeError):
    """A graph pass met an attention site (or graph) it cannot lower correctly."""


class WindowNotShownError(LoweringError):
    """A graph captured for a fixed token count ``T`` (Dynamo's ``T == 1``) has a mask with sizes
    beyond ``T`` (a sliding window it cannot show), and no graph of several tokens of the same
    model has been lowered yet to tell; lowering one first resolves it."""


class RankFailedError(RuntimeError):
    """A rank of a tensor-parallel group died, hung past its timeout or could not start; the
    message names it. The group is shut down: the ``LLM`` that owned it takes no more steps."""


class WarmCacheError(RuntimeError):
    """A timed benchmark run began with prefixes in the cache: what an earlier run left behind would
    make its figure a cache hit, not a measurement."""


KVGRAPH_ERRORS = (KVCacheError, BindingError, LoweringError, RankFailedError, WarmCacheError)
"""Every error kvgraph raises on purpose: a caller's mistake, a model it cannot serve, a lost rank."""
