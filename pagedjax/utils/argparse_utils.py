"""FlexibleArgumentParser: vLLM's argument parser, where vLLM's examples import it
(``from pagedjax.utils import FlexibleArgumentParser``, or ``pagedjax.utils.argparse_utils``).

On top of argparse it takes long options spelled with underscores (``--max_model_len 512`` is
``--max-model-len 512``) and ``--config FILE``: a YAML mapping of option names to values, read
as if they were on the command line before the other arguments (so the command line wins).
Help is printed as written, wrapped, with each option's default.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions kept as written (paragraphs), options' help wrapped."""


class FlexibleArgumentParser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def parse_known_args(self, args=None, namespace=None):
        args = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args(_normalized(args), namespace)


def _normalized(args: list[str]) -> list[str]:
    """``--config FILE`` expanded in place of itself, then underscores in long option names
    made dashes (a value, or what follows ``--``, is left alone)."""
    out: list[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "--":
            out += args[i:]
            break
        if arg == "--config" or arg.startswith("--config="):
            if "=" in arg:
                path = arg.split("=", 1)[1]
            elif i + 1 < len(args):
                path, i = args[i + 1], i + 1
            else:
                raise SystemExit("--config needs a YAML file")
            out = _config_file_args(path) + out
        elif arg.startswith("--"):
            name, eq, value = arg.partition("=")
            out.append(name.replace("_", "-") + eq + value)
        else:
            out.append(arg)
        i += 1
    return out


def _config_file_args(path: str) -> list[str]:
    """A YAML mapping's options as command-line arguments: ``key: value`` is ``--key value``,
    ``key: true`` is ``--key``, ``key: false`` is ``--no-key``, a list gives its items."""
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as e:
        raise SystemExit(f"--config {path}: {e}") from None
    if not isinstance(data, dict):
        raise SystemExit(f"--config {path}: must be a mapping of option names to values")
    out: list[str] = []
    for key, value in data.items():
        flag = "--" + str(key).replace("_", "-")
        if value is True:
            out.append(flag)
        elif value is False:
            out.append("--no-" + flag[2:])
        elif isinstance(value, list):
            out += [flag, *map(str, value)]
        elif isinstance(value, dict):
            import json

            out += [flag, json.dumps(value)]
        else:
            out += [flag, str(value)]
    return out
