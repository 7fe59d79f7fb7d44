"""What a request asks its output to be (vLLM's StructuredOutputsParams): the kinds of
constraint, each checked at construction against the limits llguidance can build safely
(limits.py). Compiling is grammar.py's; structural tags are translated in structural_tag.py.
Host side, pure Python; no jax."""

from __future__ import annotations

import dataclasses
import json

from pagedjax.structured_output import limits as structured_limits
from pagedjax.structured_output import structural_tag

# JSON is generated in one style: ", " and ": " between items, no other whitespace (free
# whitespace lets small models loop on newlines)
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclasses.dataclass
class StructuredOutputsParams:
    """vLLM's: exactly one of ``json`` (a JSON schema, as a dict or its text), ``regex``,
    ``choice`` (the output is one of these strings), ``grammar`` (Lark, or GBNF / EBNF as
    llama.cpp writes it), ``json_object=True`` (any JSON object) or ``structural_tag`` (tags in
    free text, as a dict or its JSON text: structural_tag.py). ``whitespace_pattern`` (vLLM's,
    a regex): the whitespace JSON may have between its items, instead of this server's one
    style (JSON_STYLE)."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | dict | None = None
    whitespace_pattern: str | None = None
    # Set at admission: the compiled constraint, shared by every copy of these params.
    # (a grammar.CompiledGrammar: not imported here, grammar.py imports this module)
    compiled: object | None = dataclasses.field(default=None, repr=False, compare=False)

    def __post_init__(self):
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                f"structured_outputs: give exactly one of {', '.join(KINDS)}, got {given or 'none'}"
            )
        if isinstance(self.json, str):
            structured_limits.check_json_text(self.json)
            text = self.json
            try:
                self.json = json.loads(text)
            except (ValueError, RecursionError) as e:
                raise ValueError(f"structured_outputs: json is not valid JSON: {e}") from None
            if self.json is None or self.json is False:  # no schema, or one nothing matches
                shown = text if len(text) <= 40 else text[:40] + "..."
                raise ValueError(
                    f"structured_outputs: json must be a JSON schema an output can match (an "
                    f"object, or true), got {shown!r}"
                )
        if self.json is not None and not isinstance(self.json, dict | bool):
            raise ValueError("structured_outputs: json must be a JSON schema (an object)")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs: {name} must be a non-empty string")
        if self.choice is not None:
            ok = isinstance(self.choice, list | tuple) and self.choice
            if not ok or not all(isinstance(c, str) and c for c in self.choice):
                raise ValueError("structured_outputs: choice must be a list of non-empty strings")
            self.choice = list(self.choice)
        if self.json_object not in (None, True, False):
            raise ValueError("structured_outputs: json_object must be a boolean")
        if self.structural_tag is not None:
            self.structural_tag = structural_tag.normalize(self.structural_tag, JSON_STYLE)
        if self.whitespace_pattern is not None:
            if not isinstance(self.whitespace_pattern, str) or not self.whitespace_pattern:
                raise ValueError(
                    "structured_outputs: whitespace_pattern must be a non-empty string"
                )
            structured_limits.check_regex(self.whitespace_pattern)
            if self.kind not in ("json", "json_object"):
                raise ValueError(
                    f"structured_outputs: whitespace_pattern applies to json and json_object, "
                    f"not {self.kind}"
                )
        self.check_limits()

    def check_limits(self) -> None:
        """Refuse (ValueError naming the limit and the value) a constraint llguidance could not
        build safely (structured_limits.py)."""
        kind = self.kind
        value = getattr(self, kind)
        if kind == "json":
            structured_limits.check_schema(value)
        elif kind == "regex":
            structured_limits.check_regex(value)
        elif kind == "grammar":
            structured_limits.check_grammar(value)
        elif kind == "choice":
            structured_limits.check_choice(value)
        text = self.key()[1]
        if kind in ("json", "structural_tag") and len(text) > structured_limits.MAX_SCHEMA_CHARS:
            raise ValueError(
                f"structured_outputs.json: the schema's length in characters is {len(text)}, over "
                f"the limit of {structured_limits.MAX_SCHEMA_CHARS}"
            )

    @property
    def kind(self) -> str:
        kind = next((k for k in KINDS if getattr(self, k) not in (None, False)), None)
        if kind is None:  # fields set to nothing after construction
            raise ValueError(f"structured_outputs: give exactly one of {', '.join(KINDS)}")
        return kind

    def key(self) -> tuple[str, str]:
        """A hashable, canonical form of the constraint (the compile cache's key)."""
        kind = self.kind
        value = getattr(self, kind)
        if self.whitespace_pattern is not None:
            value = [value, {"whitespace_pattern": self.whitespace_pattern}]
        try:
            return kind, json.dumps(value, sort_keys=True, allow_nan=False)
        except RecursionError:
            raise ValueError(
                f"structured_outputs.{kind}: nested more than the limit of "
                f"{structured_limits.MAX_SCHEMA_DEPTH} levels"
            ) from None
        except (TypeError, ValueError) as e:
            raise ValueError(f"structured_outputs.{kind}: not JSON-serializable: {e}") from None

    def json_style(self) -> dict:
        """llguidance's JSON options for this constraint's JSON."""
        if self.whitespace_pattern is not None:
            return {"whitespace_pattern": self.whitespace_pattern}
        return JSON_STYLE
