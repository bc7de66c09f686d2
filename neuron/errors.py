"""Errors as values with a kind; one mapping to HTTP status lives in ``neuron.server.errors``. Why a
model cannot be loaded (``LoadError`` and its kinds) is raised by the loaders and the families alike."""

from __future__ import annotations


class ApiError(Exception):
    def __init__(self, status: int, code: str, message: str, *, param: str | None = None,
                 retry_after: int | None = None, type: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.param = param
        self.retry_after = retry_after
        self.type = type or _type_for(status)


def _type_for(status: int) -> str:
    if status == 401:
        return "authentication_error"
    if status == 404:
        return "not_found_error"
    if status == 429:
        return "rate_limit_error"
    if status >= 500:
        return "server_error" if status == 500 else "service_unavailable"
    return "invalid_request_error"


class GroupFailed(Exception):
    """A model's rank group can no longer serve; it must be respawned."""


class RankError(Exception):
    """A rank answered with ``error{kind, message}``."""

    def __init__(self, rank: int, kind: str, message: str) -> None:
        super().__init__(f"rank {rank}: {kind}: {message}")
        self.rank, self.kind, self.message = rank, kind, message


# ------------------------------------------------------------------ why a model cannot be loaded


class LoadError(Exception):
    """Why a model cannot be loaded; each kind maps to one HTTP status on ``/models/load``."""

    status = 400
    code = "invalid_model"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class ModelNotFound(LoadError):
    status = 404
    code = "model_not_found"


class UnsupportedModel(LoadError):
    status = 422
    code = "unsupported_model"


class BadModelConfig(LoadError):
    status = 422
    code = "invalid_model_config"


class BadModelFile(LoadError):
    """A file of the model that is malformed, too large, or resolves outside where it may."""

    status = 422
    code = "invalid_model"
