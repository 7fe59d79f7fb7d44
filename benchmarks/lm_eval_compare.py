"""lm-evaluation-harness on pagedjax's server against the same harness on transformers, offline.

The task is benchmarks/lm_eval/tiny_mc.jsonl (40 four-way multiple-choice questions written for
this repository), scored by log-likelihood (acc, acc_norm). pagedjax is reached as lm-eval's
``local-completions`` model (token-id prompts, ``echo`` + ``logprobs=1`` + ``max_tokens=1``) on a
``pagedjax serve`` it starts; the oracle is lm-eval's ``hf`` model on the same GGUF weights
(dequantized by transformers; torch, float32, CPU). Both use the same tokenizer, so their
per-choice log-likelihoods are compared one by one.

    pip install "lm-eval[api]"   # then
    python benchmarks/lm_eval_compare.py [--model PATH.gguf] [--port 8765] [--json OUT]

Needs no network: the data and the task are local, HF_HUB_OFFLINE / HF_DATASETS_OFFLINE are set.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
TASK = "pagedjax_tiny_mc"
TASK_YAML = """task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
target_delimiter: " "
metric_list:
  - metric: acc
  - metric: acc_norm
"""


def _wait_healthy(base: str, proc: subprocess.Popen, timeout: float = 900) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"pagedjax serve exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(base + "/health", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(2)
    raise TimeoutError("pagedjax serve did not become healthy")


def _lls(results) -> list[float]:
    """Per-choice log-likelihoods of every document, in document order."""
    out = []
    for s in sorted(results["samples"][TASK], key=lambda s: s["doc_id"]):
        out += [float(r[0][0]) for r in s["resps"]]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a .gguf file (default: the embedded SmolLM2)")
    ap.add_argument("--port", type=int, default=8765)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    from pagedjax.models.loader import default_model_path, gguf_tokenizer

    gguf = Path(args.model or default_model_path())
    work = Path(tempfile.mkdtemp(prefix="lm_eval_"))
    tok_dir = work / "tokenizer"
    gguf_tokenizer(str(gguf)).save_pretrained(tok_dir)  # lm-eval loads it with AutoTokenizer
    (work / "tasks").mkdir()
    (work / "tasks" / f"{TASK}.yaml").write_text(
        TASK_YAML.format(task=TASK, data=HERE / "lm_eval" / "tiny_mc.jsonl")
    )

    import lm_eval
    from lm_eval.tasks import TaskManager

    tasks = TaskManager(include_path=str(work / "tasks"))
    load = os.getloadavg()
    print(f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}", flush=True)

    base = f"http://127.0.0.1:{args.port}"
    serve = [
        sys.executable, "-m", "pagedjax", "serve", "--model", str(gguf), "--port",
        str(args.port), "--served-model-name", "smollm", "--max-model-len", "1024",
        "--no-warmup",  # compile what the requests need, not every program up front
    ]  # fmt: skip
    log = open(work / "serve.log", "w")  # noqa: SIM115 (open while the server runs)
    proc = subprocess.Popen(serve, stdout=subprocess.DEVNULL, stderr=log)
    try:
        _wait_healthy(base, proc)
        start = time.perf_counter()
        ours = lm_eval.simple_evaluate(
            model="local-completions",
            model_args=(
                f"model=smollm,base_url={base}/v1/completions,tokenizer={tok_dir},"
                f"tokenized_requests=True,batch_size={args.batch_size},max_length=1024"
            ),
            tasks=[TASK],
            task_manager=tasks,
            log_samples=True,
        )
        ours_s = time.perf_counter() - start
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        log.close()
    ref, ref_s = _evaluate_transformers(lm_eval, tasks, gguf, tok_dir, args.batch_size)
    summary = _summary(ours, ref, {"pagedjax": ours_s, "transformers": ref_s}, load)
    print(json.dumps(summary, indent=1), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))
    return 0


def _evaluate_transformers(lm_eval, tasks, gguf: Path, tok_dir: Path, batch_size: int):
    """The reference run: transformers on the CPU from the same GGUF. Returns (results, seconds)."""
    start = time.perf_counter()
    ref = lm_eval.simple_evaluate(
        model="hf",
        model_args=(
            f"pretrained={gguf.parent},gguf_file={gguf.name},tokenizer={tok_dir},"
            "dtype=float32,device=cpu"
        ),
        tasks=[TASK],
        task_manager=tasks,
        batch_size=batch_size,
        log_samples=True,
    )
    return ref, time.perf_counter() - start


def _summary(ours, ref, wall_s: dict, load) -> dict:
    a, b = _lls(ours), _lls(ref)
    diffs = [abs(x - y) for x, y in zip(a, b, strict=True)]
    return {
        "task": TASK,
        "num_docs": len(ours["samples"][TASK]),
        "pagedjax": {k: ours["results"][TASK][k] for k in ("acc,none", "acc_norm,none")},
        "transformers": {k: ref["results"][TASK][k] for k in ("acc,none", "acc_norm,none")},
        "max_abs_loglikelihood_diff": max(diffs),
        "mean_abs_loglikelihood_diff": sum(diffs) / len(diffs),
        "same_choice_picked": _agree(ours, ref),
        "wall_s": wall_s,
        "loadavg": load,
    }


def _argmax_per_doc(results) -> list[int]:
    picks = []
    for s in sorted(results["samples"][TASK], key=lambda s: s["doc_id"]):
        lls = [float(r[0][0]) for r in s["resps"]]
        picks.append(max(range(len(lls)), key=lls.__getitem__))
    return picks


def _agree(a, b) -> str:
    pa, pb = _argmax_per_doc(a), _argmax_per_doc(b)
    return f"{sum(x == y for x, y in zip(pa, pb, strict=True))}/{len(pa)}"


if __name__ == "__main__":
    sys.exit(main())
