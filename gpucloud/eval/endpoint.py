"""`EndpointBackend`: evaluate whatever an OpenAI-compatible server serves (`gpucloud serve`,
the control plane's gateway, vLLM), through `/v1/completions`. Torch-free.

Prompts are scored with `echo` and `logprobs`, one prompt a request so that
`usage.prompt_tokens` says where the prompt ends: `max_tokens` is 1, not 0, because vLLM
refuses 0, and the one generated token is dropped. Requests run a few at a time, so a server
with continuous batching computes them together.

A perplexity text is cut in rolling windows of the server's own tokens (windows.py), so a
text longer than the context is scored as in this process: vLLM's `POST /tokenize` (beside
`/v1` on vLLM and `gpucloud serve`, under it on the control plane's gateway) gives its token
ids and the context, and each window is scored as a prompt of token ids.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import httpx

from gpucloud.errors import GpucloudError, UserError
from gpucloud.eval.tasks import GenerationItem
from gpucloud.eval.windows import score_in_windows, window_length

CONCURRENT_REQUESTS = 8
TIMEOUT_S = 600.0


class EndpointBackend:
    def __init__(self, url: str, model: str | None = None, api_key: str | None = None):
        base = url.rstrip("/")
        base = base if base.endswith("/v1") else base + "/v1"
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.base = base
        self.root = base.removesuffix("/v1")
        self.http = httpx.Client(headers=headers, timeout=TIMEOUT_S)
        card = self._model_card(model)
        self.model = card["id"]
        self.name = f"{self.model}@{base}"
        self._tokenize_url: str | None = None  # found on first use
        self._max_model_len: int | None = None  # what /tokenize says

    def prompt_logprobs(self, prompts: Sequence[str | list[int]]) -> list[list[float | None]]:
        return self._map(self._score, prompts)

    @property
    def max_length(self) -> int:
        if self._max_model_len is None:
            self._tokenize("")
        return window_length(self._max_model_len)

    def text_logprobs(
        self, texts: Sequence[str], stride: int | None = None
    ) -> list[list[float | None]]:
        self._tokenize("")  # finds the route (and the context) before texts go in parallel
        ids = self._map(self._tokenize, texts)
        return score_in_windows(ids, self.max_length, stride, self.prompt_logprobs)

    def generate(self, items: Sequence[GenerationItem]) -> list[str]:
        return self._map(self._generate, items)

    def close(self) -> None:
        self.http.close()

    def _score(self, prompt: str | list[int]) -> list[float | None]:
        body = self._complete(prompt=prompt, max_tokens=1, echo=True, logprobs=0)
        n = body["usage"]["prompt_tokens"]
        return body["choices"][0]["logprobs"]["token_logprobs"][:n]

    def _generate(self, item: GenerationItem) -> str:
        body = self._complete(prompt=item.prompt, max_tokens=item.max_tokens, stop=list(item.stop))
        return body["choices"][0]["text"]

    def _complete(self, **fields) -> dict:
        return self._request("POST", self.base + "/completions",
                             {"model": self.model, "temperature": 0, **fields})  # fmt: skip

    def _tokenize(self, text: str) -> list[int]:
        body = {"model": self.model, "prompt": text, "add_special_tokens": True}
        answer = self._request("POST", self._tokenize_url or self._find_tokenize(), body)
        self._max_model_len = answer["max_model_len"]
        return answer["tokens"]

    def _find_tokenize(self) -> str:
        """The URL of vLLM's tokenize route on this server: beside /v1 (vLLM, `gpucloud
        serve`) or under it (the control plane's gateway). Raises UserError without one."""
        tried = [self.root + "/tokenize", self.base + "/tokenize"]
        for url in tried:
            try:
                r = self.http.post(url, json={"model": self.model, "prompt": ""})
            except httpx.TransportError as e:
                raise GpucloudError(f"cannot reach {url}: {e}") from None
            if not _no_route(r):
                self._tokenize_url = url
                return url
        raise UserError(
            f"{self.root} has no tokenize route (tried {' and '.join(tried)}): perplexity "
            "through a server cuts texts in its own tokens with vLLM's POST /tokenize, which "
            "vLLM, `gpucloud serve` and the control plane's gateway have"
        )

    def _model_card(self, model: str | None) -> dict:
        cards = self._request("GET", self.base + "/models", None).get("data") or []
        if model is None:
            if not cards:
                raise UserError(f"{self.base}/models lists no model: pass --model")
            return cards[0]
        return next((c for c in cards if c.get("id") == model), {"id": model})

    def _request(self, method: str, url: str, body: dict | None) -> dict:
        try:
            r = self.http.request(method, url, json=body)
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


def _no_route(r: httpx.Response) -> bool:
    """Whether the server has no such route: a 404 or 405 that is not an API error (those
    are OpenAI's {"error": ...}, e.g. an unknown model)."""
    if r.status_code not in (404, 405):
        return False
    try:
        return "error" not in r.json()
    except (ValueError, TypeError):
        return True
