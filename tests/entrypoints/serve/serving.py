"""What the server tests share: the engine flags they serve ``llama-tiny`` with, and plain HTTP helpers."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

MODEL = "llama-tiny"
MAX_SEQ_LEN = 512
ENGINE_FLAGS = ["--model", MODEL, "--compile", "eager", "--max-seq-len", str(MAX_SEQ_LEN), "--max-batch-size", "32"]
WAIT_STEPS = 600  # bounded polls of /metrics, 0.05 s apart


def post(server, path: str, body: bytes) -> tuple[int, dict]:
    """POST ``body`` (JSON) to ``path``: the status and the decoded answer, errors included."""
    request = urllib.request.Request(server.url + path, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def wait_until(predicate) -> bool:
    for _ in range(WAIT_STEPS):
        if predicate():
            return True
        time.sleep(0.05)
    return False


def all_pages_free(server) -> bool:
    """Whether the server's engine holds no KV pages and runs or queues no request (waiting a while)."""
    return wait_until(lambda: server.metric("kvgraph_kv_pages_used") == 0
                      and server.metric("kvgraph_requests_running") == 0
                      and server.metric("kvgraph_requests_waiting") == 0)
