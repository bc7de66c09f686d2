"""Operations: ``/health``, ``/metrics``, ``/models``, ``/models/load``, ``/models/unload``."""

from __future__ import annotations

import asyncio
import platform
import subprocess
from functools import lru_cache
from pathlib import Path

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

import neuron
from neuron.config import Config, ConfigError, ModelEntry, validate
from neuron.errors import ApiError, LoadError

from neuron.server.errors import from_load_error
from neuron.server.openai.requests import read_json
from neuron.server.schemas import FaultRequest, LoadRequest, UnloadRequest
from neuron.server.state import AppState, require_key


async def health(request: Request) -> Response:
    state: AppState = request.app.state.neuron
    await state.engine_client.refresh()
    models = {h.id: h.status for h in state.engine_client.models.values()}
    cluster = state.engine_client.cluster.describe() if state.engine_client.cluster is not None else None
    extra = {"cluster": cluster} if cluster is not None else {}
    extra["devices"] = _devices(state)
    if state.draining:
        return JSONResponse({"status": "shutting_down", "models": models, **extra}, status_code=503)
    if state.startup_error:
        return JSONResponse({"status": "failed", "reason": state.startup_error, "models": models, **extra},
                            status_code=503)
    if state.starting:
        return JSONResponse({"status": "starting", "models": models, **extra}, status_code=503)
    bad = {k: v for k, v in models.items() if v != "loaded"}
    if bad:
        reason = "; ".join(f"model {k!r} is {v}" for k, v in bad.items())
        if cluster is not None and cluster["missing"]:
            reason += f"; node(s) {cluster['missing']} missing"
        return JSONResponse({"status": "degraded", "reason": reason, "models": models, **extra}, status_code=503)
    return JSONResponse({"status": "ok", "models": models, **extra})


def _devices(state: AppState) -> dict[str, list[dict]]:
    return {h.id: h.telemetry() for h in state.engine_client.models.values()}


async def root(request: Request) -> Response:
    """Clients probe the base URL (HEAD or GET /): 200 and what answers there."""
    return JSONResponse({"name": "neuron", "version": neuron.__version__, "health": "/health",
                         "apis": ["/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages"]})


async def version(request: Request) -> Response:
    """The release, its git revision, and what the ranks run: torch, CUDA, the CPU kernels' level."""
    state: AppState = request.app.state.neuron
    models = {}
    for h in state.engine_client.models.values():
        ranks = h.telemetry()
        models[h.id] = {"torch": ranks[0]["torch"] if ranks else None, "cuda": ranks[0].get("cuda") if ranks else None,
                        "cpu_isa": h.cpu_isa, "devices": [r["device"] for r in ranks]}
    return JSONResponse({"version": neuron.__version__, "git_revision": git_revision(),
                         "python": platform.python_version(), "models": models})


@lru_cache(maxsize=1)
def git_revision() -> str | None:
    """The commit neuron runs from, where it runs from a git checkout."""
    try:
        out = subprocess.run(["git", "-C", str(Path(neuron.__file__).parent), "rev-parse", "HEAD"],
                             capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


async def metrics(request: Request) -> Response:
    state: AppState = request.app.state.neuron
    if not state.cfg.server.metrics_public:
        require_key(request, state, admin=True)
    await state.engine_client.refresh()
    return Response(state.metrics.render(state.engine_client.models), media_type="text/plain; version=0.0.4")


async def list_models(request: Request) -> Response:
    state: AppState = request.app.state.neuron
    require_key(request, state, admin=True)
    await state.engine_client.refresh()
    return JSONResponse({"models": [h.describe() for h in state.engine_client.models.values()]})


async def load_model(request: Request) -> Response:
    state: AppState = request.app.state.neuron
    require_key(request, state, admin=True)
    body = await read_json(request, LoadRequest, state.cfg.server.max_body_bytes)
    registered = {h.id: h.entry.model for h in state.engine_client.models.values()}
    allowed = await asyncio.to_thread(state.access.check, body.model, registered)  # it may look at the disk
    base = ModelEntry()
    try:
        entry = ModelEntry(model=allowed.model, id=body.id or allowed.default_id or "",
                           tensor_parallel=body.tensor_parallel, device=body.device, devices=body.devices or [],
                           dtype=body.dtype, quantize=body.quant or "",
                           max_model_len=body.max_model_len or base.max_model_len,
                           max_slots=body.max_slots or base.max_slots, aliases=body.aliases or [])
        validate(Config(models=[entry]))
    except ConfigError as exc:
        raise ApiError(400, "invalid_request", str(exc).replace("models[0].", "")) from None
    try:
        handle = await state.engine_client.load(entry)
    except (LoadError, ApiError) as exc:  # an engine core in another process answers with an ApiError
        err = from_load_error(exc) if isinstance(exc, LoadError) else exc
        # Said with the name the client gave: a cache snapshot's path is none of its business.
        err.message = err.message.replace(allowed.model, body.model)
        raise err from None
    return JSONResponse(handle.describe())


async def unload_model(request: Request) -> Response:
    state: AppState = request.app.state.neuron
    require_key(request, state, admin=True)
    body = await read_json(request, UnloadRequest, state.cfg.server.max_body_bytes)
    outcome = await state.engine_client.unload(body.model, state.cfg.server.drain_timeout_s)
    return JSONResponse({"model": body.model, "status": "unloaded", "cancelled_load": outcome == "load_cancelled"})


async def inject_fault(request: Request) -> Response:
    """Test hook (only with ``[debug] fault_injection = true``): the rank fails its next step."""
    state: AppState = request.app.state.neuron
    require_key(request, state, admin=True)
    if not state.cfg.debug.fault_injection:
        raise ApiError(404, "not_found", "fault injection is disabled")
    body = await read_json(request, FaultRequest, state.cfg.server.max_body_bytes)
    armed = await state.engine_client.inject_fault(body.model, body.rank, body.kind)
    return JSONResponse({"model": body.model, "rank": body.rank, "kind": body.kind, "armed": armed})
