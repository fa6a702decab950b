"""`EndpointBackend`: evaluate whatever an OpenAI-compatible server serves (`gpucloud serve`,
the control plane's gateway, vLLM), through `/v1/completions`. Torch-free.

Prompts are scored with `echo` and `logprobs`, one prompt a request so that
`usage.prompt_tokens` says where the prompt ends: `max_tokens` is 1, not 0, because vLLM
refuses 0, and the one generated token is dropped. Requests run a few at a time, so a server
with continuous batching computes them together.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import httpx

from gpucloud.errors import GpucloudError, UserError
from gpucloud.eval.tasks import GenerationItem

CONCURRENT_REQUESTS = 8
TIMEOUT_S = 600.0


class EndpointBackend:
    def __init__(self, url: str, model: str | None = None, api_key: str | None = None):
        base = url.rstrip("/")
        base = base if base.endswith("/v1") else base + "/v1"
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.base = base
        self.http = httpx.Client(base_url=base, headers=headers, timeout=TIMEOUT_S)
        card = self._model_card(model)
        self.model = card["id"]
        self.name = f"{self.model}@{base}"

    def prompt_logprobs(self, prompts: Sequence[str]) -> list[list[float | None]]:
        return self._map(self._score, prompts)

    def text_logprobs(self, texts: Sequence[str]) -> list[list[float | None]]:
        """Each text scored whole: the server's tokens are not known here, so a text longer
        than its context is the server's error."""
        return self.prompt_logprobs(texts)

    def generate(self, items: Sequence[GenerationItem]) -> list[str]:
        return self._map(self._generate, items)

    def close(self) -> None:
        self.http.close()

    def _score(self, prompt: str) -> list[float | None]:
        body = self._complete(prompt=prompt, max_tokens=1, echo=True, logprobs=0)
        n = body["usage"]["prompt_tokens"]
        return body["choices"][0]["logprobs"]["token_logprobs"][:n]

    def _generate(self, item: GenerationItem) -> str:
        body = self._complete(prompt=item.prompt, max_tokens=item.max_tokens, stop=list(item.stop))
        return body["choices"][0]["text"]

    def _complete(self, **fields) -> dict:
        return self._request("POST", "/completions", {"model": self.model, "temperature": 0,
                                                      **fields})  # fmt: skip

    def _model_card(self, model: str | None) -> dict:
        cards = self._request("GET", "/models", None).get("data") or []
        if model is None:
            if not cards:
                raise UserError(f"{self.base}/models lists no model: pass --model")
            return cards[0]
        return next((c for c in cards if c.get("id") == model), {"id": model})

    def _request(self, method: str, path: str, body: dict | None) -> dict:
        url = self.base + path
        try:
            r = self.http.request(method, path, json=body)
        except httpx.TransportError as e:
            raise GpucloudError(f"cannot reach {url}: {e}") from None
        if r.status_code >= 400:
            error = UserError if r.status_code < 500 else GpucloudError
            raise error(f"{url} answered {r.status_code}: {_message(r)}")
        return r.json()

    def _map(self, fn, inputs: Sequence) -> list:
        with ThreadPoolExecutor(CONCURRENT_REQUESTS) as pool:
            return list(pool.map(fn, inputs))


def _message(r: httpx.Response) -> str:
    """The server's own words: OpenAI's {"error": {"message"}} or the control plane's
    {"detail"}, else the start of the body."""
    try:
        body = r.json()
    except ValueError:
        return r.text[:200]
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict) and error.get("message"):
        return str(error["message"])
    if isinstance(body, dict) and body.get("detail"):
        return str(body["detail"])
    return r.text[:200]
