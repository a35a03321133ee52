"""What a real Triton server says it did, read from its own metrics endpoint (not from a
client's count): the tests and benches that check who answered an encode use it."""

from __future__ import annotations

import re
import urllib.request

from services.encoder.serve.triton_server import TritonHandle


def inferences(handle: TritonHandle, model: str = "embed") -> int:
    """Requests of ``model`` that ``handle``'s Triton answered successfully so far
    (``nv_inference_request_success``, summed over the model's versions)."""
    # Triton binds its metrics on --metrics-address: the host
    url = f"http://{handle.config.host}:{handle.config.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    pattern = re.compile(
        rf'^nv_inference_request_success\{{model="{re.escape(model)}",version="[^"]*"\}} (\S+)$',
        re.M,
    )
    return sum(int(float(m.group(1))) for m in pattern.finditer(text))
