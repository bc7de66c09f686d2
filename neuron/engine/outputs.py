"""A request's drawn tokens as text events: the output side of the engine's boundary.

The engine core decides which tokens a request draws and when it ends by token (a stop token
id, ``max_tokens``, the context's end); it hands each drawn id here with its logprobs and
whether it is the request's last. This side detokenizes, holds back text that could begin a
stop string, puts the text events on the request's queue, and says when a stop string ended
the text: the core then finishes the request. In one process it runs in the engine's turn; with
API processes (``[server] api_processes``) a request of the core carries a ``sink`` that sends
its ids to the API process the client is on, which runs this stage there and sends a stop back
(``neuron/server/core_link.py``)."""

from __future__ import annotations

from .request import FinishEvent, GenRequest, TokenEvent


def token_out(req: GenRequest, token: int, logprobs: list[tuple[int, float]] | None, last: bool) -> bool:
    """Emit the text ``token`` adds; True where a stop string ended the text with it (``req``
    is then done: the core finishes it as stopped). ``last``: the core ends the request with this
    token, so everything held back goes out with it."""
    if req.sink is not None:
        req.sink.token(req, token, logprobs, 1 if last else 0)
        return False
    text, hit = req.stop_matcher.push(req.detokenizer.push(token))
    if not hit and last:
        text += req.stop_matcher.push(req.detokenizer.flush())[0] + req.stop_matcher.flush()
    _emit(req, text, [token], logprobs)
    return hit


def stop_token_out(req: GenRequest, token: int, logprobs: list[tuple[int, float]] | None) -> None:
    """``token`` is one of the request's stop token ids, which ends it: its text is not shown,
    what was held back (a stop string's possible start) is."""
    if req.sink is not None:
        req.sink.token(req, token, logprobs, 2)
        return
    _emit(req, req.stop_matcher.flush(), [token], logprobs)


def _emit(req: GenRequest, text: str, ids: list[int], logprobs) -> None:
    req.events.put_nowait(TokenEvent(text, ids, [logprobs] if logprobs else None))


def finish_out(req: GenRequest, event: FinishEvent) -> None:
    if req.sink is not None:
        req.sink.finish(req, event)
    else:
        req.events.put_nowait(event)
