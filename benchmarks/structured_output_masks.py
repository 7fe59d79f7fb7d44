"""Token-mask speed of structured-output libraries on one tokenizer (default: the embedded
SmolLM2-135M-Instruct's, 49,152 tokens).

For each library that imports (llguidance, xgrammar, outlines-core), and each of a few JSON
schemas, a regex and a choice: the time to set the tokenizer up once, to compile the constraint,
and, walking the tokens of a valid answer, the time to compute each step's packed int32 bitmask
[1, ceil(vocab / 32)] and to accept the token. Every token of the answer must be allowed by the
mask it was checked against (else the library's line says so).

    python benchmarks/structured_output_masks.py [--model PATH] [--repeats 3] [--json OUT]

This is a benchmark script (it may import torch: xgrammar needs it); the engine never runs it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

SCHEMAS = {
    "flat": (
        {
            "type": "object",
            "properties": {
                "name": {"type": "string"},
                "age": {"type": "integer"},
                "member": {"type": "boolean"},
            },
            "required": ["name", "age", "member"],
        },
        {"name": "Ada Lovelace", "age": 36, "member": True},
    ),
    "nested": (
        {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "country": {"enum": ["France", "Italy", "Spain"]},
                "population": {"type": "integer", "minimum": 0},
                "districts": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {"name": {"type": "string"}, "area": {"type": "number"}},
                        "required": ["name", "area"],
                    },
                    "maxItems": 4,
                },
            },
            "required": ["city", "country", "population", "districts"],
        },
        {
            "city": "Lyon",
            "country": "France",
            "population": 522250,
            "districts": [
                {"name": "Presqu'ile", "area": 3.5},
                {"name": "Croix-Rousse", "area": 4.1},
            ],
        },
    ),
    "pattern": (
        {
            "type": "object",
            "properties": {
                "id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                "tags": {"type": "array", "items": {"type": "string"}, "minItems": 1},
                "score": {"type": "number"},
            },
            "required": ["id", "tags", "score"],
        },
        {"id": "ABC-1234", "tags": ["alpha", "beta", "gamma delta"], "score": -12.25},
    ),
}
REGEX = (
    r"[0-9]{4}-[0-9]{2}-[0-9]{2} [A-Za-z]+( [A-Za-z]+)*\.",
    "2024-03-17 Meeting with the board.",
)
CHOICES = (["positive", "negative", "neutral"], "negative")


def _load_tokenizer(model: str | None):
    from pagedjax.models.loader import default_model_path, gguf_tokenizer

    path = model or default_model_path()
    if path.endswith(".gguf"):
        return gguf_tokenizer(path)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def _answers(tok):
    """(case name, kind, spec, token ids of a valid answer) for every case."""
    out = []
    for name, (schema, instance) in SCHEMAS.items():
        for seps in ((", ", ": "), (",", ":")):
            text = json.dumps(instance, separators=seps)
            out.append(
                (f"json:{name}{'' if seps[0] == ', ' else ':compact'}", "json", schema, text)
            )
    out.append(("regex", "regex", REGEX[0], REGEX[1]))
    out.append(("choice", "choice", CHOICES[0], CHOICES[1]))
    return [(n, k, s, tok(t, add_special_tokens=False)["input_ids"]) for n, k, s, t in out]


def _allowed(mask_row: np.ndarray, token: int) -> bool:
    return bool((int(mask_row[token // 32]) >> (token % 32)) & 1)


class LLGuidance:
    name = "llguidance"

    def __init__(self, tok, vocab):
        import llguidance
        import llguidance.hf

        self.llg = llguidance
        self.tok = llguidance.hf.from_tokenizer(tok, n_vocab=vocab)
        self.vocab = vocab

    def compile(self, kind, spec):
        M = self.llg.LLMatcher
        if kind == "json":
            from pagedjax.structured_output.grammar import JSON_STYLE  # the engine's JSON style

            g = M.grammar_from_json_schema(json.dumps(spec), overrides=JSON_STYLE)
        elif kind == "regex":
            g = M.grammar_from_regex(spec)
        else:
            g = M.grammar_from_regex("(" + "|".join(spec) + ")")
        m = M(self.tok, g, log_level=0)
        if m.is_error():
            raise ValueError(m.get_error())
        return m

    def fill(self, m, mask):
        from llguidance.numpy import fill_next_token_bitmask

        fill_next_token_bitmask(m, mask, 0)

    def accept(self, m, token):
        return m.consume_token(token)


class XGrammar:
    name = "xgrammar"

    def __init__(self, tok, vocab):
        import xgrammar

        self.xgr = xgrammar
        info = xgrammar.TokenizerInfo.from_huggingface(tok, vocab_size=vocab)
        self.compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
        self.vocab = vocab

    def compile(self, kind, spec):
        c = self.compiler
        if kind == "json":
            g = c.compile_json_schema(json.dumps(spec), any_whitespace=False)
        elif kind == "regex":
            g = c.compile_regex(spec)
        else:
            g = c.compile_regex("(" + "|".join(spec) + ")")
        return self.xgr.GrammarMatcher(g)

    def fill(self, m, mask):
        import torch

        t = torch.from_numpy(mask)
        m.fill_next_token_bitmask(t, 0)

    def accept(self, m, token):
        return m.accept_token(token)


class OutlinesCore:
    name = "outlines-core"

    def __init__(self, tok, vocab):
        import outlines_core

        from pagedjax.entrypoints.openai.logprobs import TokenStrings

        self.oc = outlines_core
        strings = TokenStrings(tok)
        eos = tok.eos_token_id
        table: dict[bytes, list[int]] = {}
        for i in range(len(tok)):
            if i != eos and i not in tok.all_special_ids:
                table.setdefault(bytes(strings.bytes(i)), []).append(i)
        self.vocabulary = outlines_core.Vocabulary(eos, table)
        self.vocab = vocab

    def compile(self, kind, spec):
        if kind == "json":
            regex = self.oc.json_schema.build_regex_from_schema(json.dumps(spec), r"[ ]?")
        elif kind == "regex":
            regex = spec
        else:
            regex = "(" + "|".join(spec) + ")"
        return self.oc.Guide(self.oc.Index(regex, self.vocabulary))

    def fill(self, m, mask):
        m.write_mask_into(mask.ctypes.data, mask.size, mask.itemsize)

    def accept(self, m, token):
        m.advance(token, return_tokens=False)
        return True


LIBRARIES = [LLGuidance, XGrammar, OutlinesCore]


def bench(lib_cls, tok, vocab, cases, repeats):
    t0 = time.perf_counter()
    try:
        lib = lib_cls(tok, vocab)
    except ImportError as e:
        return {"library": lib_cls.name, "error": f"not installed: {e}"}
    setup_s = time.perf_counter() - t0
    rows = []
    for name, kind, spec, tokens in cases:
        compile_s, step_s, ok = [], [], True
        error = None
        for _ in range(repeats):
            t0 = time.perf_counter()
            try:
                m = lib.compile(kind, spec)
            except Exception as e:  # an unsupported feature is a result, not a crash
                error = f"{type(e).__name__}: {str(e)[:120]}"
                break
            compile_s.append(time.perf_counter() - t0)
            mask = np.zeros((1, (vocab + 31) // 32), np.int32)
            for t in tokens:
                t0 = time.perf_counter()
                lib.fill(m, mask)
                allowed = _allowed(mask[0], t)
                accepted = lib.accept(m, t)
                step_s.append(time.perf_counter() - t0)
                if not (allowed and accepted):
                    ok = False
                    break
        rows.append(
            {
                "case": name,
                "tokens": len(tokens),
                "valid_answer_accepted": ok and error is None,
                "error": error,
                "compile_ms_median": 1e3 * statistics.median(compile_s) if compile_s else None,
                "mask_us_median": 1e6 * statistics.median(step_s) if step_s else None,
                "mask_us_mean": 1e6 * statistics.fmean(step_s) if step_s else None,
                "mask_us_max": 1e6 * max(step_s) if step_s else None,
            }
        )
    return {"library": lib_cls.name, "setup_s": setup_s, "cases": rows}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="tokenizer source (default: embedded SmolLM2)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--libraries", default="llguidance,xgrammar,outlines-core")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)
    tok = _load_tokenizer(args.model)
    vocab = len(tok)
    cases = _answers(tok)
    load = os.getloadavg()
    print(f"tokenizer: {vocab} tokens; load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    wanted = args.libraries.split(",")
    results = []
    for cls in LIBRARIES:
        if cls.name not in wanted:
            continue
        r = bench(cls, tok, vocab, cases, args.repeats)
        results.append(r)
        if "error" in r:
            print(f"{r['library']}: {r['error']}")
            continue
        print(f"{r['library']}: tokenizer setup {r['setup_s']:.2f} s")
        for c in r["cases"]:
            if c["error"]:
                print(f"  {c['case']:<22} ERROR {c['error']}")
                continue
            print(
                f"  {c['case']:<22} {c['tokens']:>3} tok  compile {c['compile_ms_median']:9.1f} ms"
                f"  mask median {c['mask_us_median']:8.1f} us  mean {c['mask_us_mean']:8.1f} us"
                f"  max {c['mask_us_max']:9.1f} us  valid answer accepted: "
                f"{c['valid_answer_accepted']}"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"vocab": vocab, "loadavg": load, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
