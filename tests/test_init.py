import importlib

import pytest

import kvgraph
from tests.naming import raises_naming


@pytest.mark.parametrize("name", kvgraph.__all__)
def test_every_public_name_resolves_to_its_module(name):
    value = getattr(kvgraph, name)
    module = importlib.import_module(kvgraph._WHERE[name])
    assert value is getattr(module, name)


def test_unknown_names_raise_attribute_error():
    with raises_naming(AttributeError, "'kvgraph'", "'nope'"):

        _ = kvgraph.nope
