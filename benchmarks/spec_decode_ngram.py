"""N-gram speculation on a copy-heavy workload: SmolLM2-135M-Instruct (the embedded GGUF) is asked
to repeat texts, at batch 1 and batch 8, greedy; output tokens per second with and without
speculation, acceptance rate and mean acceptance length, in one process, side by side.

    python benchmarks/spec_decode_ngram.py [--k 4] [--lookup-min 2] [--lookup-max 4]
        [--max-tokens 160] [--repeats 3] [--batches 1 8] [--json OUT]

Each configuration first runs the workload once untimed (it compiles what it needs), then
``--repeats`` timed runs (min and median wall time). Outputs with and without speculation are
checked to be identical. The load average is printed before and after; figures taken with a
load above 2 are flagged as not to be recorded (DESIGN.md: benchmarks on a quiet machine).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

TEXTS = [
    "The river bends twice before it reaches the old mill, where the water slows and turns "
    "green under the willows. In summer the children of the village swim there, and in winter "
    "the miller's dog walks across the ice to bark at the ducks on the other side.",
    "To make the bread, mix the flour with warm water, salt and a spoon of yeast, knead the "
    "dough for ten minutes, and leave it to rise in a warm place for an hour. Shape it into a "
    "loaf, let it rise again, and bake it in a hot oven until the crust sounds hollow.",
    "The committee met on Tuesday to discuss the budget for the new library. After a long "
    "debate, the members agreed to spend more on books and less on furniture, and to open the "
    "reading room in the evenings so that students could work there after school.",
    "A paged KV cache splits each sequence's keys and values into fixed-size blocks, and a block "
    "table maps the sequence's logical blocks to physical ones, so that memory is allocated on "
    "demand, shared between sequences with a common prefix, and never fragmented.",
    "On the first day of the journey the train crossed the plains, and on the second it climbed "
    "into the mountains, where snow still lay in the shade of the pines. The passengers watched "
    "the valleys fall away below them and the small stations pass one after another.",
    "Every morning the baker opens the shop at six, sweeps the floor, and sets out the loaves "
    "on the wooden shelves. By seven the first customers arrive, and by nine the croissants are "
    "gone, so the late risers have to make do with yesterday's rolls.",
    "The telescope was pointed at a faint galaxy near the edge of the constellation. After three "
    "hours of exposure the image showed spiral arms, a bright core, and a small companion "
    "galaxy that nobody had catalogued before that night.",
    "Please keep your tickets until the end of the journey, as inspectors may ask to see them at "
    "any time. Passengers without a valid ticket will be asked to pay the full fare and a fine, "
    "and may be asked to leave the train at the next station.",
]


def load_average() -> float:
    return os.getloadavg()[0]


def run(llm, prompts, params, repeats: int):
    """One untimed run (compiles), then ``repeats`` timed ones; (outputs, seconds list)."""
    outs = llm.generate(prompts, params, use_tqdm=False)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        times.append(time.perf_counter() - start)
    return outs, times


def _compare_batch(plain, fast, prompts, params, batch: int, repeats: int) -> dict:
    """Times the plain and the ngram engine on one batch size and checks their outputs agree."""
    batch_prompts = [prompts[i % len(prompts)] for i in range(batch)]
    result = {"batch": batch}
    outputs = {}
    for name, llm in (("plain", plain), ("ngram", fast)):
        outs, times = run(llm, batch_prompts, params, repeats)
        outputs[name] = [o.outputs[0].token_ids for o in outs]
        tokens = sum(len(t) for t in outputs[name])
        result[name] = {
            "output_tokens": tokens,
            "seconds_min": min(times),
            "seconds_median": statistics.median(times),
            "tok_per_s_best": tokens / min(times),
        }
    result["identical_outputs"] = outputs["plain"] == outputs["ngram"]
    stats = fast.get_stats().spec_decoding  # over every run of this engine so far
    result["acceptance_rate"] = stats.acceptance_rate
    result["mean_acceptance_length"] = stats.mean_acceptance_length
    result["speedup_best"] = result["plain"]["seconds_min"] / result["ngram"]["seconds_min"]
    print(
        f"batch {batch}: plain {result['plain']['tok_per_s_best']:.1f} tok/s, ngram "
        f"{result['ngram']['tok_per_s_best']:.1f} tok/s (x{result['speedup_best']:.2f}); "
        f"acceptance {stats.acceptance_rate:.1%}, mean acceptance length "
        f"{stats.mean_acceptance_length:.2f}; identical outputs: "
        f"{result['identical_outputs']}",
        flush=True,
    )
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--lookup-min", type=int, default=2)
    ap.add_argument("--lookup-max", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2 GGUF")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)

    from pagedjax import LLM, SamplingParams

    load_before = load_average()
    spec = {
        "method": "ngram",
        "num_speculative_tokens": args.k,
        "prompt_lookup_min": args.lookup_min,
        "prompt_lookup_max": args.lookup_max,
    }
    common = dict(max_model_len=512, max_num_seqs=max(args.batches), enable_prefix_caching=False)
    plain = LLM(args.model, **common)
    fast = LLM(args.model, speculative_config=spec, **common)
    tok = plain.tokenizer
    messages = [
        [{"role": "user", "content": f"Repeat the following text exactly, word for word:\n\n{t}"}]
        for t in TEXTS
    ]
    prompts = [
        tok(tok.apply_chat_template(m, add_generation_prompt=True, tokenize=False))["input_ids"]
        for m in messages
    ]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0)
    rows = [
        _compare_batch(plain, fast, prompts, params, batch, args.repeats) for batch in args.batches
    ]
    load_after = load_average()
    quiet = max(load_before, load_after) <= 2
    print(
        f"load average {load_before:.2f} before, {load_after:.2f} after"
        + ("" if quiet else ": above 2, do not record these figures")
    )
    report = {
        "command": " ".join(["python", *sys.argv]),
        "speculative_config": spec,
        "max_tokens": args.max_tokens,
        "repeats": args.repeats,
        "load_average": [load_before, load_after],
        "quiet_machine": quiet,
        "results": rows,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0 if all(r["identical_outputs"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
