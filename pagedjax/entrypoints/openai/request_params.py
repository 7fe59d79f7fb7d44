"""From a validated request body (protocol) to what the engine takes: its structured-output
constraint, its logit_bias with integer keys, its SamplingParams or BeamSearchParams
(``engine_params``, vLLM's ``to_sampling_params``: each request class says which of its fields
hold the token limit and the logprobs), and the bound on the logprob entries its response could
carry. Everything here raises APIError naming the field."""

from __future__ import annotations

import dataclasses
import re

from pagedjax.entrypoints.openai import guided
from pagedjax.entrypoints.openai.protocol import (
    ChatRequest,
    GenerationRequest,
    ServerLimits,
    bad_request,
    unsupported_field,
)
from pagedjax.sampling_params import BeamSearchParams, SamplingParams, StructuredOutputsParams


def structured_outputs(req: GenerationRequest) -> tuple[StructuredOutputsParams | None, str]:
    """The request's output constraint (from response_format, structured_outputs or one of
    vLLM's older guided_* fields: guided.py) and the field it came from; 400s name what is wrong
    with it."""
    constraint, field = _format_constraint(req)
    old, old_field = guided.guided_constraint(req)
    if old is not None:
        if constraint is not None:
            raise bad_request(f"give {field} or {old_field}, not both", old_field)
        constraint, field = old, old_field
    return guided.with_whitespace(constraint, field, req), field


def _format_constraint(req: GenerationRequest) -> tuple[StructuredOutputsParams | None, str]:
    rf, so = req.response_format, req.structured_outputs
    if rf is not None and rf.get("type") != "text" and so is not None:
        raise bad_request("give response_format or structured_outputs, not both", "response_format")
    try:
        if so is not None:
            fields = {f.name for f in dataclasses.fields(StructuredOutputsParams)} - {"compiled"}
            unknown = sorted(set(so) - fields)
            if unknown:
                raise ValueError(f"structured_outputs: unknown field {unknown[0]!r}")
            return StructuredOutputsParams(**so), "structured_outputs"
        if rf is None or rf.get("type") == "text":
            return None, "response_format"
        kind = rf.get("type")
        if kind == "json_object":
            return StructuredOutputsParams(json_object=True), "response_format"
        if kind == "json_schema":
            spec = rf.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
                raise ValueError(
                    "response_format: json_schema must be an object with a 'schema' object"
                )
            return StructuredOutputsParams(json=spec["schema"]), "response_format"
        if kind == "structural_tag":  # vLLM's, both of its forms (structural_tag.py)
            tag = StructuredOutputsParams(structural_tag=rf)
            return tag, "response_format"
        raise ValueError(
            "response_format: type must be text, json_object, json_schema or structural_tag, "
            f"got {kind!r}"
        )
    except ValueError as e:
        param = "structured_outputs" if so is not None else "response_format"
        raise bad_request(str(e), param) from None


_TOKEN_ID_KEY = re.compile(r"\s*-?[0-9]{1,20}\s*", re.ASCII)


def logit_bias(req: GenerationRequest, vocab_size: int) -> dict[int, float] | None:
    """The request's logit_bias with integer keys, each a token id of the vocabulary."""
    if not req.logit_bias:
        return None
    out = {}
    for key, value in req.logit_bias.items():
        # ASCII digits only: str.isdigit() takes "²", int() takes "٣" and "1_0", and a key of
        # thousands of digits would only be refused by int() itself.
        if not _TOKEN_ID_KEY.fullmatch(key):
            shown = key if len(key) <= 40 else key[:40] + "..."
            raise bad_request(
                f"logit_bias: keys are token ids (decimal integers), got {shown!r}", "logit_bias"
            )
        token = int(key)
        if not 0 <= token < vocab_size:
            raise bad_request(
                f"logit_bias: token id {token} is outside the vocabulary [0, {vocab_size})",
                "logit_bias",
            )
        out[token] = value
    return out


@dataclasses.dataclass(frozen=True)
class ParamsContext:
    """What a request's params are built against: the server's limits, the model's sampling
    defaults (its generation config) for fields a request leaves unset, its vocabulary size."""

    limits: ServerLimits
    defaults: dict
    vocab_size: int


def engine_params(
    req: GenerationRequest,
    max_tokens: int,
    max_tokens_field: str,
    constraint: StructuredOutputsParams | None,
    constraint_field: str,
    context: ParamsContext,
) -> SamplingParams | BeamSearchParams:
    """The engine's params for ``req`` (a completion or chat request): beam search with
    use_beam_search, else sampling, generating up to ``max_tokens`` (asked for in
    ``max_tokens_field``) under ``constraint`` (from ``constraint_field``). The logit_bias is
    checked first, whatever runs."""
    extra = {"logit_bias": logit_bias(req, context.vocab_size), "structured_outputs": constraint}
    prompt_k = req.engine_prompt_logprobs()
    if prompt_k is not None:
        extra["prompt_logprobs"] = prompt_k
    if req.use_beam_search:
        refused = constraint_field if constraint is not None else None
        return beam_search_params(req, max_tokens, max_tokens_field, refused)
    return sampling_params(
        req,
        max_tokens,
        max_tokens_field,
        req.logprobs_k(),
        context.limits,
        defaults=context.defaults,
        **extra,
    )


def sampling_params(
    req: GenerationRequest,
    max_tokens: int,
    max_tokens_field: str,
    logprobs: int | None,
    limits: ServerLimits,
    *,
    defaults: dict | None = None,
    **extra,
) -> SamplingParams:
    """SamplingParams for ``req`` (``extra``: more SamplingParams fields; ``defaults``: the
    model's for the fields the request leaves unset); its ValueErrors become 400s naming the
    field."""
    defaults = defaults or {}
    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stops) > limits.max_stop_strings:
        raise bad_request(
            f"stop: at most {limits.max_stop_strings} stop strings per request, got {len(stops)}",
            "stop",
        )
    longest = max((len(s) for s in stops), default=0)
    if longest > limits.max_stop_string_chars:
        raise bad_request(
            f"stop: a stop string is at most {limits.max_stop_string_chars} characters, "
            f"got {longest}",
            "stop",
        )
    stop_ids = req.stop_token_ids or []
    if len(stop_ids) > limits.max_stop_strings:
        raise bad_request(
            f"stop_token_ids: at most {limits.max_stop_strings} per request, got {len(stop_ids)}",
            "stop_token_ids",
        )
    if max_tokens < 1:
        raise bad_request(
            f"{max_tokens_field} must be at least 1, got {max_tokens}", max_tokens_field
        )
    kwargs = dict(
        n=req.best_of or req.n,
        max_tokens=max_tokens,
        temperature=_or_default(req.temperature, "temperature", defaults, 1.0),
        top_p=_or_default(req.top_p, "top_p", defaults, 1.0),
        top_k=_or_default(req.top_k, "top_k", defaults, 0),
        min_p=_or_default(req.min_p, "min_p", defaults, 0.0),
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=_or_default(req.repetition_penalty, "repetition_penalty", defaults, 1.0),
        seed=req.seed,
        stop=stops,
        stop_token_ids=list(stop_ids),
        ignore_eos=req.ignore_eos,
        min_tokens=req.min_tokens,
        include_stop_str_in_output=req.include_stop_str_in_output,
        skip_special_tokens=req.skip_special_tokens,
        truncate_prompt_tokens=req.truncate_prompt_tokens,
        allowed_token_ids=req.allowed_token_ids,
        logprobs=logprobs,
        **extra,
    )
    try:
        return SamplingParams(**kwargs)
    except ValueError as e:
        message = str(e)
        first = message.split(maxsplit=1)[0] if message else ""
        field = first if first in kwargs else None
        if field == "max_tokens":
            field = max_tokens_field
        elif field == "n" and req.best_of:
            field = "best_of"
        elif field == "prompt_logprobs" and req.prompt_logprobs is None:  # echo's
            field = "logprobs"
        elif field == "logprobs" and isinstance(req, ChatRequest):
            field = "top_logprobs"
        raise bad_request(message, field) from None


# field -> the values beam search takes besides None: it ranks beams by the model's own
# logprobs (vLLM's beam search at temperature 0 does too) and stops on EOS and max_tokens alone
_BEAM_NEUTRAL: dict[str, tuple] = {
    "stream": (False,),
    "best_of": (),
    "temperature": (0.0, 1.0),
    "top_p": (1.0,),
    "top_k": (0, -1),
    "min_p": (0.0,),
    "presence_penalty": (0.0,),
    "frequency_penalty": (0.0,),
    "repetition_penalty": (1.0,),
    "stop": ("", []),
    "stop_token_ids": ([],),
    "logit_bias": ({},),
    "min_tokens": (0,),
    "allowed_token_ids": (),
    "prompt_logprobs": (),
    "include_stop_str_in_output": (False,),
    "truncate_prompt_tokens": (),
    "logprobs": (False,),
    "top_logprobs": (),
}


def beam_search_params(
    req: GenerationRequest, max_tokens: int, max_tokens_field: str, constraint_field
) -> BeamSearchParams:
    """vLLM's use_beam_search: ``n`` beams, the n best returned best first. A field beam search
    does not take (a sampling filter, a stop string, logprobs, streaming, a constraint from
    ``constraint_field``) is a 400 naming it."""
    if (name := unsupported_field(req, _BEAM_NEUTRAL)) is not None:
        raise bad_request(f"{name} is not supported with use_beam_search", name)
    if constraint_field is not None:
        raise bad_request(
            f"{constraint_field} is not supported with use_beam_search", constraint_field
        )
    try:
        return BeamSearchParams(
            beam_width=req.n,
            max_tokens=max_tokens,
            ignore_eos=req.ignore_eos,
            length_penalty=req.length_penalty,
        )
    except ValueError as e:
        field = {"beam_width": "n", "max_tokens": max_tokens_field}.get(str(e).split()[0])
        raise bad_request(str(e).replace("beam_width", "n (the beams)", 1), field) from None


def _or_default(value, name: str, defaults: dict, fallback):
    """The request's value; else the model's default (its generation config); else ours."""
    return value if value is not None else defaults.get(name, fallback)


def default_max_tokens(room: int, defaults: dict) -> int:
    """A request's token limit when it sets none: what the context leaves (at least 1), capped
    by the model's generation config (max_new_tokens)."""
    cap = defaults.get("max_tokens")
    return max(room, 1) if cap is None else min(max(room, 1), cap)


def check_response_logprobs(
    limits: ServerLimits,
    prompts: list[list[int]],
    *,
    k: int | None,
    n: int,
    max_tokens: int,
    echo: bool,
    field: str,
) -> None:
    """Refuse, before anything runs, a request whose response could carry more logprob entries
    than ``limits.max_response_logprobs``: per token its own and ``k`` alternatives, for the
    echoed prompts and for up to ``max_tokens`` tokens of each of the ``n`` choices."""
    if k is None:
        return
    prompt_tokens = sum(len(ids) for ids in prompts) if echo else 0
    tokens = prompt_tokens + len(prompts) * n * max_tokens
    entries = tokens * (k + 1)
    if entries > limits.max_response_logprobs:
        raise bad_request(
            f"{field}: the response could carry {entries} logprob entries ({tokens} tokens x "
            f"{k + 1}), over this server's limit of {limits.max_response_logprobs} "
            "(--max-response-logprobs); ask for fewer logprobs, tokens or choices",
            field,
        )
