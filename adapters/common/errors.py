"""The error every protocol's request parsing raises: an HTTP status, a message, the field.

The HTTP app renders it in OpenAI's error shape, or Anthropic's on its paths
(adapters/http/app.py); `param` names the offending field, so openai-python raises
the matching exception (BadRequestError, ...).
"""

from __future__ import annotations


_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "invalid_request_error", 405: "invalid_request_error", 413: "invalid_request_error",
                415: "invalid_request_error", 421: "invalid_request_error", 429: "rate_limit_error"}


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _ERROR_TYPES.get(status, "server_error")
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)
