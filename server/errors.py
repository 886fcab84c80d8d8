"""Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`, with the right status."""

from __future__ import annotations

import json
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger(__name__)

TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
         405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
         500: "server_error", 503: "service_unavailable"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": TYPES.get(status, "invalid_request_error"), "param": param,
                      "code": code}}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


def sse_error(status: int, message: str) -> str:
    return f"data: {json.dumps(error_body(status, message))}\n\n"


def _is_union_label(part: object) -> bool:
    """Pydantic names each member of a union in an error's location (`str`, `list[TextPart]`,
    `function-before[...]`); no field of the API is named like that."""
    return isinstance(part, str) and (part in ("str", "int", "float", "bool") or any(c in part for c in "[(-"))


def _validation_message(error: RequestValidationError) -> tuple[str, str | None]:
    errors = error.errors()
    # A union reports an error per member; the one that got deepest into the value says what is wrong
    # (a bad part of a content list, rather than "the content is not a string").
    first = max(errors, key=lambda e: len(e.get("loc", ())), default={})
    location = [str(p) for p in first.get("loc", ()) if p != "body" and not _is_union_label(p)]
    if first.get("type") == "json_invalid":
        return "the request body is not valid JSON", None
    param = ".".join(location) or None
    message = first.get("msg", "invalid request")
    # Pydantic says "Value error, ..." for our own checks; drop its prefix.
    message = message.removeprefix("Value error, ")
    return (f"{param}: {message}" if param else message), param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, error: APIError) -> JSONResponse:
        return error_response(error.status, error.message, error.param, error.code, error.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, error: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(error)
        return error_response(400, message, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, error: StarletteHTTPException) -> JSONResponse:
        return error_response(error.status_code, str(error.detail))

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, error: Exception) -> JSONResponse:
        # Never leak internals (paths, tracebacks) to clients; the log has them.
        log.exception("unhandled error")
        return error_response(500, "internal server error")
