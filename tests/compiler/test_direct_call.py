"""A precompiled graph called with its arguments gathered by a checked plan
(``kvgraph.compiler.direct_call.DirectCall``), on stand-ins for Dynamo's bytecode: a function that
gathers the graph's arguments from the module and the step's keywords and calls the graph through
its globals, as the captured bytecode does."""

import pytest
import torch

from kvgraph.compiler.direct_call import DirectCall, model_logits
from kvgraph.errors import LoweringError


class Module(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(4, 3))


def graph(*args):
    """What the graph computes from (T, input_ids, weight, scale): logits [1, T, 4], and a second result."""
    tokens, input_ids, weight, scale = args
    assert input_ids.shape[1] == tokens
    logits = (weight[input_ids % 4] * scale).sum(-1, keepdim=True).expand(1, tokens, 4)
    return [logits.clone(), torch.zeros(1)]


BYTECODE = {
    # a size, the step's tensor, a parameter and a constant, as Dynamo passes them
    "plain": "def fn(module, **kwargs):\n"
             "    calls.append(1)\n"
             "    ids = kwargs['input_ids']\n"
             "    return Output(logits=__compiled_fn_7(ids.shape[1], ids, module._parameters['weight'], 2.0)[0])\n",
    # a fresh tensor each call: no plan can stand for it
    "fresh": "def fn(module, **kwargs):\n"
             "    calls.append(1)\n"
             "    ids = kwargs['input_ids']\n"
             "    return Output(logits=__compiled_fn_7(ids.shape[1], ids.clone(), module._parameters['weight'], 2.0)[0])\n",
    # logits computed after the graph, not one of its results
    "after": "def fn(module, **kwargs):\n"
             "    calls.append(1)\n"
             "    ids = kwargs['input_ids']\n"
             "    return Output(logits=__compiled_fn_7(ids.shape[1], ids, module._parameters['weight'], 2.0)[0] + 0)\n",
}


class Compiled:
    """Stands for an ``AOTCompiledFunction`` whose guards are off: ``fn`` is its bytecode."""

    def __init__(self, kind: str) -> None:
        self.calls: list[int] = []
        scope = {"__compiled_fn_7": graph, "calls": self.calls, "Output": Output}
        exec(BYTECODE[kind], scope)
        self.fn = scope["fn"]

    def __call__(self, model, **kwargs):
        return self.fn(model, **kwargs)


class Output(dict):
    @property
    def logits(self):
        return self["logits"]


def step(tokens: int) -> dict:
    return {"input_ids": torch.arange(tokens).view(1, tokens), "position_ids": torch.arange(tokens).view(1, tokens)}


def expected(module: Module, kwargs: dict) -> torch.Tensor:
    return graph(kwargs["input_ids"].shape[1], kwargs["input_ids"], module.weight, 2.0)[0]


def run(call: DirectCall, module: Module, tokens: int) -> torch.Tensor:
    kwargs = step(tokens)
    out = call(module, **kwargs)
    torch.testing.assert_close(out, expected(module, kwargs), rtol=0, atol=0)
    return out


def test_a_dynamic_graph_goes_direct_after_a_call_of_another_token_count():
    module, compiled = Module(), Compiled("plain")
    call = DirectCall(compiled, dynamic=True)
    run(call, module, 5)  # recorded
    run(call, module, 5)  # the same sizes: the size and the constant cannot be told apart yet
    assert not call.direct and call.refused is None
    run(call, module, 3)  # checked: the size follows input_ids' axis 1, 2.0 stays
    assert call.direct
    assert len(compiled.calls) == 3
    for tokens in (7, 2, 9):  # the graph gets each call's token count, the bytecode is not run
        run(call, module, tokens)
    assert len(compiled.calls) == 3


def test_a_static_graph_goes_direct_after_its_second_call():
    module, compiled = Module(), Compiled("plain")
    call = DirectCall(compiled, dynamic=False)
    run(call, module, 1)
    assert not call.direct
    run(call, module, 1)
    assert call.direct and len(compiled.calls) == 2
    run(call, module, 1)
    assert len(compiled.calls) == 2


def test_parameters_updated_in_place_are_seen_by_direct_calls():
    module, compiled = Module(), Compiled("plain")
    call = DirectCall(compiled, dynamic=False)
    for _ in range(2):
        run(call, module, 1)
    with torch.no_grad():
        module.weight.mul_(3)
    run(call, module, 1)  # compares with the graph on the updated weight
    assert call.direct


@pytest.mark.parametrize("kind, reason", [("fresh", "argument 1"), ("after", "not one of the graph's results")])
def test_the_bytecode_keeps_running_where_no_plan_stands_for_it(kind, reason):
    module, compiled = Module(), Compiled(kind)
    call = DirectCall(compiled, dynamic=True)
    for tokens in (4, 2, 6, 3):
        out = call(module, **step(tokens))
        assert out.shape == (1, tokens, 4)
    assert not call.direct and reason in call.refused
    assert len(compiled.calls) == 4


def test_a_compiled_function_without_one_graph_in_its_globals_is_called_as_it_is():
    class Plain:
        def __init__(self):
            self.fn = lambda module, **kwargs: Output(logits=kwargs["input_ids"].float())

        def __call__(self, model, **kwargs):
            return self.fn(model, **kwargs)

    call = DirectCall(Plain(), dynamic=True)
    for tokens in (2, 3, 4):
        assert call(Module(), **step(tokens)).shape == (1, tokens)
    assert not call.direct


def test_model_logits_reads_tensors_outputs_and_tuples():
    x = torch.ones(2)
    assert model_logits(x) is x
    assert model_logits(Output(logits=x)) is x
    assert model_logits((x, None)) is x
    with pytest.raises(LoweringError, match="carries no logits tensor"):
        model_logits({"scores": x})
