"""vLLM's `POST /tokenize` and `POST /detokenize`: the served model's tokenizer, for clients
that must count or cut a text in the server's own tokens (e.g. `gpucloud eval`'s rolling
windows through an endpoint). Like vLLM's, they are outside `/v1`."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from gpucloud.serve.api.errors import APIError
from gpucloud.serve.api.schemas import DetokenizeRequest, TokenizeRequest
from gpucloud.serve.api.state import ServerState

router = APIRouter()


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request) -> JSONResponse:
    """{"tokens", "count", "max_model_len"} (and "token_strs" when asked) of the prompt."""
    state = _checked(request, body.model)
    tok = state.engine.tokenizer
    tokens = tok.encode(body.prompt, add_bos=body.add_special_tokens)
    answer = {"count": len(tokens), "max_model_len": state.engine.max_model_len, "tokens": tokens}
    if body.return_token_strs:
        answer["token_strs"] = [tok.backend.id_to_token(t) for t in tokens]
    return JSONResponse(answer)


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> JSONResponse:
    """{"prompt"}: the tokens' text, special tokens included (as vLLM's)."""
    state = _checked(request, body.model)
    tok = state.engine.tokenizer
    vocab = tok.vocab_size
    bad = next((i for i, t in enumerate(body.tokens) if t >= vocab), None)
    if bad is not None:
        raise APIError(400, f"tokens.{bad}: {body.tokens[bad]} is not a token id of this model "
                       f"(0 to {vocab - 1})", "invalid_value", f"tokens.{bad}")  # fmt: skip
    return JSONResponse({"prompt": tok.decode(body.tokens, skip_special_tokens=False)})


def _checked(request: Request, model: str | None) -> ServerState:
    """The server's state, once `model` (when given) is found to name what it serves."""
    state: ServerState = request.app.state.server
    if model is not None:
        state.check_model(model)
    return state
