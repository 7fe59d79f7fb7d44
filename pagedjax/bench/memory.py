"""KV memory: paged vs contiguous, sharing savings, swap vs recompute (vLLM paper §6.3-6.4, §7.3).

    pagedjax bench memory [--num-requests N] [--sharing-model tiny|PATH] [--swap-model PATH]
        [--skip utilization,sharing,swap] [--json]

1. Utilisation: the seeded ShareGPT-like mix through the block manager (no model) with paged
   blocks of 8/16/32 and through a contiguous max_model_len reservation, same slot budget:
   tokens stored / slots allocated and the most requests running at once.
2. Sharing: the real engine, peak blocks held (``get_stats().num_blocks_peak``) with sharing vs
   the same sequences held separately. Parallel sampling: n samples of each prompt vs n separate
   requests; beam search: ``beam_search`` with width k vs k separate requests; shared prefix: the
   requests share a few-shot prefix (80 / 341 tokens, the paper's 1- and 5-shot), prefix caching
   on vs off, the first request run alone so that its prefix blocks are computed.
   Saving = 1 - shared / unshared. EOS is ignored so lengths match on both sides. Alpaca-like
   lengths (the paper's
   §6.3 workload: ~19 prompt, ~58 output tokens, lognormal). ``--sharing-model tiny`` (default)
   is a random-weight tiny Llama (block counts do not depend on the weights, beam choices aside).
3. Swap vs recompute: on the swap model (default the embedded SmolLM2-135M), time moving N blocks
   device -> host and back (``Runner.swap_out`` / ``swap_in``) against recomputing the same tokens
   (one prefill of N * block_size tokens) for blocks of 8/16/32; median of a few warm runs.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from pagedjax.bench import emit
from pagedjax.bench.block_utilization import simulate_contiguous, simulate_paged
from pagedjax.bench.workload import sharegpt_like

BLOCK_SIZES = (8, 16, 32)
PAPER = {  # the vLLM paper's reported memory savings (Kwon et al., 2023, §6.3)
    "parallel_sampling": "6.1% - 9.8%",
    "beam_search": "37.6% - 55.2% (66.3% on ShareGPT)",
    "shared_prefix": "1-shot 80-token / 5-shot 341-token prefixes: 1.67x / 3.58x throughput",
}


# ---- 1. utilisation ------------------------------------------------------------------------


def utilization(num_requests: int, max_model_len: int, num_blocks_16: int, seed: int) -> dict:
    """Same slot budget for every block size: (num_blocks_16 - 1) * 16 slots."""
    workload = sharegpt_like(num_requests, max_model_len=max_model_len, seed=seed)
    slots = (num_blocks_16 - 1) * 16
    contiguous = simulate_contiguous(workload, max_model_len=max_model_len, num_slots=slots)
    rows = {}
    for bs in BLOCK_SIZES:
        paged = simulate_paged(workload, block_size=bs, num_blocks=slots // bs + 1)
        rows[str(bs)] = {
            "kv_utilization": paged.kv_utilization,
            "max_concurrent": paged.max_concurrent,
            "mean_concurrent": paged.mean_concurrent,
            "num_preemptions": paged.num_preemptions,
            "utilization_ratio": paged.kv_utilization / contiguous.kv_utilization,
            "concurrency_ratio": paged.max_concurrent / contiguous.max_concurrent,
        }
    return {
        "num_requests": num_requests,
        "max_model_len": max_model_len,
        "kv_slots": slots,
        "paged": rows,
        "contiguous": {
            "kv_utilization": contiguous.kv_utilization,
            "max_concurrent": contiguous.max_concurrent,
            "mean_concurrent": contiguous.mean_concurrent,
        },
    }


# ---- 2. sharing ----------------------------------------------------------------------------


def make_tiny_model(directory: str, seed: int = 0) -> str:
    """A random-weight tiny Llama saved as an HF checkpoint (needs torch)."""
    from pagedjax.bench.tiny import tiny_llama

    tiny_llama(directory, seed, max_position_embeddings=2048)
    return directory


def alpaca_like(num: int, seed: int, vocab: int) -> tuple[list[list[int]], list[int]]:
    """Prompts (random token ids) and output lengths, lognormal around Alpaca's means."""
    rng = np.random.default_rng(seed)
    sigma = 0.6
    plen = np.clip(np.rint(rng.lognormal(math.log(19.3) - sigma**2 / 2, sigma, num)), 4, 128)
    olen = np.clip(np.rint(rng.lognormal(math.log(58.5) - sigma**2 / 2, sigma, num)), 4, 256)
    prompts = [rng.integers(3, vocab, int(n)).tolist() for n in plen]
    return prompts, [int(n) for n in olen]


class _Engines:
    """One engine per prefix-caching setting, reused across runs (loading and compiling once);
    the block manager's peak is restarted before each run."""

    def __init__(self, model: str, block_size: int):
        self.model, self.block_size, self.llms = model, block_size, {}

    def peak(self, run, caching: bool = False) -> int:
        from pagedjax.entrypoints.llm import LLM

        if caching not in self.llms:
            self.llms[caching] = LLM(
                self.model,
                block_size=self.block_size,
                num_blocks=4096,
                enable_prefix_caching=caching,
                max_num_seqs=512,
            )
        llm = self.llms[caching]
        bm = llm.engine.block_manager
        bm._num_used_peak = bm.get_stats().num_blocks_used  # restart the running peak
        run(llm)
        return llm.get_stats().num_blocks_peak

    def close(self) -> None:
        for llm in self.llms.values():
            llm.close()


FEW_SHOT_PREFIXES = (("1-shot", 80), ("5-shot", 341))  # the paper's translation prompts, tokens


def sharing(
    model: str,
    num_prompts: int,
    widths,
    seed: int,
    block_size: int = 16,
    prefixes=FEW_SHOT_PREFIXES,
) -> dict:
    from pagedjax.sampling_params import BeamSearchParams, SamplingParams

    cfg = Path(model) / "config.json"  # an HF checkpoint directory; else a GGUF (big vocab)
    vocab = min(json.loads(cfg.read_text())["vocab_size"], 1000) if cfg.exists() else 1000
    prompts, out_lens = alpaca_like(num_prompts, seed, vocab)

    def params(n: int, temperature: float = 1.0):
        return [
            SamplingParams(n=n, max_tokens=o, temperature=temperature, ignore_eos=True, seed=i)
            for i, o in enumerate(out_lens)
        ]

    def separate(k: int):  # k independent copies of every request: nothing shared
        ps = [p for p in prompts for _ in range(k)]
        sp = [
            SamplingParams(max_tokens=o, temperature=1.0, ignore_eos=True, seed=j)
            for o in out_lens
            for j in range(k)
        ]
        return lambda llm: llm.generate(ps, sp, use_tqdm=False)

    engines = _Engines(model, block_size)
    peak = engines.peak

    res = {"num_prompts": num_prompts, "block_size": block_size, "paper": PAPER}
    res["parallel_sampling"] = {}
    for n in widths:
        shared = peak(lambda llm, n=n: llm.generate(prompts, params(n), use_tqdm=False))
        unshared = peak(separate(n))
        res["parallel_sampling"][str(n)] = _saving(shared, unshared)
    res["beam_search"] = {}
    max_tokens = int(np.median(out_lens))
    for k in widths:
        beam = BeamSearchParams(beam_width=k, max_tokens=max_tokens, ignore_eos=True)
        shared = peak(lambda llm, beam=beam: llm.beam_search(prompts, beam))
        sp = SamplingParams(max_tokens=max_tokens, temperature=1.0, ignore_eos=True)
        ps = [p for p in prompts for _ in range(k)]
        unshared = peak(lambda llm, ps=ps, sp=sp: llm.generate(ps, sp, use_tqdm=False))
        res["beam_search"][str(k)] = _saving(shared, unshared)
    res["shared_prefix"] = {}
    rng = np.random.default_rng(seed + 7)
    for shots, prefix_len in prefixes:
        prefix = rng.integers(3, vocab, prefix_len).tolist()
        ps = [prefix + p for p in prompts]
        sp = [SamplingParams(max_tokens=o, temperature=0, ignore_eos=True) for o in out_lens]

        def run(llm, ps=ps, sp=sp):  # the first request computes the prefix, the rest reuse it
            llm.generate(ps[:1], sp[:1], use_tqdm=False)
            llm.generate(ps[1:], sp[1:], use_tqdm=False)

        res["shared_prefix"][shots] = {
            "prefix_len": prefix_len,
            **_saving(peak(run, caching=True), peak(run, caching=False)),
        }
    engines.close()
    return res


def _saving(shared: int, unshared: int) -> dict:
    return {
        "peak_blocks_shared": shared,
        "peak_blocks_unshared": unshared,
        "saving": 1 - shared / unshared,
    }


# ---- 3. swap vs recompute ------------------------------------------------------------------


def swap_vs_recompute(model: str, num_tokens: int, repeats: int) -> dict:
    import jax

    from pagedjax.models.loader import load_model
    from pagedjax.worker.runner import Runner, RunnerConfig, ScheduledSeq

    loaded = load_model(model)
    rows = {}
    tokens = (
        np.random.default_rng(0)
        .integers(3, min(loaded.config.vocab_size, 1000), num_tokens)
        .tolist()
    )
    for bs in BLOCK_SIZES:
        n = num_tokens // bs
        sizes = RunnerConfig(
            num_blocks=n + 2, block_size=bs, max_model_len=num_tokens, num_host_blocks=n + 1
        )
        runner = Runner(loaded.config, loaded.params, sizes)
        table = list(range(1, n + 1))
        pairs = [(b, b) for b in table]
        seq = [ScheduledSeq(tokens[: n * bs], 0, table)]

        def timed(fn, runner=runner):
            fn()
            jax.block_until_ready(runner.kv_cache.pages)  # warm: compile once
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                fn()
                jax.block_until_ready(runner.kv_cache.pages)
                times.append(time.perf_counter() - start)
            return statistics.median(times)

        recompute = timed(lambda seq=seq, runner=runner: runner.forward_logits(seq))
        out = timed(lambda pairs=pairs, runner=runner: runner.swap_out(pairs))
        back = timed(lambda pairs=pairs, runner=runner: runner.swap_in(pairs))
        runner.free_device_memory()
        rows[str(bs)] = {
            "num_blocks": n,
            "swap_out_s": out,
            "swap_in_s": back,
            "swap_total_s": out + back,
            "recompute_s": recompute,
            "swap_over_recompute": (out + back) / recompute,
        }
    return {
        "model": model,
        "num_tokens": num_tokens,
        "device": jax.devices()[0].platform,
        "rows": rows,
    }


# ---- report --------------------------------------------------------------------------------


def print_report(res: dict) -> None:
    u = res.get("utilization")
    if u:
        c = u["contiguous"]
        print(
            f"[utilisation] {u['num_requests']} ShareGPT-like requests, max_model_len "
            f"{u['max_model_len']}, budget {u['kv_slots']} KV slots"
        )
        print(f"{'':24}{'KV util':>9}{'vs contig':>11}{'max conc':>10}{'vs contig':>11}")
        for bs, r in u["paged"].items():
            print(
                f"{'paged block ' + bs:24}{r['kv_utilization']:9.4f}"
                f"{r['utilization_ratio']:10.2f}x{r['max_concurrent']:10d}"
                f"{r['concurrency_ratio']:10.2f}x"
            )
        print(
            f"{'contiguous max-length':24}{c['kv_utilization']:9.4f}{'':11}"
            f"{c['max_concurrent']:10d}"
        )
    s = res.get("sharing")
    if s:
        print(
            f"[sharing] {s['num_prompts']} Alpaca-like prompts, block {s['block_size']}, "
            "peak blocks shared / unshared -> saving (paper)"
        )
        for kind, label in (("parallel_sampling", "n"), ("beam_search", "beam width")):
            for k, r in s[kind].items():
                print(
                    f"  {kind.replace('_', ' ')} {label}={k}: {r['peak_blocks_shared']} / "
                    f"{r['peak_blocks_unshared']} -> {100 * r['saving']:.1f}%  "
                    f"(paper {PAPER[kind]})"
                )
        for shots, r in s["shared_prefix"].items():
            print(
                f"  shared prefix {shots} ({r['prefix_len']} tokens): {r['peak_blocks_shared']} / "
                f"{r['peak_blocks_unshared']} -> {100 * r['saving']:.1f}%"
            )
    w = res.get("swap")
    if w:
        print(f"[swap vs recompute] {w['num_tokens']} tokens of KV, {w['model']} on {w['device']}")
        print(
            f"{'block':>6}{'blocks':>8}{'swap out ms':>13}{'swap in ms':>12}{'recompute ms':>14}"
            f"{'swap/recomp':>13}"
        )
        for bs, r in w["rows"].items():
            print(
                f"{bs:>6}{r['num_blocks']:8d}{1e3 * r['swap_out_s']:13.1f}"
                f"{1e3 * r['swap_in_s']:12.1f}{1e3 * r['recompute_s']:14.1f}"
                f"{r['swap_over_recompute']:13.2f}"
            )


def _widths(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    parser = parser or argparse.ArgumentParser(prog="pagedjax bench memory")
    parser.description = __doc__.split("\n")[0]
    parser.add_argument("--num-requests", type=int, default=1000, help="utilisation workload")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--num-blocks", type=int, default=2048, help="budget, in blocks of 16")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sharing-model", default="tiny", help="'tiny' or a model path")
    parser.add_argument("--sharing-prompts", type=int, default=16)
    parser.add_argument("--widths", type=_widths, default=[2, 4, 6], help="n and beam widths")
    parser.add_argument("--swap-model", default=None, help="default: the embedded SmolLM2")
    parser.add_argument("--swap-tokens", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip", default="", help="comma list of utilization,sharing,swap")
    parser.add_argument("--json", action="store_true")
    return parser


def run(args) -> int:
    skip = {x.strip() for x in args.skip.split(",") if x.strip()}
    bad = skip - {"utilization", "sharing", "swap"}
    if bad:
        raise ValueError(f"--skip: unknown part(s) {sorted(bad)}")
    res = {}
    if "utilization" not in skip:
        res["utilization"] = utilization(
            args.num_requests, args.max_model_len, args.num_blocks, args.seed
        )
    if "sharing" not in skip:
        with tempfile.TemporaryDirectory() as tmp:
            model = args.sharing_model
            if model == "tiny":
                model = make_tiny_model(tmp + "/tiny")
            res["sharing"] = sharing(model, args.sharing_prompts, args.widths, args.seed)
            res["sharing"]["model"] = args.sharing_model
    if "swap" not in skip:
        from pagedjax.models.loader import default_model_path

        res["swap"] = swap_vs_recompute(
            args.swap_model or default_model_path(), args.swap_tokens, args.repeats
        )
    return emit(res, args.json, print_report)


def main(argv: list[str] | None = None) -> int:
    return run(build_parser().parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
