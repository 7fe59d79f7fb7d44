"""Structured output on the real model: SmolLM2-135M-Instruct (the embedded GGUF) writes JSON for
random schemas, text matching regexes, and one of given choices, greedy and sampled; every output
is checked (json.loads + jsonschema, re.fullmatch, membership), and the host time spent on
grammar masks is measured against the engine's step time.

    python benchmarks/structured_output_smollm.py [--num-schemas 50] [--json OUT]

Prints one line per run (valid / total, finish reasons, tokens, wall time) and the mask overhead:
grammar host time per step (RequestGrammar.mask + after_token) over the mean step time, with and
without constraints at the same batch size.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import sys
import time

import numpy as np

TOPICS = [
    "a city",
    "a book",
    "a person",
    "a car",
    "a planet",
    "a recipe",
    "a movie",
    "a company",
    "a song",
    "a country",
    "a dog",
    "a sports team",
    "a river",
    "a museum",
    "a laptop",
]
NAMES = [
    "name",
    "title",
    "year",
    "age",
    "price",
    "rating",
    "color",
    "country",
    "tags",
    "active",
    "count",
    "author",
    "size",
    "kind",
    "score",
    "city",
    "owner",
    "weight",
    "code",
    "notes",
]
REGEXES = [
    (r"\d{4}-\d{2}-\d{2}", "Today's date in ISO format:"),
    (r"[A-Z][a-z]+ [A-Z][a-z]+", "A famous scientist's first and last name:"),
    (r"\(\d{3}\) \d{3}-\d{4}", "A US phone number:"),
    (r"[a-z]+@[a-z]+\.(com|org|net)", "An email address:"),
    (r"#[0-9a-f]{6}", "The hex code of a shade of blue:"),
    (r"(Mon|Tue|Wed|Thu|Fri|Sat|Sun)day", "A day of the week:"),
    (r"\d{1,3}(,\d{3})*", "The population of Paris:"),
    (r"[A-Z]{3}", "The three-letter code of an airport:"),
    (r"(yes|no)\. [A-Z][a-z ]{5,40}\.", "Is water wet? Answer and explain in one sentence."),
    (r"\d+ \+ \d+ = \d+", "An addition:"),
    (r"[A-Z][a-z]+(, [A-Z][a-z]+){2}", "Three fruits, comma separated:"),
    (r"v\d+\.\d+\.\d+", "A software version number:"),
    (r"\d{2}:\d{2}", "A time of day (24h):"),
    (r"[a-z_]+\(\)", "A Python function call with no arguments:"),
    (r"-?\d+\.\d{2}", "A temperature in Celsius with two decimals:"),
    (r"https://[a-z]+\.[a-z]{2,3}/", "A website URL:"),
    (r"[A-Z][a-z]+ is the capital of [A-Z][a-z]+\.", "Name a capital city:"),
    (r"(red|green|blue|yellow)( and (red|green|blue|yellow))?", "Colors of a flag:"),
    (r"\d{5}", "A five-digit ZIP code:"),
    (r"[A-Z][a-z]{2,10}", "One word describing the sea:"),
]
CHOICES = [
    (["positive", "negative", "neutral"], "Sentiment of 'I loved this film!':"),
    (["yes", "no"], "Is the sun a star?"),
    (["Paris", "London", "Berlin", "Madrid"], "The capital of France is"),
    (["cat", "dog", "fish"], "Which animal barks?"),
    (["red", "green", "blue"], "The color of grass:"),
    (["true", "false"], "2 + 2 = 4. True or false?"),
    (["small", "medium", "large"], "The size of an elephant:"),
    (["Python", "Rust", "JavaScript"], "A language for web browsers:"),
    (["spring", "summer", "autumn", "winter"], "The coldest season:"),
    (["north", "south", "east", "west"], "The sun rises in the"),
    (["A", "B", "C", "D"], "Pick a letter:"),
    (["one", "two", "three"], "How many eyes do people have?"),
    (["water", "fire", "earth", "air"], "What do fish live in?"),
    (["happy", "sad"], "How does winning feel?"),
    (["Monday", "Friday", "Sunday"], "The first day of the work week:"),
    (["tea", "coffee", "juice"], "A drink made from beans:"),
    (["up", "down"], "Which way does rain fall?"),
    (["hot", "cold"], "Ice is"),
    (["Mars", "Venus", "Jupiter"], "The largest planet:"),
    (["piano", "guitar", "drums"], "An instrument with 88 keys:"),
]


def random_schema(rng: np.random.Generator, depth: int = 0) -> dict:
    props = {}
    names = rng.choice(NAMES, size=int(rng.integers(1, 5)), replace=False)
    for name in names:
        kinds = ["string", "integer", "number", "boolean", "enum", "array"]
        kinds += ["object"] if depth == 0 else []
        kind = str(rng.choice(kinds))
        if kind == "string":
            prop = {"type": "string", "maxLength": int(rng.integers(5, 40))}
        elif kind == "integer":
            lo = int(rng.integers(-10, 100))
            prop = {"type": "integer", "minimum": lo, "maximum": lo + int(rng.integers(1, 5000))}
        elif kind == "number":
            prop = {"type": "number"}
        elif kind == "boolean":
            prop = {"type": "boolean"}
        elif kind == "enum":
            prop = {"enum": [str(x) for x in rng.choice(["low", "mid", "high", "n/a"], 3, False)]}
        elif kind == "array":
            prop = {
                "type": "array",
                "items": {"type": "string", "maxLength": 20},
                "maxItems": int(rng.integers(1, 4)),
            }
        else:
            prop = random_schema(rng, depth + 1)
        props[str(name)] = prop
    return {
        "type": "object",
        "properties": props,
        "required": list(props),
        "additionalProperties": False,
    }


class GrammarTimer:
    """Host seconds spent in RequestGrammar.mask / after_token, and engine step seconds."""

    def __init__(self):
        from pagedjax.engine.llm_engine import LLMEngine
        from pagedjax.structured_output.grammar import RequestGrammar

        self.grammar_s = 0.0
        self.step_s: list[float] = []
        self.grammar_at_step: list[float] = []
        for cls, name in ((RequestGrammar, "mask"), (RequestGrammar, "after_token")):
            self._wrap(cls, name, grammar=True)
        self._wrap(LLMEngine, "step", grammar=False)

    def _wrap(self, cls, name, grammar: bool):
        original = getattr(cls, name)
        timer = self

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                spent = time.perf_counter() - start
                if grammar:
                    timer.grammar_s += spent
                else:
                    timer.step_s.append(spent)
                    timer.grammar_at_step.append(timer.grammar_s)

        setattr(cls, name, timed)

    def reset(self):
        self.grammar_s = 0.0
        self.step_s, self.grammar_at_step = [], []


def check_json(text: str, schema: dict) -> bool:
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), schema)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


def run(llm, timer, name, convs, params, check) -> dict:
    timer.reset()
    start = time.perf_counter()
    outs = llm.chat(convs, params, use_tqdm=False)
    wall = time.perf_counter() - start
    valid = sum(check(i, o.outputs[0].text) for i, o in enumerate(outs))
    reasons = collections.Counter(o.outputs[0].finish_reason for o in outs)
    tokens = [len(o.outputs[0].token_ids) for o in outs]
    steps = len(timer.step_s)
    row = {
        "run": name,
        "valid": valid,
        "total": len(outs),
        "finish_reasons": dict(reasons),
        "mean_tokens": float(np.mean(tokens)),
        "wall_s": wall,
        "steps": steps,
        "mean_step_ms": 1e3 * float(np.mean(timer.step_s)) if steps else 0.0,
        "grammar_ms_per_step": 1e3 * timer.grammar_s / max(steps, 1),
        "grammar_us_per_token": 1e6 * timer.grammar_s / max(sum(tokens), 1),
        "invalid_examples": [
            o.outputs[0].text[:200] for i, o in enumerate(outs) if not check(i, o.outputs[0].text)
        ][:3],
    }
    print(
        f"{name:<16} valid {valid}/{len(outs)}  finish {dict(reasons)}  mean tokens "
        f"{row['mean_tokens']:.1f}  wall {wall:.1f} s  steps {steps}  "
        f"step {row['mean_step_ms']:.1f} ms  grammar {row['grammar_ms_per_step']:.2f} ms/step "
        f"({row['grammar_us_per_token']:.0f} us/token)",
        flush=True,
    )
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--num-schemas", type=int, default=50)
    ap.add_argument("--max-tokens", type=int, default=320)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    from pagedjax import LLM
    from pagedjax.sampling_params import SamplingParams, StructuredOutputsParams

    load = os.getloadavg()
    print(f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}", flush=True)
    llm = LLM(args.model, max_model_len=1024, max_num_seqs=64)
    timer = GrammarTimer()
    rng = np.random.default_rng(args.seed)
    schemas = [random_schema(rng) for _ in range(args.num_schemas)]
    topics = [TOPICS[i % len(TOPICS)] for i in range(args.num_schemas)]
    convs = [
        [
            {
                "role": "user",
                "content": f"Describe {t} as a JSON object following this JSON schema: "
                f"{json.dumps(s)}",
            }
        ]
        for t, s in zip(topics, schemas, strict=True)
    ]
    rows = []

    def so_params(constraints, temperature):
        return [
            SamplingParams(
                max_tokens=args.max_tokens,
                temperature=temperature,
                seed=args.seed + i,
                structured_outputs=c,
            )
            for i, c in enumerate(constraints)
        ]

    json_so = [StructuredOutputsParams(json=s) for s in schemas]
    ok_json = lambda i, text: check_json(text, schemas[i])  # noqa: E731
    # Warm-up (compiles the programs of these batch shapes), then the measured runs.
    llm.chat(convs[:4], so_params(json_so[:4], 0.0), use_tqdm=False)
    rows.append(run(llm, timer, "json greedy", convs, so_params(json_so, 0.0), ok_json))
    rows.append(run(llm, timer, "json sampled", convs, so_params(json_so, 0.8), ok_json))
    plain = [SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)] * len(convs)
    rows.append(run(llm, timer, "unconstrained", convs, plain, lambda i, t: True))

    rx_convs = [[{"role": "user", "content": p}] for _, p in REGEXES]
    rx_so = [StructuredOutputsParams(regex=r) for r, _ in REGEXES]
    ok_rx = lambda i, text: re.fullmatch(REGEXES[i][0], text) is not None  # noqa: E731
    rows.append(run(llm, timer, "regex greedy", rx_convs, so_params(rx_so, 0.0), ok_rx))
    rows.append(run(llm, timer, "regex sampled", rx_convs, so_params(rx_so, 0.8), ok_rx))

    ch_convs = [[{"role": "user", "content": p}] for _, p in CHOICES]
    ch_so = [StructuredOutputsParams(choice=c) for c, _ in CHOICES]
    ok_ch = lambda i, text: text in CHOICES[i][0]  # noqa: E731
    rows.append(run(llm, timer, "choice greedy", ch_convs, so_params(ch_so, 0.0), ok_ch))
    rows.append(run(llm, timer, "choice sampled", ch_convs, so_params(ch_so, 0.8), ok_ch))
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"loadavg_before": load, "loadavg_after": os.getloadavg(), "runs": rows},
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
