"""LoadedModel: what loading a model gives (models/loader.py's ``load_model``), and what the
tokenizer is found from (loading/tokenizer.py)."""

from __future__ import annotations

import dataclasses

from ..config import ModelConfig


@dataclasses.dataclass
class LoadedModel:
    config: ModelConfig
    params: dict  # nested dict of jax arrays, the tree of models.decoder.DecoderModel
    source: str  # what was loaded: a directory or a .gguf file
    tokenizer_dir: str | None  # where AutoTokenizer finds the tokenizer (None: no tokenizer)
    gguf_file: str | None = None  # the GGUF file name inside tokenizer_dir, for gguf_file=
    # The linear kernels' quantization (models/quant.py): the one asked for, or a Q8_0 GGUF's
    # own layout ("int8-g32") when the file's int8 kernels are kept; None: compute dtype.
    quantization: str | None = None
