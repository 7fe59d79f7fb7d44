"""The engine's requests by id, with what is done to one request alone: fail it, store its
prompt logprobs, emit its output.

The table is the engine's one dict of requests (kept by identity across ``load_state``: the
speculator's stop checker holds it too); this object adds the operations the step loop needs
without reaching into the engine.
"""

from __future__ import annotations

import logging

from pagedjax.engine.request import Request
from pagedjax.outputs import RequestOutput
from pagedjax.sampling_params import RequestOutputKind
from pagedjax.worker.prompt_logprobs import PromptScores

logger = logging.getLogger("pagedjax.engine.llm_engine")


class RequestTable:
    """``requests`` (request id -> Request) with ``fail``, ``store_prompt_logprobs`` and
    ``emit``. ``scheduler``: the one that aborts a failed request and counts it (rebound when
    the engine loads a state)."""

    def __init__(self, requests: dict[str, Request], output_processor, scheduler, speculator=None):
        self.requests = requests
        self.output_processor = output_processor
        self.scheduler = scheduler
        self.speculator = speculator

    def get(self, request_id: str) -> Request | None:
        return self.requests.get(request_id)

    def __getitem__(self, request_id: str) -> Request:
        return self.requests[request_id]

    def fail(self, req: Request, error: Exception) -> None:
        """End one request for a fault of its own; everything else keeps running."""
        if req.error is None:
            req.error = f"the request failed in the engine: {type(error).__name__}: {error}"
            logger.error("request %r: %s", req.request_id, req.error, exc_info=error)
            self.scheduler.num_aborted += 1
        self.scheduler.abort(req.request_id)  # its unfinished seqs end with "abort"

    def store_prompt_logprobs(self, request_id: str, scores: PromptScores) -> None:
        """Keep a step's scores of the request's prompt rows (None if it is gone)."""
        req = self.requests.get(request_id)
        if req is not None and req.prompt_logprobs is not None:
            req.prompt_logprobs.store(scores.first_target, scores.scores)

    def emit(self, request_id: str) -> RequestOutput | None:
        """The request's output now (None if it is gone, or if it runs on and asked only for its
        final output); a finished request leaves the table."""
        req = self.requests.get(request_id)
        if req is None:
            return None
        if req.params.output_kind is RequestOutputKind.FINAL_ONLY and not req.group.is_finished():
            return None
        try:
            output = self.output_processor.make_output(req)
        except Exception as e:
            self.fail(req, e)
            output = RequestOutput(
                request_id, req.prompt, req.prompt_token_ids, [], True, error=req.error
            )
        if self.speculator is not None:
            output.spec_decoding = self.speculator.request_stats(req.group)
        if output.finished:
            del self.requests[request_id]
        return output
