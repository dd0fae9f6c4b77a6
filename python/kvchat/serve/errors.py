"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``,
with the status a client expects, so ``openai`` raises its matching exception."""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import JSONResponse

# The error type OpenAI sends with each status.
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    409: "conflict_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
}


class APIError(Exception):
    """A request kvchat serve refuses; becomes an OpenAI-shaped error response."""

    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        return {
            "error": {
                "message": _printable(self.message),
                "type": _TYPES.get(self.status, "invalid_request_error"),
                "param": None if self.param is None else _printable(self.param),
                "code": self.code,
            }
        }


def bad_request(param: str | None, message: str, code: str | None = "invalid_value") -> APIError:
    """A 400 naming the request field ``param`` that is wrong."""
    return APIError(400, message, param=param, code=code)


def _printable(text: str) -> str:
    """``text`` as UTF-8 can carry it: a client's lone surrogate (in a field
    name it sent, say) is written as its escape, never a failed response."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def error_response(error: APIError) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if error.status == 401 else None
    return JSONResponse(error.body(), status_code=error.status, headers=headers)


async def api_error_handler(request: Request, error: APIError) -> JSONResponse:
    return error_response(error)
