"""What a multi-process run pays per step to keep its followers in step: the time to broadcast one
step's message (pickled host arrays) from process 0 to process 1 over ``pagedjax.distributed``'s
``Channel``, for message sizes of a small decode step, a 256-sequence decode step and a
2048-token prefill step. Launches two processes on loopback itself (JAX's distributed runtime,
CPU collectives); on a real job the collective runs over the hosts' network.

    python benchmarks/multihost_channel.py
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# name -> int32 elements: token ids, positions, slots, block table rows, ...
MESSAGES = {
    "decode, 8 sequences": 8 * 3 + 8 * 16 + 64,
    "decode, 256 sequences x 128 blocks": 256 * 3 + 256 * 128 + 1024,
    "prefill, 2048 tokens, 64 sequences x 128 blocks": 2048 * 3 + 64 * 128 + 256,
}
REPEATS = 50


def measure(process_id: int, port: int) -> None:
    sys.path.insert(0, str(ROOT))
    import numpy as np

    from pagedjax import distributed

    distributed.initialize(f"127.0.0.1:{port}", 2, process_id)
    channel = distributed.Channel()
    for name, size in MESSAGES.items():
        message = ("run_step", (np.zeros(size, np.int32),))
        for _ in range(3):  # the first broadcasts of a size compile
            channel.send(message) if channel.is_driver else channel.recv()
        start = time.perf_counter()
        for _ in range(REPEATS):
            channel.send(message) if channel.is_driver else channel.recv()
        ms = 1e3 * (time.perf_counter() - start) / REPEATS
        if channel.is_driver:
            print(f"{name:<50} {4 * size:>8} bytes  {ms:6.2f} ms per step", flush=True)


def main() -> None:
    if len(sys.argv) == 3:
        measure(int(sys.argv[1]), int(sys.argv[2]))
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    procs = [
        subprocess.Popen([sys.executable, __file__, str(pid), str(port)], env=env) for pid in (0, 1)
    ]
    sys.exit(max(p.wait() for p in procs))


if __name__ == "__main__":
    main()
