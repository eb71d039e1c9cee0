import pytest
import torch

from kvgraph.errors import ConfigError
from kvgraph.presets import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    PRESETS,
    VOCAB_SIZE,
    byte_tokenizer,
    load_preset,
    preset_names,
    save_preset,
)


def test_presets_include_the_documented_names():
    assert {"llama-tiny", "gpt2-tiny", "qwen2-tiny", "llama-small", "llama-56m"} <= set(preset_names())


def test_llama_56m_has_56m_untied_parameters():
    from transformers import AutoModelForCausalLM

    config = PRESETS["llama-56m"].config()
    with torch.device("meta"):  # shapes only: no seconds of random init
        model = AutoModelForCausalLM.from_config(config)
    embed, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    assert head is not embed and embed.shape == head.shape == (32000, 512)
    assert sum(p.numel() for p in model.model.layers.parameters()) == 23_601_152
    assert sum(p.numel() for p in model.parameters()) == 56_369_664
    assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == (BOS_ID, EOS_ID, PAD_ID)
    assert (config.num_attention_heads, config.num_key_value_heads, config.intermediate_size) == (8, 4, 1408)


@pytest.mark.slow
def test_llama_56m_runs_on_byte_tokenizer_text():
    model, tok = load_preset("llama-56m")
    ids = tok.encode("Hi!")
    assert max(ids) < VOCAB_SIZE
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids]), position_ids=torch.arange(len(ids))[None]).logits
    assert logits.shape == (1, len(ids), 32000) and logits.isfinite().all()


@pytest.mark.parametrize("name", ["llama-tiny", "gpt2-tiny", "qwen2-tiny"])
def test_preset_weights_are_seeded_and_the_model_runs(name):
    a, _ = load_preset(name)
    b, _ = load_preset(name)
    c, _ = load_preset(name, seed=1)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert any(not torch.equal(sa[k], sc[k]) for k in sa if sa[k].is_floating_point())
    assert a.config.vocab_size == VOCAB_SIZE and a.config.eos_token_id == EOS_ID
    ids = torch.tensor([[5, 6, 7]])
    with torch.no_grad():
        logits = a(input_ids=ids, position_ids=torch.arange(3)[None]).logits
    assert logits.shape == (1, 3, VOCAB_SIZE)


def test_loading_a_preset_leaves_the_global_rng_alone():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    load_preset("llama-tiny")
    assert torch.equal(torch.rand(3), expected)


def test_byte_tokenizer_round_trips_any_text():
    tok = byte_tokenizer()
    text = "Hello, wörld! ✓\n\ttabs"
    ids = tok.encode(text)
    assert ids == [b + 3 for b in text.encode("utf-8")]
    assert tok.decode(ids) == text
    assert len(tok) == VOCAB_SIZE and tok.eos_token_id == EOS_ID and tok.bos_token_id == BOS_ID
    assert tok.decode([BOS_ID, *ids, EOS_ID], skip_special_tokens=True) == text


def test_a_large_vocabulary_decodes_every_id_to_text_that_no_text_encodes_into():
    tok = byte_tokenizer(32000)
    assert len(tok) == 32000
    words = tok.convert_ids_to_tokens(list(range(VOCAB_SIZE, 32000)))
    assert len(set(words)) == 32000 - VOCAB_SIZE
    texts = [tok.decode([i]) for i in range(VOCAB_SIZE, 32000)]
    assert all(t.startswith(" ") and t[1:].isalpha() and t[1:].islower() and 2 < len(t) <= 5 for t in texts)
    text = "".join(texts[:50]) + " hello wörld"  # the words themselves encode byte by byte
    ids = tok.encode(text, add_special_tokens=False)
    assert ids == [b + 3 for b in text.encode("utf-8")] and tok.decode(ids) == text


def test_a_preset_gets_a_tokenizer_of_its_vocabulary(monkeypatch):
    import kvgraph.presets as presets

    preset = presets.Preset("llama-1000", "test", lambda: presets._llama(16, 1, 2, 2, vocab_size=1000))
    monkeypatch.setitem(presets.PRESETS, preset.name, preset)
    model, tok = load_preset(preset.name)
    assert model.config.vocab_size == len(tok) == 1000 and tok.decode([999]) != ""
    assert len(load_preset("llama-tiny")[1]) == VOCAB_SIZE


def test_a_vocabulary_smaller_than_the_bytes_is_refused():
    with pytest.raises(ConfigError, match="at least 259 ids, got 100"):
        byte_tokenizer(100)


def test_unknown_preset_names_the_choices():
    with pytest.raises(ConfigError, match="'llama-huge'.*llama-tiny"):
        load_preset("llama-huge")


def test_save_preset_writes_a_loadable_checkpoint(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    save_preset("llama-tiny", tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, local_files_only=True)
    tok = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    ref, _ = load_preset("llama-tiny")
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in ref.state_dict().items())
    assert tok.decode(tok.encode("abc")) == "abc"
