"""Multi-process (multi-host) runs through JAX's own distributed runtime.

Every process runs the same program. It joins the job (``initialize``), loads its slices of the
weights and holds its devices' slice of every KV block; the tensor-parallel mesh spans the
devices of all processes. Process 0, the driver, alone schedules and serves. It broadcasts each
device operation it performs (a step's host arrays, block copies, swaps) over a ``Channel``, and
the other processes, the followers, replay it, so that every process launches the same programs
in the same order, as multi-controller JAX requires.
"""

from __future__ import annotations

import os
import pickle

import jax
import numpy as np
from jax.experimental import multihost_utils

from pagedjax.utils import next_pow2

ENV_VARS = {
    "coordinator_address": "PAGEDJAX_COORDINATOR_ADDRESS",
    "num_processes": "PAGEDJAX_NUM_PROCESSES",
    "process_id": "PAGEDJAX_PROCESS_ID",
}


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
) -> bool:
    """Join a multi-process job; returns whether this run has more than one process.

    Arguments left as None come from ``PAGEDJAX_COORDINATOR_ADDRESS``, ``PAGEDJAX_NUM_PROCESSES``
    and ``PAGEDJAX_PROCESS_ID``. With none of them set this is a single-process run (or one whose
    program already called ``jax.distributed.initialize``) and nothing is done. Call it before
    anything else touches JAX.
    """
    address = coordinator_address or os.environ.get(ENV_VARS["coordinator_address"])
    num = num_processes if num_processes is not None else _env_int("num_processes")
    pid = process_id if process_id is not None else _env_int("process_id")
    if address is None and num is None and pid is None:  # (leaves JAX's backend unstarted)
        return jax.distributed.is_initialized() and jax.process_count() > 1
    if address is None or num is None or pid is None:
        missing = [
            name
            for name, value in (
                ("coordinator_address", address),
                ("num_processes", num),
                ("process_id", pid),
            )
            if value is None
        ]
        raise ValueError(f"a multi-process run needs all three settings; missing {missing}")
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"coordinator_address must be HOST:PORT, got {address!r}")
    if isinstance(num, bool) or not isinstance(num, int) or num < 1:
        raise ValueError(f"num_processes must be an integer >= 1, got {num!r}")
    if isinstance(pid, bool) or not isinstance(pid, int) or not 0 <= pid < num:
        raise ValueError(f"process_id must be in [0, {num}), got {pid!r}")
    if jax.distributed.is_initialized():
        if (jax.process_count(), jax.process_index()) != (num, pid):
            raise ValueError(
                f"JAX's distributed runtime already runs as process {jax.process_index()} of "
                f"{jax.process_count()}, not process_id={pid} of num_processes={num}"
            )
        return num > 1
    jax.distributed.initialize(address, num_processes=num, process_id=pid)
    return num > 1


def _env_int(name: str) -> int | None:
    value = os.environ.get(ENV_VARS[name])
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{ENV_VARS[name]} must be an integer, got {value!r}") from None


# Most messages (a decode step's arrays) fit one broadcast of this many bytes; longer ones
# follow in a second broadcast, padded to a power of two so that few programs compile.
_FIRST_CHUNK = 1 << 14
_HEADER = 4  # the message's length, little-endian


class Channel:
    """The driver's messages, broadcast to every process (device collectives, in order)."""

    def __init__(self):
        self.is_driver = jax.process_index() == 0

    def send(self, message) -> None:
        """Driver: broadcast ``message`` (any picklable value)."""
        if not self.is_driver:
            raise RuntimeError(f"process {jax.process_index()} follows; only process 0 sends")
        self._broadcast(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))

    def recv(self):
        """Follower: wait for the driver's next message."""
        if self.is_driver:
            raise RuntimeError("process 0 drives; it has nobody to receive from")
        return pickle.loads(self._broadcast(b""))

    def _broadcast(self, data: bytes) -> bytes:
        first = np.zeros(_FIRST_CHUNK, np.uint8)
        first[:_HEADER] = np.frombuffer(len(data).to_bytes(_HEADER, "little"), np.uint8)
        head = data[: _FIRST_CHUNK - _HEADER]
        first[_HEADER : _HEADER + len(head)] = np.frombuffer(head, np.uint8)
        first = np.asarray(multihost_utils.broadcast_one_to_all(first))
        size = int.from_bytes(first[:_HEADER].tobytes(), "little")
        out = first[_HEADER : _HEADER + size].tobytes()
        rest = size - len(out)
        if rest > 0:
            tail = np.zeros(next_pow2(rest), np.uint8)
            tail[: len(data) - len(head)] = np.frombuffer(data[len(head) :], np.uint8)
            out += np.asarray(multihost_utils.broadcast_one_to_all(tail))[:rest].tobytes()
        return out


class DriverOrFollower:
    """The engine's multi-process side, held by the engine: the driver broadcasts, a follower
    replays ``runner``'s steps until told to stop. In a single-process run (no channel) this
    process is the driver and every broadcast is a no-op."""

    def __init__(self, runner):
        self.runner = runner
        self.stopped = False  # the driver has told the followers to stop (or heard it)

    @property
    def is_driver(self) -> bool:
        """Whether this process schedules (always, in a single-process run)."""
        return self.runner.channel is None or self.runner.channel.is_driver

    def require_driver(self, what: str) -> None:
        if not self.is_driver:
            raise RuntimeError(
                f"{what}: process {jax.process_index()} follows process 0, which alone takes "
                "requests and steps; call follow() here"
            )

    def broadcast(self, op: str, payload=None) -> None:
        """Driver: send a message that followers' ``follow`` returns (no-op in one process, or
        once the engine is closed: the followers have gone)."""
        if self.runner.channel is not None and not self.stopped:
            self.runner.channel.send((op, payload))

    def keep_alive(self) -> None:
        """Driver, while idle: a "noop", so that followers waiting in the broadcast hear from
        it regularly (a collective backend may time out a wait of hours)."""
        self.broadcast("noop")

    def follow(self, until: frozenset[str] = frozenset({"stop"})) -> tuple[str, object]:
        """Follower: replay the driver's steps until one of the messages ``until`` (or "stop",
        sent by the driver's ``close``); returns it as ``(op, payload)``."""
        if self.is_driver:
            raise RuntimeError("follow() is for processes other than 0; process 0 drives")
        if self.stopped:
            raise RuntimeError("the engine is closed")
        while True:
            op, payload = self.runner.follow()
            if op == "stop":
                self.stopped = True
            if op in until or op == "stop":
                return op, payload

    def close(self) -> None:
        """Free the device KV pool and parameters; the engine is unusable afterwards. In a
        multi-process run every process calls it; the driver's tells the followers to stop."""
        if self.runner.channel is not None and not self.stopped:
            if self.is_driver:
                self.broadcast("stop")
                self.stopped = True
            else:
                self.follow()  # until the driver's "stop"
        self.runner.free_device_memory()
