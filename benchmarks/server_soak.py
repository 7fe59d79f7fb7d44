"""How much longer normal streams take while hostile bodies flood the server (issue 41's soak):
a ``pagedjax serve --engine-process`` on a tiny model (tests/support/server_soak.py), 64 greedy
streams of 24 tokens (8 at a time) timed alone, then in the midst of 200 hostile bodies sent four
at a time from client processes of their own; ``--rounds`` such pairs against one server, after one
untimed mix (which compiles what the mix needs) and the server's background compile.

Prints each round's median and max latency alone and mixed, their ratios, and the ratios over
all rounds pooled (the target: at most 2x). Time it on a quiet machine (look at ``uptime``):
the clients share its cores with the server.

    python benchmarks/server_soak.py [--rounds 3] [--hostile all|refused|served|ordinary|K]
        [--rate R]

``--rate R`` sends the hostile bodies at R a second whatever the answers (an open loop): servers
compare at the same hostile load, where the default closed loop sends a server that answers sooner
more of them while the normal streams run (the count of bodies unanswered at their end says how
many).

``--hostile refused`` sends only the classes the server refuses with a 4xx (what they cost is the
server's isolation of bad input), ``--hostile served`` only the valid ones it answers (long choice
lists, echo with prompt logprobs, clients that leave a stream: work the engine shares with the
normal streams), ``--hostile K`` only class K (its index in ``tests/support/server_soak.py``).
``--hostile ordinary`` is the control: the same clients sending the normal streams' own request,
so that what a class costs the normal streams reads against what ordinary load costs them.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "support")]  # the soak's parts are the test's

import server_soak  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--hostile",
        choices=("all", "refused", "served", "ordinary", *map(str, range(server_soak.CLASSES))),
        default="all",
        help="every hostile class, only those refused with a 4xx, only those served, one class "
        "by its index, or ordinary requests (the normal streams' own, as a control)",
    )
    parser.add_argument(
        "--rate",
        type=float,
        default=None,
        help="send the hostile bodies at this many a second whatever the answers (an open loop); "
        "default: four clients, each sending its next body when the last is answered",
    )
    args = parser.parse_args()
    alone_all, mixed_all = [], []
    with (
        tempfile.TemporaryDirectory() as tmp,
        server_soak.served(Path(tmp)) as (base, _proc, log),
        concurrent.futures.ThreadPoolExecutor(8) as pool,
    ):
        server_soak.run_mixed(base, pool, seed=0)  # every class: compiles what any mix needs
        server_soak.wait_background_compile(base)
        for r in range(args.rounds):
            compiled, logged = server_soak.compilations(base), len(log.read_bytes())
            _, alone = server_soak.run_normal(base, pool)
            _, mixed, statuses, unanswered = server_soak.run_mixed(
                base, pool, r, args.hostile, args.rate
            )
            alone_all += alone
            mixed_all += mixed
            print(
                f"round {r}: alone median {statistics.median(alone):.3f} max {max(alone):.3f} s; "
                f"mixed median {statistics.median(mixed):.3f} max {max(mixed):.3f} s; ratio "
                f"median {statistics.median(mixed) / statistics.median(alone):.2f}x max "
                f"{max(mixed) / max(alone):.2f}x ({unanswered} of {len(statuses)} hostile "
                f"bodies unanswered when the streams ended; "
                f"{sum(s >= 500 for s in statuses)} answered 5xx; "
                f"{server_soak.compilations(base) - compiled:.0f} programs compiled in the round)",
                flush=True,
            )
            for line in log.read_bytes()[logged:].decode(errors="replace").splitlines():
                if "on first use" in line or "background compile" in line:  # what compiled
                    print("   ", line.strip(), flush=True)
    print(
        f"all {args.rounds} rounds: ratio mixed / alone, median "
        f"{statistics.median(mixed_all) / statistics.median(alone_all):.2f}x, 90th percentile "
        f"{_p90(mixed_all) / _p90(alone_all):.2f}x, max {max(mixed_all) / max(alone_all):.2f}x"
    )


def _p90(xs: list[float]) -> float:
    return statistics.quantiles(xs, n=10)[-1]


if __name__ == "__main__":
    main()
