"""Errors in OpenAI's JSON shape, mapped to HTTP statuses in one place.

Every failure leaves the server as `{"error": {"message", "type", "param", "code"}}` with the
status OpenAI uses for it, so client libraries raise their usual exception classes.
"""

from __future__ import annotations

import logging
import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from gpucloud.errors import CapacityError, NotFoundError, UserError

log = logging.getLogger(__name__)
# How pydantic names the member of a union in an error's location: "str", "list[str]", ...
_UNION_MEMBER = re.compile(r"^(str|int|float|bool)$|\[")

# status -> OpenAI error type
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable_error",
}


class APIError(Exception):
    """An error answered with `status` and an OpenAI error body."""

    def __init__(
        self,
        status: int,
        message: str,
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param
        self.headers = headers


def error_response(
    status: int,
    message: str,
    code: str | None = None,
    param: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    body = {
        "error": {
            "message": message,
            "type": _TYPES.get(status, "server_error"),
            "param": param,
            "code": code,
        }
    }
    return JSONResponse(body, status_code=status, headers=headers)


def install(app: FastAPI) -> None:
    """Register the handlers that turn every exception into an OpenAI error body."""

    @app.exception_handler(APIError)
    async def _api(request: Request, e: APIError) -> JSONResponse:
        return error_response(e.status, e.message, e.code, e.param, e.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, e: RequestValidationError) -> JSONResponse:
        return error_response(400, *_describe_validation(e))

    @app.exception_handler(HTTPException)
    async def _http(request: Request, e: HTTPException) -> JSONResponse:
        return error_response(e.status_code, str(e.detail), headers=e.headers)

    @app.exception_handler(NotFoundError)
    async def _not_found(request: Request, e: NotFoundError) -> JSONResponse:
        return error_response(404, str(e), "model_not_found", "model")

    @app.exception_handler(UserError)
    async def _user(request: Request, e: UserError) -> JSONResponse:
        return error_response(400, str(e))

    @app.exception_handler(CapacityError)
    async def _capacity(request: Request, e: CapacityError) -> JSONResponse:
        return error_response(400, str(e), "context_length_exceeded")

    @app.exception_handler(Exception)
    async def _bug(request: Request, e: Exception) -> JSONResponse:
        log.exception("unhandled error on %s", request.url.path)
        return error_response(500, f"internal error: {type(e).__name__}")


def _describe_validation(e: RequestValidationError) -> tuple[str, str | None, str | None]:
    """(message, code, param) for the first problem: what was wrong and where. A value of
    the right type that breaks a bound says more than the union members it is not, so the
    first such error is told first (e.g. `prompt.1` beyond the largest token id)."""
    errors = e.errors()
    first = next((x for x in errors if not x.get("type", "").endswith("_type")), errors[0])
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    loc = [part for part in loc if not _UNION_MEMBER.search(part)]
    if not loc:
        return "the request body must be a JSON object", "invalid_json", None
    param = ".".join(loc) or None
    where = f"{param}: " if param else ""
    return f"{where}{first.get('msg')}", "invalid_value", param
