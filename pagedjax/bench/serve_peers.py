"""Servers that ``pagedjax bench serve --compare`` starts on this machine, one at a time: how to
start each (pagedjax, transformers, vLLM, SGLang, or any command given with --peer), waiting
for /health, stopping; and the EOS-free copy of a model that gives exact output lengths on a
server that refuses ``ignore_eos``."""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

KNOWN_PEERS = ("transformers", "vllm", "sglang")
EOS_COPY_MARKER = "pagedjax_eos_free.json"
LOG_TAIL_LINES = 25


@dataclasses.dataclass(frozen=True)
class ServerSettings:
    """What every started server gets the same."""

    model: str  # a path (directory or .gguf) or hub id
    host: str = "127.0.0.1"
    dtype: str = "float32"
    seed: int = 0
    max_model_len: int | None = None


@dataclasses.dataclass(frozen=True)
class ServerSpec:
    name: str
    argv: tuple[str, ...]  # may hold {host}, {port}, {model}
    request_model: str  # the "model" field of requests to it
    health_path: str = "/health"


def _gguf_as_transformers_name(model: str) -> str:
    """transformers serve names a GGUF ``<dir>:<file>.gguf``."""
    p = Path(model)
    return f"{p.parent}:{p.name}" if p.suffix == ".gguf" else model


def _find_exe(name: str) -> str | None:
    """The executable beside this Python (the same environment) first, then on PATH."""
    beside = Path(sys.executable).with_name(name)
    return str(beside) if beside.exists() else shutil.which(name)


def _python_beside(exe: str) -> str:
    py = Path(exe).with_name("python")
    return str(py) if py.exists() else sys.executable


def known_spec(name: str, s: ServerSettings, extra: list[str]) -> ServerSpec:
    """The command line of a known server with these settings; ValueError if not installed."""
    mml = [] if s.max_model_len is None else [str(s.max_model_len)]
    if name == "pagedjax":
        argv = [sys.executable, "-m", "pagedjax", "serve", "--model", s.model]
        argv += ["--host", "{host}", "--port", "{port}", "--dtype", s.dtype, "--seed", str(s.seed)]
        argv += ["--max-model-len", *mml] if mml else []
        return ServerSpec(name, (*argv, *extra), s.model)
    if name not in KNOWN_PEERS:
        raise ValueError(f"--compare: unknown server {name!r}; known: {', '.join(KNOWN_PEERS)}")
    exe = _find_exe(name)
    if exe is None:
        raise ValueError(f"--compare {name}: no {name!r} executable on PATH or beside this Python")
    if name == "transformers":
        model = _gguf_as_transformers_name(s.model)
        argv = [exe, "serve", "--continuous-batching", "--host", "{host}", "--port", "{port}"]
        argv += ["--dtype", s.dtype, "--default-seed", str(s.seed), *extra, model]
        return ServerSpec(name, tuple(argv), model)
    if name == "vllm":
        argv = [exe, "serve", s.model, "--host", "{host}", "--port", "{port}", "--dtype", s.dtype]
        argv += ["--seed", str(s.seed)] + (["--max-model-len", *mml] if mml else [])
        return ServerSpec(name, (*argv, *extra), s.model)
    argv = [_python_beside(exe), "-m", "sglang.launch_server", "--model-path", s.model]
    argv += ["--host", "{host}", "--port", "{port}", "--dtype", s.dtype]
    argv += ["--random-seed", str(s.seed)] + (["--context-length", *mml] if mml else [])
    return ServerSpec(name, (*argv, *extra), s.model)


def custom_spec(text: str, s: ServerSettings) -> ServerSpec:
    """``NAME=COMMAND`` with {host}, {port} and {model} placeholders (--peer)."""
    name, sep, command = text.partition("=")
    if not sep or not name or not command.strip():
        raise ValueError(f"--peer takes NAME=COMMAND, got {text!r}")
    if "{port}" not in command:
        raise ValueError(f"--peer {name}: the command must place {{port}}")
    argv = [a.replace("{model}", s.model) for a in shlex.split(command)]
    return ServerSpec(name, tuple(argv), s.model)


def parse_server_args(items: list[str] | None) -> dict[str, list[str]]:
    """``NAME=ARGS`` (repeatable) -> extra command-line arguments per server."""
    out: dict[str, list[str]] = {}
    for text in items or ():
        name, sep, rest = text.partition("=")
        if not sep or not name:
            raise ValueError(f"--server-args takes NAME=ARGS, got {text!r}")
        out.setdefault(name, []).extend(shlex.split(rest))
    return out


def free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class StartError(RuntimeError):
    """A server exited or stayed unhealthy; the message ends with its log's last lines."""


class RunningServer:
    """A started server process (its own process group), stopped on exit of the ``with``."""

    def __init__(self, spec: ServerSpec, s: ServerSettings, log_dir: Path):
        self.spec, self.host = spec, s.host
        self.port = free_port(s.host)
        self.argv = [
            a.replace("{host}", s.host).replace("{port}", str(self.port)) for a in spec.argv
        ]
        self.log_path = log_dir / f"{spec.name}.log"
        self.proc: subprocess.Popen | None = None

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def __enter__(self) -> RunningServer:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            log.write(f"$ {shlex.join(self.argv)}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(
                self.argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def log_tail(self) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-LOG_TAIL_LINES:])

    def wait_ready(self, timeout_s: float) -> float:
        """Seconds until GET health answered 200; StartError if it exits or time runs out."""
        start = time.monotonic()
        url = self.base_url + self.spec.health_path
        while True:
            code = self.proc.poll()
            if code is not None:
                raise StartError(
                    f"{self.spec.name} exited with code {code} before it was ready "
                    f"(log {self.log_path}):\n{self.log_tail()}"
                )
            try:
                with urllib.request.urlopen(url, timeout=5) as resp:
                    if resp.status == 200:
                        return time.monotonic() - start
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() - start > timeout_s:
                raise StartError(
                    f"{self.spec.name} was not healthy at {url} after {timeout_s:.0f} s "
                    f"(log {self.log_path}):\n{self.log_tail()}"
                )
            time.sleep(0.5)

    def stop(self, grace_s: float = 30.0) -> None:
        """SIGTERM to the server's process group, SIGKILL after ``grace_s``."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                proc.wait(timeout=wait)
                return
            except subprocess.TimeoutExpired:
                continue


# ---- exact lengths without ignore_eos ---------------------------------------------------------


def _drop_eos(path: Path) -> None:
    """Rewrite a JSON config with eos_token_id null (a new file: never through a hard link)."""
    if not path.exists():
        return
    data = json.loads(path.read_text())
    data["eos_token_id"] = None
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)


def _copy_hf_dir(src: Path, dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if not f.is_file():
            continue
        target = dest / f.name
        if f.name in ("config.json", "generation_config.json"):
            shutil.copyfile(f, target)  # rewritten below: a copy, not a link
            continue
        try:
            os.link(f, target)
        except OSError:
            shutil.copy2(f, target)
    for name in ("config.json", "generation_config.json"):
        _drop_eos(dest / name)


def _copy_gguf(src: Path, dest: Path) -> None:
    """The GGUF's weights dequantized by transformers (which needs torch) and saved as an HF
    directory: transformers serve cannot start from this GGUF itself (its config has no
    ``architectures``), and a GGUF's config cannot be edited in place."""
    import torch
    from transformers import AutoModelForCausalLM

    from pagedjax.models.loader import gguf_tokenizer

    model = AutoModelForCausalLM.from_pretrained(
        str(src.parent), gguf_file=src.name, dtype=torch.float32
    )
    model.hf_quantizer = None  # dequantized on load; saving refuses a "quantized" model
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.eos_token_id = None
    model.generation_config.eos_token_id = None
    model.save_pretrained(dest)
    gguf_tokenizer(str(src)).save_pretrained(dest)
    for name in ("config.json", "generation_config.json"):
        _drop_eos(dest / name)


def write_eos_free_copy(source: str, dest: str) -> tuple[str, bool]:
    """A copy of ``source`` (HF directory, hub id or .gguf) whose config and generation config
    name no EOS token, so that a server generates exactly max_tokens; (its path, whether it was
    written now rather than reused)."""
    out = Path(dest).expanduser().resolve()
    marker = out / EOS_COPY_MARKER
    src_path = Path(source).expanduser()
    src = str(src_path.resolve()) if src_path.exists() else source
    if marker.exists():
        made_from = json.loads(marker.read_text()).get("source")
        if made_from != src:
            raise ValueError(f"--disable-eos-copy {out} is a copy of {made_from}, not of {src}")
        return str(out), False
    if out.exists() and any(out.iterdir()):
        raise ValueError(
            f"--disable-eos-copy {out} exists and is not a copy this command wrote; "
            "give an empty or new directory"
        )
    if src.endswith(".gguf"):
        _copy_gguf(Path(src), out)
    else:
        from pagedjax.models.loader import resolve

        _copy_hf_dir(resolve(src), out)
    marker.write_text(json.dumps({"source": src, "eos_token_id": None}) + "\n")
    return str(out), True
