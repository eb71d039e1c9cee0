"""Log-probabilities in OpenAI's shapes: offsets that run on across chunks, the chosen token always
in a completion's alternatives, ``-inf`` shown as a number JSON can hold."""

import json

from kvgraph.engine import TokenEvent, TokenLogprobs
from kvgraph.entrypoints.serve.logprobs import FLOOR, LogprobsRenderer
from kvgraph.entrypoints.serve.protocol import CompletionChoice


class _Letters:
    """Token ``i`` is the letter ``chr(97 + i)``."""

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(97 + i) for i in ids)


def _event(token: int, text: str, logprob: float, top: tuple = ()) -> TokenEvent:
    return TokenEvent(request_id=0, token_id=token, text=text, finish_reason=None,
                      logprobs=TokenLogprobs(logprob, top))


def test_completion_shape_and_offsets_across_chunks():
    renderer = LogprobsRenderer(_Letters())
    first = renderer.completion([_event(0, "a", -0.5, ((0, -0.5), (1, -1.0))), _event(2, "", -2.0, ((1, -1.5),))])
    second = renderer.completion([_event(3, "cd", -0.1, ())])
    assert first.tokens == ["a", "c"] and first.token_logprobs == [-0.5, -2.0]
    assert first.top_logprobs == [{"a": -0.5, "b": -1.0}, {"b": -1.5, "c": -2.0}]  # the chosen one always there
    assert first.text_offset == [0, 1] and second.text_offset == [1]


def test_chat_shape_and_minus_infinity_is_a_json_number():
    renderer = LogprobsRenderer(None)
    out = renderer.chat([_event(7, "x", float("-inf"), ((5, -0.1), (7, float("-inf"))))])
    (entry,) = out.content
    assert entry.token == "token_id:7" and entry.logprob == FLOOR and entry.bytes == list(b"token_id:7")
    assert [(t.token, t.logprob) for t in entry.top_logprobs] == [("token_id:5", -0.1), ("token_id:7", FLOOR)]
    json.loads(out.model_dump_json())
    choice = CompletionChoice(text="x", logprobs=renderer.completion([_event(7, "x", float("-inf"))]))
    assert json.loads(choice.model_dump_json())["logprobs"]["token_logprobs"] == [FLOOR]
