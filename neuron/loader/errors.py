"""Why a model cannot be loaded; each maps to one HTTP status on ``/models/load``."""

from __future__ import annotations


class LoadError(Exception):
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
