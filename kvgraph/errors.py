"""Typed errors of kvgraph.

Every error kvgraph raises on purpose is a :class:`KVGraphError`, one subclass per concern:

==========================  ==============================================================
concern                     error (and the built-in it also is)
==========================  ==============================================================
configuration               :class:`ConfigError` (``ValueError``): an engine, CLI, sampling
                            or backend value out of range; :class:`InvalidParamsError` for
                            a ``KVCacheParams`` field or a manager size
request                     :class:`RequestError` (``ValueError``): a prompt or request id
                            the engine cannot take
cache use                   :class:`KVCacheError` (``ValueError``) and its subclasses: an
                            unknown or repeated sequence, a bad batch, a sequence too long,
                            inputs that do not fit the cache, no free pages
lowering                    :class:`LoweringError` (``RuntimeError``): a model or graph kvgraph
                            cannot lower (or split over ranks) correctly
binding                     :class:`BindingError` (``RuntimeError``)
kernel                      :class:`CppKernelError` (``RuntimeError``): a kernel that cannot be
                            built or loaded
rank                        :class:`RankFailedError` (``RuntimeError``)
engine                      :class:`EngineFailure` (``RuntimeError``)
benchmark                   :class:`WarmCacheError` (``RuntimeError``)
installation                :class:`MissingExtraError` (``ImportError``)
==========================  ==============================================================

A caller's mistake names the offending value and the limit it broke. Methods that raise leave
the object they were called on exactly as it was.
"""

from __future__ import annotations


class KVGraphError(Exception):
    """Root of every error kvgraph raises on purpose."""


class ConfigError(KVGraphError, ValueError):
    """An engine, CLI, sampling or backend value is out of range."""


class RequestError(KVGraphError, ValueError):
    """A request the engine cannot take: a bad prompt, an unknown request id, a sampling list that
    does not match the prompts."""


class KVCacheError(KVGraphError, ValueError):
    """Root of the KV-cache use errors."""


class InvalidParamsError(KVCacheError, ConfigError):
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


class BindingError(KVGraphError, RuntimeError):
    """A compiled kvgraph callable ran without bound KV inputs, or with ones that do not fit the graph."""


class LoweringError(KVGraphError, RuntimeError):
    """A model, graph or attention site kvgraph cannot lower (or split over ranks) correctly."""


class WindowNotShownError(LoweringError):
    """A graph captured for a fixed token count ``T`` (Dynamo's ``T == 1``) has a mask with sizes
    beyond ``T`` (a sliding window it cannot show), and no graph of several tokens of the same
    model has been lowered yet to tell; lowering one first resolves it."""


class CppKernelError(KVGraphError, RuntimeError):
    """The C++ CPU kernel was asked for (``KVGRAPH_CPU_ATTENTION=cpp``) but cannot be built or loaded."""


class RankFailedError(KVGraphError, RuntimeError):
    """A rank of a tensor-parallel group died, hung past its timeout or could not start; the
    message names it. The group is shut down: the ``LLM`` that owned it takes no more steps."""


class EngineFailure(KVGraphError, RuntimeError):
    """The serving engine aborted a request: its step failed, or the server is shutting down."""


class WarmCacheError(KVGraphError, RuntimeError):
    """A timed benchmark run began with prefixes in the cache: what an earlier run left behind would
    make its figure a cache hit, not a measurement."""


class MissingExtraError(KVGraphError, ImportError):
    """A feature needs an optional dependency group (an extra) that is not installed."""


def require_extra(extra: str, feature: str, *modules: str) -> None:
    """Import ``modules``; :class:`MissingExtraError` naming ``extra`` if one is not installed."""
    import importlib

    try:
        for module in modules:
            importlib.import_module(module)
    except ImportError:
        raise MissingExtraError(
            f"{feature} needs the {extra!r} extra: pip install 'kvgraph[{extra}]'"
        ) from None
