"""Incremental detokenization: deltas add up to the whole text, incomplete UTF-8 is held, cost stays flat."""

import pytest

from kvgraph.engine.detokenize import IncrementalDetokenizer
from kvgraph.presets import load_preset


@pytest.fixture(scope="module")
def tokenizer():
    return load_preset("llama-tiny")[1]


def _deltas(tokenizer, ids: list[int]) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer)
    return [detok.delta(ids[: i + 1], final=i == len(ids) - 1) for i in range(len(ids))]


@pytest.mark.parametrize("text", ["hello world", "héllo wörld ✓ 日本語", "a\nb\tc  d", "🙂🙃"])
def test_deltas_join_to_the_whole_text(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    deltas = _deltas(tokenizer, ids)
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True) == text
    assert all("\ufffd" not in d for d in deltas)


def test_a_multibyte_character_is_held_until_complete(tokenizer):
    ids = tokenizer.encode("✓", add_special_tokens=False)  # three byte tokens
    assert len(ids) == 3
    assert _deltas(tokenizer, ids) == ["", "", "✓"]


def test_an_incomplete_character_is_flushed_when_final(tokenizer):
    ids = tokenizer.encode("✓", add_special_tokens=False)[:2]
    deltas = _deltas(tokenizer, ids)
    assert deltas[0] == "" and deltas[-1] == tokenizer.decode(ids, skip_special_tokens=True)


class _SentencePieceLike:
    """Decodes like SentencePiece: a piece's leading space is dropped at the start of the text."""

    pieces = {1: " Hello", 2: " world", 3: "!", 4: " again"}

    def __init__(self):
        self.calls = []

    def decode(self, ids, skip_special_tokens=True):
        self.calls.append(len(ids))
        return "".join(self.pieces[i] for i in ids).removeprefix(" ")


def test_left_context_keeps_spaces_that_a_lone_piece_would_lose():
    tok = _SentencePieceLike()
    ids = [1, 2, 3, 4, 2]
    assert "".join(_deltas(tok, ids)) == tok.decode(ids)


def test_each_token_decodes_a_window_of_constant_size():
    tok = _SentencePieceLike()
    ids = [1, 2, 3, 4] * 50
    _deltas(tok, ids)
    assert max(tok.calls) <= 2


def test_a_fast_tokenizer_is_decoded_by_its_rust_tokenizer_with_the_same_text(tokenizer):
    """The Hugging Face wrapper is skipped where all it does is call ``tokenizers``: same deltas."""
    import random

    from tokenizers import Tokenizer

    from kvgraph.engine.detokenize import text_decoder

    decode = text_decoder(tokenizer)
    assert decode.__code__.co_freevars == ("backend",) and isinstance(tokenizer._tokenizer, Tokenizer)
    rng = random.Random(0)
    specials = list(tokenizer.all_special_ids)
    for _ in range(20):
        ids = [rng.choice(specials) if rng.random() < 0.1 else rng.randrange(tokenizer.vocab_size)
               for _ in range(rng.randrange(1, 40))]
        assert decode(ids) == tokenizer.decode(ids, skip_special_tokens=True)
        slow = IncrementalDetokenizer(tokenizer)
        slow.decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)
        fast = IncrementalDetokenizer(tokenizer)
        assert [fast.delta(ids[: i + 1], i == len(ids) - 1) for i in range(len(ids))] == [
            slow.delta(ids[: i + 1], i == len(ids) - 1) for i in range(len(ids))]


def test_a_tokenizer_that_cleans_up_spaces_keeps_its_own_decode(tokenizer, monkeypatch):
    from kvgraph.engine.detokenize import text_decoder

    monkeypatch.setattr(tokenizer, "clean_up_tokenization_spaces", True)
    assert text_decoder(tokenizer).__code__.co_freevars == ("decode",)
    assert text_decoder(_SentencePieceLike()).__code__.co_freevars == ("decode",)
    monkeypatch.setattr(tokenizer, "clean_up_tokenization_spaces", False)
    monkeypatch.setattr(tokenizer, "decode", lambda ids, skip_special_tokens=True: "patched", raising=False)
    assert text_decoder(tokenizer)([1, 2]) == "patched"  # an instance's own decode is kept
