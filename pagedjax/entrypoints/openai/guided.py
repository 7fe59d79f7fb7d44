"""vLLM's older structured-output fields: ``guided_json``, ``guided_regex``, ``guided_choice``,
``guided_grammar`` and ``structural_tag`` (one of them), with ``guided_whitespace_pattern`` and
``guided_decoding_backend``, mapped to the same constraint ``structured_outputs`` would give.
400s name the field."""

from __future__ import annotations

import dataclasses

from pagedjax.entrypoints.openai.protocol import bad_request
from pagedjax.sampling_params import StructuredOutputsParams

# request field -> StructuredOutputsParams field
GUIDED_FIELDS = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
    "structural_tag": "structural_tag",
}
# The backends a request may name: this server's (llguidance, vLLM's "guidance"), or "auto"
BACKENDS = ("auto", "guidance", "llguidance")


def given(req) -> bool:
    """Whether the request sets any of the guided fields (its constraint is then compiled off
    the event loop, as structured_outputs' is)."""
    return any(getattr(req, f, None) is not None for f in GUIDED_FIELDS) or (
        getattr(req, "guided_whitespace_pattern", None) is not None
    )


def guided_constraint(req) -> tuple[StructuredOutputsParams | None, str | None]:
    """The constraint of the request's guided field and the field's name; (None, None) when it
    sets none. ValueErrors become 400s naming the field."""
    backend = getattr(req, "guided_decoding_backend", None)
    if backend is not None and backend not in BACKENDS:
        raise bad_request(
            f"guided_decoding_backend {backend!r} is not available: this server's structured "
            f"output is llguidance's; name one of {', '.join(BACKENDS)} or leave it out",
            "guided_decoding_backend",
        )
    fields = [f for f in GUIDED_FIELDS if getattr(req, f, None) is not None]
    if len(fields) > 1:
        raise bad_request(
            f"give one kind of guided decoding: got {', '.join(fields)}",
            fields[1],
        )
    if not fields:
        return None, None
    field = fields[0]
    try:
        return StructuredOutputsParams(**{GUIDED_FIELDS[field]: getattr(req, field)}), field
    except ValueError as e:
        raise bad_request(str(e).replace("structured_outputs", field, 1), field) from None


def with_whitespace(constraint, field: str | None, req):
    """``constraint`` with the request's guided_whitespace_pattern (vLLM's: the whitespace JSON
    may have between its items); a 400 when there is no JSON for it to apply to."""
    pattern = getattr(req, "guided_whitespace_pattern", None)
    if pattern is None:
        return constraint
    if constraint is None or constraint.kind not in ("json", "json_object"):
        kind = "no constraint" if constraint is None else f"{field}'s {constraint.kind}"
        raise bad_request(
            f"guided_whitespace_pattern applies to a JSON constraint, not to {kind}",
            "guided_whitespace_pattern",
        )
    try:
        return dataclasses.replace(constraint, whitespace_pattern=pattern, compiled=None)
    except ValueError as e:
        raise bad_request(str(e), "guided_whitespace_pattern") from None
