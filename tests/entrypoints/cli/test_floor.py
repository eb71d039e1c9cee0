import pytest
import torch

from kvgraph.entrypoints.cli.floor import linear_layers, matmul_floor
from kvgraph.presets import load_preset


class _Known(torch.nn.Module):
    """Three linear layers, the last one the output projection."""

    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(8, 16)
        self.down = torch.nn.Linear(16, 8, bias=False)
        self.head = torch.nn.Linear(8, 32, bias=False)

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.head


def _spy(monkeypatch, name: str, module=torch) -> list[tuple]:
    """Record ``(shape of each tensor argument)`` of every call of ``module.name``."""
    calls, op = [], getattr(module, name)

    def spy(*args):
        calls.append(tuple(tuple(a.shape) if a is not None else None for a in args))
        return op(*args)

    monkeypatch.setattr(module, name, spy)
    return calls


def test_floor_runs_each_linear_on_the_calls_tokens_and_the_head_on_one_row_per_sequence(monkeypatch):
    calls = _spy(monkeypatch, "linear", torch.nn.functional)
    elapsed = matmul_floor(_Known(), [(5, 2), (2, 2), (2, 2)])
    assert elapsed > 0

    def replay(tokens, batch):
        return [((tokens, 8), (16, 8), (16,)), ((tokens, 16), (8, 16), None), ((batch, 8), (32, 8), None)]

    warm = replay(2, 2) + replay(5, 2)  # one untimed replay per distinct call shape
    assert calls == warm + replay(5, 2) + replay(2, 2) + replay(2, 2)


def test_floor_runs_gpt2_conv1d_as_addmm_on_its_in_out_weight(monkeypatch):
    model, _ = load_preset("gpt2-tiny")
    layers = linear_layers(model)
    assert [(layer.transposed, layer.in_features) for layer in layers] == [
        (True, 64), (True, 64), (True, 64), (True, 256),  # c_attn, attn.c_proj, mlp.c_fc, mlp.c_proj
    ] * 2 + [(False, 64)]
    assert [layer.per_sequence for layer in layers] == [False] * 8 + [True]
    conv = model.transformer.h[0].attn.c_attn
    x = torch.randn(3, 64)
    op, args = layers[0].call(x)
    torch.testing.assert_close(op(*args), conv(x))

    addmm = _spy(monkeypatch, "addmm")
    linear = _spy(monkeypatch, "linear", torch.nn.functional)
    matmul_floor(model, [(4, 2)])
    assert addmm[:4] == [((192,), (4, 64), (64, 192)), ((64,), (4, 64), (64, 64)),
                         ((256,), (4, 64), (64, 256)), ((64,), (4, 256), (256, 64))]
    assert len(addmm) == 2 * 8 and linear == [((2, 64), (259, 64), None)] * 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_floor_inputs_have_the_models_dtype(monkeypatch, dtype):
    calls = []
    linear = torch.nn.functional.linear
    monkeypatch.setattr(torch.nn.functional, "linear", lambda x, w, b: calls.append(x.dtype) or linear(x, w, b))
    matmul_floor(_Known().to(dtype), [(3, 1)])
    assert calls == [dtype] * 6


def test_only_the_llama_output_projection_runs_per_sequence():
    model, _ = load_preset("llama-tiny")
    layers = linear_layers(model)
    assert len(layers) == 7 * model.config.num_hidden_layers + 1  # q k v o gate up down, lm_head
    assert [layer.weight is model.lm_head.weight for layer in layers] == [False] * (len(layers) - 1) + [True]
    assert [layer.per_sequence for layer in layers] == [False] * (len(layers) - 1) + [True]
