"""The exception hierarchy: every error the API answers with, and its wire shape.

Each class fixes the HTTP status, the OpenAI ``type`` and the spec's ``code``;
handlers in both hosts turn any :class:`LemonkitError` into
``{"error": {"message", "type", "code"}}`` with that status. The classes, their statuses and the builtin each
also is (so ``except ValueError`` still catches a bad request)::

    LemonkitError 500
        BackendError 500 (RuntimeError)
        BackendUnavailable 503 (RuntimeError)
        BodyError 500
        DownloadError 502 (RuntimeError)
        DownloadStopped 409
        Forbidden 403 (PermissionError)
            AdminRequired 403
            ForbiddenHost 403
            ForbiddenOrigin 403
        HubServiceError 502 (ConnectionError)
        InstallError 500 (RuntimeError)
        InvalidRequest 400 (ValueError)
            BackendNotInstalled 400
            BackendUnsupported 400
            InvalidArgument 400
            InvalidJSON 400
            MissingArgument 400
            ModelLoadRefused 400
            ModelNotApplicable 400
            PrerequisitesMissing 400
            TooLarge 413
        ModelLoadError 500 (RuntimeError)
        NotEmbeddingModel 501
        NotFound 404 (LookupError)
            ModelNotFound 404
            ModelNotSupported 404
        NotImplementedRoute 501
        RetryLater 500
            QueueFull 503
            TooManyRequests 429
        ServerUnavailable 503 (ConnectionError)
        SlotBusy 409
        SlotsPinned 409
        StructuredOutputError 502 (ValueError)
        Unauthorized 401 (PermissionError)

:class:`KernelsUnavailable` is the engine's own (not an API error).
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "AdminRequired",
    "BackendError",
    "BackendNotInstalled",
    "BackendUnavailable",
    "BackendUnsupported",
    "BodyError",
    "DownloadError",
    "DownloadStopped",
    "Forbidden",
    "ForbiddenHost",
    "ForbiddenOrigin",
    "HubServiceError",
    "InstallError",
    "InvalidArgument",
    "InvalidJSON",
    "InvalidRequest",
    "KernelsUnavailable",
    "LemonkitError",
    "MissingArgument",
    "ModelLoadError",
    "ModelLoadRefused",
    "ModelNotApplicable",
    "ModelNotFound",
    "ModelNotSupported",
    "NotEmbeddingModel",
    "NotFound",
    "NotImplementedRoute",
    "PrerequisitesMissing",
    "QueueFull",
    "RetryLater",
    "ServerUnavailable",
    "SlotBusy",
    "SlotsPinned",
    "StructuredOutputError",
    "TooLarge",
    "TooManyRequests",
    "Unauthorized",
    "error_from_body",
]


class LemonkitError(Exception):
    """Base of every error lemonkit answers with.

    Args:
        message: What went wrong, for a human.
        status: HTTP status override (the class default otherwise).
        code: Spec error code override.
    """

    status: int = 500
    type: str = "server_error"
    code: str | None = None

    def __init__(self, message: str, *, status: int | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        if status is not None:
            self.status = status
        if code is not None:
            self.code = code

    def to_dict(self) -> dict[str, Any]:
        """The OpenAI-shaped error body."""
        return {"error": {"message": self.message, "type": self.type, "code": self.code}}


class InvalidRequest(LemonkitError, ValueError):
    """The request cannot be served as sent (400): the base of every client mistake."""

    status = 400
    type = "invalid_request_error"


class InvalidJSON(InvalidRequest):
    """The body is not JSON (or not the JSON object the route reads)."""

    code = "invalid_json"


class MissingArgument(InvalidRequest):
    """A required field is absent."""

    code = "missing_argument"


class InvalidArgument(InvalidRequest):
    """A field has a value the route cannot take."""

    code = "invalid_argument"


class ModelNotApplicable(InvalidRequest):
    """The model exists but does not serve this route (e.g. chat on an embedding model)."""

    code = "model_not_applicable"


class ModelLoadRefused(InvalidRequest):
    """The backend refuses the model as it is registered, before it starts anything (not a GGUF, say)."""

    code = "model_load_refused"


class BackendUnsupported(InvalidRequest):
    """``POST /v1/install`` of a backend this machine cannot run (without ``force``, or with nothing to install)."""

    code = "backend_unsupported"


class BackendNotInstalled(InvalidRequest):
    """A model asks for a backend build that is not installed (or must be rebuilt first); the message names the
    install action."""

    code = "backend_not_installed"


class PrerequisitesMissing(InvalidRequest):
    """``POST /v1/install`` of a build whose compilers, headers or SDKs are missing; the message names the
    commands that install them."""

    code = "prerequisites_missing"


class TooLarge(InvalidRequest):
    """A body or an upload over the server's size limit."""

    status = 413
    code = "payload_too_large"


class BackendUnavailable(LemonkitError, RuntimeError):
    """An installed backend build does not start (its libraries fail to load): reinstall it with ``force``."""

    status = 503
    code = "backend_unavailable"


class Unauthorized(LemonkitError, PermissionError):
    """No credential, or a wrong one (401)."""

    status = 401
    type = "authentication_error"
    code = "invalid_api_key"


class Forbidden(LemonkitError, PermissionError):
    """The request is refused whatever its credentials (where it comes from, not who sends it)."""

    status = 403
    type = "permission_error"
    code = "forbidden"


class ForbiddenHost(Forbidden):
    """The ``Host`` header names no address of this server (a DNS-rebinding page, or a missing name)."""

    code = "forbidden_host"


class ForbiddenOrigin(Forbidden):
    """A browser page of another origin, not in the server's allowed origins, sent the request."""

    code = "forbidden_origin"


class AdminRequired(Forbidden):
    """A shared server's user asked for something only its admins may do (pull, delete, install...)."""

    code = "admin_required"


class RetryLater(LemonkitError):
    """A refusal that says when to try again: the answer's ``Retry-After`` (whole seconds, at least 1).

    Args:
        message: What went wrong, for a human.
        retry_after: Seconds until a new attempt may succeed (an estimate).
    """

    def __init__(self, message: str, *, retry_after: float = 1.0, **kwargs: Any) -> None:
        super().__init__(message, **kwargs)
        self.retry_after = retry_after


class TooManyRequests(RetryLater):
    """A shared server's user is over a per-user limit (requests at once, queued, or per minute)."""

    status = 429
    type = "rate_limit_error"
    code = "rate_limit_exceeded"


class QueueFull(RetryLater):
    """As many requests as the server allows (all users together) wait for a turn at the model already."""

    status = 503
    type = "server_busy_error"
    code = "queue_full"


class NotFound(LemonkitError, LookupError):
    """The thing the path or a field names does not exist (404)."""

    status = 404
    type = "not_found_error"
    code = "not_found"


class ModelNotFound(NotFound):
    """No registered model has that name."""

    code = "model_not_found"


class ModelNotSupported(NotFound):
    """The model is known but does not run on this machine."""

    code = "model_not_supported"


class SlotBusy(LemonkitError):
    """A slot action (``POST /v1/slots/{id}``) named a slot that is generating (409)."""

    status = 409
    type = "conflict_error"
    code = "slot_busy"


class SlotsPinned(LemonkitError):
    """Every slot is held by a pinned model: nothing can be evicted for this load (409)."""

    status = 409
    type = "conflict_error"
    code = "slots_pinned_error"


class ModelLoadError(LemonkitError, RuntimeError):
    """A model's engine could not load it (a broken file, too little memory, a failed backend)."""

    code = "model_load_error"


class BackendError(LemonkitError, RuntimeError):
    """The engine sidecar failed or answered with an error."""

    type = "backend_error"
    code = "backend_error"


class InstallError(LemonkitError, RuntimeError):
    """pip failed to install or uninstall a backend's package."""

    code = "install_error"


class DownloadError(LemonkitError, RuntimeError):
    """The hub or the network failed a pull; what was fetched stays, so pulling again resumes."""

    status = 502
    code = "download_error"


class DownloadStopped(LemonkitError):
    """A pull's download was paused or cancelled (``/v1/downloads/control``) before it finished."""

    status = 409
    type = "conflict_error"
    code = "download_stopped"


class NotEmbeddingModel(LemonkitError):
    """A llama.cpp model that was not loaded for embeddings (the spec's 501 row)."""

    status = 501
    type = "not_implemented_error"
    code = "model_not_applicable"


class NotImplementedRoute(LemonkitError):
    """A route of a foreign API (Ollama's ``/api/create``) that lemonkit has no equivalent of; the message says
    what to use instead."""

    status = 501
    type = "not_implemented_error"
    code = "not_implemented"


class HubServiceError(LemonkitError, ConnectionError):
    """The JupyterHub's lemonkit service cannot be found or reached (the hub has none, the token may not read
    it, or it does not answer)."""

    status = 502
    code = "hub_service_unavailable"


class ServerUnavailable(LemonkitError, ConnectionError):
    """No lemonkit server could be reached (or started): the Python client's error."""

    status = 503
    type = "connection_error"
    code = "server_unavailable"


class StructuredOutputError(LemonkitError, ValueError):
    """The model's answer is not an instance of the schema (cut off by ``max_tokens``, say).

    Attributes:
        result: The answer as a :class:`~lemonkit.client.results.ChatResult` (None when rebuilt from an error body).
    """

    status = 502
    type = "server_error"
    code = "invalid_structured_output"

    def __init__(self, message: str, result: Any = None, **kwargs: Any) -> None:
        super().__init__(message, **kwargs)
        self.result = result


class BodyError(LemonkitError):
    """A live transcription body broke a rule: an SSE ``error`` event ends the stream."""

    type = "invalid_request_error"


class KernelsUnavailable(RuntimeError):
    """This llama.cpp build offers no reference (batch-invariant) mode to switch on: an engine-internal error."""


def _classes(cls: type[LemonkitError]) -> list[type[LemonkitError]]:
    found = [cls]
    for sub in cls.__subclasses__():
        found += _classes(sub)
    return found


def error_from_body(status: int | None, body: Any, text: str = "") -> LemonkitError:
    """The exception a client raises for an error answer: the class whose ``code`` the body names (the most
    general one when several share it), else the closest class for ``status``.

    Args:
        status: The HTTP status; ``None`` for an error event inside a stream (the class's own status then).
        body: The parsed JSON answer (``{"error": {...}}``), or ``None`` when it was not JSON.
        text: The raw answer, the message when the body has none.
    """
    error = body.get("error") if isinstance(body, dict) else None
    if not isinstance(error, dict):
        error = {"message": error if isinstance(error, str) else text[:500] or f"HTTP {status}"}
    code = error.get("code")
    by_code = [c for c in _classes(LemonkitError) if c.code == code]
    cls = next((c for c in by_code if status in (None, c.status)), None)
    if cls is None:
        cls = {400: InvalidRequest, 401: Unauthorized, 403: Forbidden, 404: NotFound}.get(status or 0, LemonkitError)
    exc = cls(str(error.get("message")), status=status, code=code)
    if isinstance(error.get("type"), str):
        exc.type = error["type"]
    return exc
