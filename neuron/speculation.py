"""Speculative decoding as a model's entry asks for it: the drafting policy its engine runs, or
why the model cannot draft (yet)."""

from __future__ import annotations

from .config import ModelEntry
from .engine.speculative import DraftError, DraftPolicy
from .errors import LoadError
from .loader.spec import ModelSpec
from .models import families


def draft_policy(model_id: str, entry: ModelEntry, gpu: bool, vocab: int) -> DraftPolicy | None:
    s = entry.speculative
    if not s.method:
        return None
    try:
        return DraftPolicy.build(s.method, s.tokens, gpu, vocab, entry.max_slots, s.replay)
    except DraftError as exc:
        raise LoadError(f"model {model_id!r}: speculative decoding: {exc}") from None


def speculation_refused(entry: ModelEntry, spec: ModelSpec | None = None) -> str:
    """Why a model cannot draft (speculative decoding) yet, or "": pipeline stages pass one token
    a sequence between them; ``mtp`` needs the checkpoint's MTP layer."""
    if entry.pipeline_parallel > 1:
        return "is not supported yet with pipeline stages"
    if entry.speculative.method == "mtp" and spec is not None:
        refused = getattr(families.family(spec.config.family), "mtp_refused", None)
        if refused is None:
            return f"needs a checkpoint with MTP layers, and the {spec.config.family} family has none"
        return refused(spec.config, spec.files.tensor_names if spec.files.format == "safetensors" else None)
    return ""
