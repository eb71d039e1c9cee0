"""One root, one class per concern, and the built-in classes callers already catch on."""

import pytest

import kvgraph
from kvgraph import errors
from kvgraph.errors import (
    BatchTypeError,
    ConfigError,
    CppKernelError,
    EngineFailure,
    InvalidParamsError,
    KVCacheError,
    KVGraphError,
    LoweringError,
    MissingExtraError,
    RequestError,
)


def test_every_error_kvgraph_defines_is_a_kvgraph_error():
    defined = [v for v in vars(errors).values() if isinstance(v, type) and issubclass(v, BaseException)]
    assert len(defined) > 10 and all(issubclass(e, KVGraphError) for e in defined)


@pytest.mark.parametrize("error, builtin", [
    (KVCacheError, ValueError), (ConfigError, ValueError), (RequestError, ValueError), (BatchTypeError, TypeError),
    (LoweringError, RuntimeError), (CppKernelError, RuntimeError), (EngineFailure, RuntimeError),
    (MissingExtraError, ImportError),
])
def test_an_error_stays_the_builtin_callers_catch(error, builtin):
    assert issubclass(error, builtin)


def test_invalid_params_is_a_cache_error_and_a_config_error():
    assert issubclass(InvalidParamsError, KVCacheError) and issubclass(InvalidParamsError, ConfigError)


def test_the_old_import_paths_still_name_the_same_classes():
    from kvgraph.entrypoints.serve.async_engine import EngineFailure as served
    from kvgraph.ops.cpp import CppKernelError as kernel

    assert served is EngineFailure and kernel is CppKernelError and kvgraph.KVGraphError is KVGraphError
