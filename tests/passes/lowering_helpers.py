"""Helpers of the pass tests: captured graphs of tiny models, and a ragged KV cache to run them on.

``capture(model, **kwargs)`` compiles ``model`` with a recording backend (``dynamic=True``,
``fullgraph=True``) and returns the Dynamo graph and its example inputs. Captures are slow,
so model graphs are session fixtures (``conftest.py``) and tests lower a ``fresh()`` copy.

``RaggedCache`` holds a paged or continuous cache (pages / slots assigned here with plain
ints, in scrambled order) and builds the lowered graph's inputs for one step of a ragged
batch; ``run_step`` feeds them to a lowered graph and commits the new tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import transformers

import kvgraph.ops  # noqa: F401  (registers torch.ops.kvgraph.ragged_attention)
from kvgraph.cache.params import KVCacheParams
from kvgraph.passes.graph_view import copy_module, placeholder_kind

VOCAB = 128


@dataclass
class Captured:
    """A model, the graph Dynamo captured from it, and that graph's example inputs."""

    model: nn.Module
    gm: torch.fx.GraphModule
    example_inputs: list

    def fresh(self) -> torch.fx.GraphModule:
        """An independent copy of the graph (lowering modifies graphs in place)."""
        return copy_module(self.gm)


def capture(model: nn.Module, dynamic: bool = True, **kwargs) -> Captured:
    """The first (full) graph of ``model(**kwargs)`` under ``torch.compile``."""
    graphs = []

    def record(gm: torch.fx.GraphModule, example_inputs: list):
        graphs.append((gm, list(example_inputs)))
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(model, backend=record, dynamic=dynamic, fullgraph=True)
    with torch.no_grad():
        compiled(**kwargs)
    return Captured(model, *graphs[0])


def hf_kwargs(T: int = 6, seed: int = 0, device: str = "cpu") -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"input_ids": torch.randint(0, VOCAB, (1, T), generator=g).to(device),
            "position_ids": torch.arange(T, device=device)[None], "use_cache": False}


def tiny_llama(attn: str = "sdpa", layers: int = 2) -> nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, attn_implementation=attn,
    )
    return transformers.LlamaForCausalLM(config).eval()


def tiny_qwen2(attn: str = "sdpa") -> nn.Module:
    torch.manual_seed(0)
    config = transformers.Qwen2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, attn_implementation=attn,
    )
    return transformers.Qwen2ForCausalLM(config).eval()


def tiny_gpt2(attn: str = "sdpa") -> nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=64, n_embd=64, n_layer=2, n_head=4, attn_implementation=attn,
        bos_token_id=0, eos_token_id=0,
    )
    return transformers.GPT2LMHeadModel(config).eval()


class TinyDecoder(nn.Module):
    """Embeddings, ``n_layer`` attention blocks calling ``attn(q, k, v)`` ([1, H, T, D] each), a head.

    ``attn`` is a plain function written in the test: the attention variant under test.
    K/V have ``hkv`` heads; ``attn`` repeats them when it needs to.
    """

    def __init__(self, attn, n_layer: int = 2, hq: int = 4, hkv: int = 2, d: int = 8) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.attn, self.hq, self.hkv, self.d = attn, hq, hkv, d
        C = hq * d
        self.wte = nn.Embedding(VOCAB, C)
        self.wpe = nn.Embedding(64, C)
        self.qkv = nn.ModuleList(nn.Linear(C, (hq + 2 * hkv) * d) for _ in range(n_layer))
        self.out = nn.ModuleList(nn.Linear(C, C) for _ in range(n_layer))
        self.head = nn.Linear(C, VOCAB)
        self.eval()

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(input_ids, position_ids))

    def features(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """The hidden states before the head, ``[1, T, C]``."""
        x = self.wte(input_ids) + self.wpe(position_ids)  # [1, T, C]
        T = x.shape[1]
        for qkv, out in zip(self.qkv, self.out, strict=True):
            q, k, v = qkv(x).split([self.hq * self.d, self.hkv * self.d, self.hkv * self.d], dim=-1)
            q = q.view(1, T, self.hq, self.d).transpose(1, 2)
            k = k.view(1, T, self.hkv, self.d).transpose(1, 2)
            v = v.view(1, T, self.hkv, self.d).transpose(1, 2)
            y = self.attn(q, k, v)  # [1, hq, T, d]
            x = x + out(y.transpose(1, 2).reshape(1, T, self.hq * self.d))
        return x


def model_kwargs(T: int = 6, seed: int = 0) -> dict:
    """Inputs of NanoGPT and TinyDecoder: ``input_ids`` and ``position_ids`` ``[1, T]``."""
    kwargs = hf_kwargs(T, seed)
    del kwargs["use_cache"]
    return kwargs


def logits_of(out) -> torch.Tensor:
    return out.logits if hasattr(out, "logits") else out[0] if isinstance(out, tuple) else out


# -- running lowered graphs --
@dataclass
class RaggedCache:
    """A KV cache for ``batch`` sequences of at most ``max_len`` tokens, and their lengths so far."""

    params: KVCacheParams
    batch: int
    max_len: int = 16
    lengths: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        p = self.params
        self.lengths = [0] * self.batch
        if p.is_paged:
            pages_per_seq = -(-self.max_len // p.page_size)
            self.total_pages = self.batch * pages_per_seq + 1
            physical = torch.randperm(self.total_pages - 1, generator=torch.Generator().manual_seed(1))
            # lookup: [batch, logical_page] -> physical_page
            self.lookup = physical.view(self.batch, pages_per_seq).to(torch.int32).to(p.device)
            shape = (self.total_pages, 2, p.num_layers, p.page_size, p.n_kv_heads, p.head_dim)
        else:
            # lookup: [batch] -> slot (reversed, so that sequence b is not in slot b)
            self.lookup = torch.arange(self.batch - 1, -1, -1, dtype=torch.int32, device=p.device)
            shape = (self.batch, 2, p.num_layers, self.max_len, p.n_kv_heads, p.head_dim)
        self.blocks = torch.zeros(shape, dtype=p.dtype, device=p.device)

    def step_inputs(self, new: Sequence[int]) -> dict[str, torch.Tensor]:
        """The KV placeholders' values for one step adding ``new[b]`` tokens to sequence ``b``."""
        device = self.params.device
        offsets = torch.tensor([0, *new], dtype=torch.int32).cumsum(0, dtype=torch.int32).to(device)
        total = [c + n for c, n in zip(self.lengths, new, strict=True)]
        return {
            "kv_blocks": self.blocks,
            "cache_lengths": torch.tensor(self.lengths, dtype=torch.int32, device=device),
            "lookup_table": self.lookup,
            "max_lengths": torch.tensor([[max(new), max(total)]], dtype=torch.int32),
            "input_row_offsets": offsets,
            "logit_positions": offsets[1:] - 1,
        }


def graph_args(gm: torch.fx.GraphModule, captured: Captured, tensors: dict[str, torch.Tensor]) -> list:
    """Arguments for every placeholder of ``gm``: model inputs and KV tensors by name, the token-count
    SymInt, and the captured example value for parameters and constants."""
    names = [n.name for n in captured.gm.graph.find_nodes(op="placeholder")]
    T = tensors["input_ids"].shape[1]
    args = []
    for node in gm.graph.find_nodes(op="placeholder"):
        key = next((k for k in tensors if node.name in (k, f"l_{k}_", f"l_kwargs_{k}_")), None)
        if key is not None:
            args.append(tensors[key])
        elif placeholder_kind(node) == "size":
            args.append(T)
        else:
            args.append(captured.example_inputs[names.index(node.name)])
    return args


def run_step(
    gm: torch.fx.GraphModule, captured: Captured, cache: RaggedCache, seqs: Sequence[Sequence[int]],
) -> torch.Tensor:
    """Run one ragged step: ``seqs[b]`` are the new tokens of sequence b; returns the graph's logits."""
    new = [len(s) for s in seqs]
    positions = [torch.arange(c, c + n) for c, n in zip(cache.lengths, new, strict=True)]
    device = cache.params.device
    tensors = {
        "input_ids": torch.tensor([t for s in seqs for t in s], device=device)[None],
        "position_ids": torch.cat(positions).to(device)[None],
        **cache.step_inputs(new),
    }
    with torch.no_grad():
        out = gm(*graph_args(gm, captured, tensors))
    cache.lengths = [c + n for c, n in zip(cache.lengths, new, strict=True)]
    return out[0]


def steps_against_eager(
    captured: Captured, result, steps: Sequence[Sequence[Sequence[int]]], max_len: int = 32,
    atol: float = 1e-5, rtol: float = 0.0,
) -> None:
    """Run ``steps`` (per step, the new tokens of each sequence) of ``result``'s lowered graph over
    one cache; each step's logits must be eager's for the whole sequence so far."""
    cache = RaggedCache(result.params, batch=len(steps[0]), max_len=max_len)
    seen: list[list[int]] = [[] for _ in steps[0]]
    for step in steps:
        logits = run_step(result.gm, captured, cache, step)
        for b, new in enumerate(step):
            seen[b] += new
            torch.testing.assert_close(logits[0, b], eager_last_logits(captured.model, seen[b]), atol=atol, rtol=rtol)


def eager_last_logits(model: nn.Module, tokens: Sequence[int]) -> torch.Tensor:
    """The model's own logits for the last of ``tokens`` (one sequence, positions from 0)."""
    device = next(model.parameters()).device
    ids = torch.tensor(tokens, device=device)[None]
    kwargs = {"input_ids": ids, "position_ids": torch.arange(len(tokens), device=device)[None]}
    if isinstance(model, transformers.PreTrainedModel):
        kwargs["use_cache"] = False
    with torch.no_grad():
        logits = logits_of(model(**kwargs))  # [1, T, V], or [1, V] for a model that keeps the last token
    return logits[0, -1] if logits.dim() == 3 else logits[-1]


def lowered_ops(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.target is torch.ops.kvgraph.ragged_attention.default]


def count_calls(gm: torch.fx.GraphModule, *names: str) -> int:
    """Calls whose target's name contains one of ``names``."""
    def name(n: torch.fx.Node) -> str:
        return n.target if isinstance(n.target, str) else getattr(n.target, "__name__", str(n.target))
    return sum(1 for n in gm.graph.nodes if n.op.startswith("call") and any(s in name(n) for s in names))
