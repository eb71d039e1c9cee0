"""Built-in tiny models: Hugging Face configs with seeded random weights and a byte-level tokenizer.

Nothing is downloaded: each preset builds its model from a config in code
(``AutoModelForCausalLM.from_config`` under a fixed seed, so two loads give the
same weights) and shares one tokenizer built in code: ids 0..2 are
``<pad>``, ``<s>``, ``</s>``, ids 3..258 are the 256 bytes, so any text encodes.
``llama-56m`` has a 32000-token vocabulary, as Llama's own tokenizer, so that its embedding and
output projection weigh what a real model's do. Its tokenizer names every id: past the bytes, each
is a short word (a space and two to four letters, in order) that text never encodes into (the BPE
has no merges), so text still encodes into ids below 259 while every generated id decodes to text,
as a real tokenizer's do. (When those ids decoded to nothing, a streamed reply came as one chunk,
and a serving benchmark measured no per-token streaming at all.)
"""

from __future__ import annotations

import itertools
import string
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from kvgraph.errors import ConfigError

PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
SPECIAL_TOKENS = ("<pad>", "<s>", "</s>")
VOCAB_SIZE = len(SPECIAL_TOKENS) + 256
DEFAULT_PRESET = "llama-tiny"
# Wider than Hugging Face's 0.02 so that random logits have clear maxima and greedy
# decoding does not hinge on rounding.
INIT_RANGE = 0.1


@dataclass(frozen=True)
class Preset:
    name: str
    description: str
    config: Callable[[], object]


def _special_ids(vocab_size: int = VOCAB_SIZE) -> dict:
    return dict(vocab_size=vocab_size, bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID)


def _llama(
    hidden: int, layers: int, heads: int, kv_heads: int, *, intermediate: int | None = None,
    vocab_size: int = VOCAB_SIZE,
):
    """A Llama config; the MLP is ``2 * hidden`` wide unless ``intermediate`` says otherwise."""
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=hidden, intermediate_size=intermediate or 2 * hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=4096,
        initializer_range=INIT_RANGE, **_special_ids(vocab_size),
    )


def _gpt2():
    from transformers import GPT2Config

    return GPT2Config(
        n_embd=64, n_layer=2, n_head=4, n_positions=4096, initializer_range=INIT_RANGE, **_special_ids()
    )


def _qwen2():
    from transformers import Qwen2Config

    return Qwen2Config(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=4096, initializer_range=INIT_RANGE,
        **_special_ids(),
    )


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset("llama-tiny", "Llama, 2 layers, hidden 64, 4 query / 2 KV heads (GQA)", lambda: _llama(64, 2, 4, 2)),
        Preset("gpt2-tiny", "GPT-2, 2 layers, hidden 64, 4 heads, learned positions", _gpt2),
        Preset("qwen2-tiny", "Qwen2, 2 layers, hidden 64, 4 query / 2 KV heads, QKV bias", _qwen2),
        Preset("llama-small", "Llama, 4 layers, hidden 256, 8 query / 4 KV heads (GQA)", lambda: _llama(256, 4, 8, 4)),
        Preset(
            "llama-56m",
            "Llama, ~56M parameters: 8 layers, hidden 512, MLP 1408, 8 query / 4 KV heads (GQA), "
            "32000-token vocabulary, untied embeddings",
            lambda: _llama(512, 8, 8, 4, intermediate=1408, vocab_size=32000),
        ),
    )
}


def preset_names() -> list[str]:
    return list(PRESETS)


def is_preset(name: str) -> bool:
    return name in PRESETS


def load_preset(
    name: str, *, seed: int = 0, dtype: torch.dtype | None = None
) -> tuple[torch.nn.Module, object]:
    """The preset's model (eval mode, weights seeded by ``seed``) and the byte-level tokenizer."""
    preset = PRESETS.get(name)
    if preset is None:
        raise ConfigError(f"unknown preset {name!r}; expected one of {', '.join(PRESETS)}")
    from transformers import AutoModelForCausalLM

    config = preset.config()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
    if dtype is not None:
        model = model.to(dtype)
    return model.eval(), byte_tokenizer(config.vocab_size)


def byte_tokenizer(vocab_size: int = VOCAB_SIZE):
    """A ``PreTrainedTokenizerFast`` over the 256 bytes plus ``<pad>``, ``<s>``, ``</s>``; ids from
    259 up to ``vocab_size`` are words that decode to text but that no text encodes into."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < VOCAB_SIZE:
        raise ConfigError(f"a byte tokenizer needs a vocabulary of at least {VOCAB_SIZE} ids, got {vocab_size}")
    vocab = {s: i for i, s in enumerate(SPECIAL_TOKENS)}
    for c in _byte_chars():
        vocab[c] = len(vocab)
    for word in itertools.islice(_words(), vocab_size - VOCAB_SIZE):
        vocab[word] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=SPECIAL_TOKENS[PAD_ID], bos_token=SPECIAL_TOKENS[BOS_ID],
        eos_token=SPECIAL_TOKENS[EOS_ID],
    )


def _words() -> Iterator[str]:
    """Words " aa", " ab", ..., " zz", " aaa", ...: a space (``Ġ`` in the byte alphabet), then letters."""
    space = _byte_chars()[ord(" ")]
    for length in itertools.count(2):
        for letters in itertools.product(string.ascii_lowercase, repeat=length):
            yield space + "".join(letters)


def _byte_chars() -> list[str]:
    """GPT-2's byte -> printable character map, in byte order (the ByteLevel pre-tokenizer's alphabet)."""
    printable = {*range(33, 127), *range(161, 173), *range(174, 256)}
    extra = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(extra)) for b in range(256)]


def save_preset(name: str, directory: str | Path, *, seed: int = 0) -> Path:
    """Write the preset as a local Hugging Face checkpoint (model and tokenizer) into ``directory``."""
    model, tokenizer = load_preset(name, seed=seed)
    directory = Path(directory)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory
