"""Loading a checkpoint directory never runs code from it."""

import pickle

import pytest
import torch

from kvgraph.engine.loading import load_model
from kvgraph.errors import ConfigError
from kvgraph.presets import save_preset
from tests.naming import raises_naming


class Payload:
    """Unpickling this calls ``exec``: it writes ``marker``, as an attack would run anything."""

    def __init__(self, marker) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').write('payload ran')",)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_preset("llama-tiny", tmp_path_factory.mktemp("llama-tiny"))


def _with_bin(checkpoint, tmp_path, content: bytes, keep_safetensors: bool):
    directory = tmp_path / "ckpt"
    directory.mkdir()
    for f in checkpoint.iterdir():
        if keep_safetensors or f.suffix != ".safetensors":
            (directory / f.name).write_bytes(f.read_bytes())
    (directory / "pytorch_model.bin").write_bytes(content)
    return directory


def test_the_payload_runs_when_unpickled_plainly(tmp_path):
    # The control: the same bytes do run code under pickle.load, so the refusal below is real.
    marker = tmp_path / "ran"
    pickle.loads(pickle.dumps(Payload(marker)))
    assert marker.read_text() == "payload ran"


def test_a_malicious_pickle_is_refused_and_never_runs(checkpoint, tmp_path):
    marker = tmp_path / "ran"
    directory = _with_bin(checkpoint, tmp_path, pickle.dumps({"model.embed_tokens.weight": Payload(marker)}), False)
    with raises_naming(ConfigError, "checkpoint directory", f"'{directory}'", "could not be loaded"):
        load_model(directory)
    assert not marker.exists()


def test_safetensors_are_preferred_over_a_bin_in_the_same_directory(checkpoint, tmp_path):
    marker = tmp_path / "ran"
    directory = _with_bin(checkpoint, tmp_path, pickle.dumps(Payload(marker)), True)
    model, tokenizer = load_model(directory)
    assert not marker.exists() and tokenizer is not None
    reference, _ = load_model(checkpoint)
    for (name, p), q in zip(model.state_dict().items(), reference.state_dict().values(), strict=True):
        assert torch.equal(p, q), name


def test_a_plain_weights_bin_loads_with_weights_only(checkpoint, tmp_path):
    reference, _ = load_model(checkpoint)
    directory = tmp_path / "bin"
    reference.save_pretrained(directory)
    (directory / "model.safetensors").unlink()
    torch.save(reference.state_dict(), directory / "pytorch_model.bin")
    model, _ = load_model(directory)
    ids = torch.tensor([[3, 4, 5]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, reference(ids).logits)


def test_checkpoint_code_never_runs_without_trust_remote_code(checkpoint, tmp_path):
    marker = tmp_path / "ran"
    directory = _with_bin(checkpoint, tmp_path, b"", True)
    (directory / "pytorch_model.bin").unlink()
    (directory / "modeling_evil.py").write_text(f"open({str(marker)!r}, 'w').write('payload ran')\n")
    config = (directory / "config.json").read_text()
    (directory / "config.json").write_text(
        config.replace("{", '{"auto_map": {"AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"},', 1))
    with raises_naming(ConfigError, "checkpoint directory", "config.json auto_map", "trust_remote_code=True"):

        load_model(directory)
    assert not marker.exists()
