"""A model to serve where none can be downloaded (the device check's serving stage): random Llama
weights of any shape, saved as a Hugging Face directory that ``pagedjax serve`` and
``transformers serve`` both load, with a word-level tokenizer of the model's vocabulary (token i
is the word ``w{i}``: every id detokenizes and every prompt tokenizes back to the same ids) and
no EOS token in its configs (outputs run to max_tokens on either server, with or without
``ignore_eos``). Needs torch and transformers (imported when called)."""

from __future__ import annotations

from pathlib import Path

SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")  # ids 0, 1, 2


def save_word_tokenizer(
    directory: str | Path, vocab_size: int, chat_template: str | None = None
) -> None:
    """Token i <-> word ``w{i}`` (0, 1, 2: <unk>, <s>, </s>), words split on spaces; a
    ``chat_template`` (jinja) is saved with it if given."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    if vocab_size <= len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size must be > {len(SPECIAL_TOKENS)}, got {vocab_size}")
    vocab = {t: i for i, t in enumerate(SPECIAL_TOKENS)}
    vocab.update({f"w{i}": i for i in range(len(SPECIAL_TOKENS), vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    if chat_template is not None:
        fast.chat_template = chat_template
    fast.save_pretrained(str(directory))


def random_llama(hf_config, *, dtype: str = "bfloat16", device: str = "cpu"):
    """``transformers.LlamaForCausalLM(hf_config)`` in eval mode, its random weights created on
    ``device`` in ``dtype`` (torch's default dtype restored after), no EOS in its generation
    config (outputs run to their token limit)."""
    import torch
    import transformers

    old = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, dtype))
    try:
        with torch.device(device):
            model = transformers.LlamaForCausalLM(hf_config).eval()
    finally:
        torch.set_default_dtype(old)
    model.generation_config.eos_token_id = None
    return model


def save_random_llama(
    directory: str | Path, config: dict, *, dtype: str = "bfloat16", device: str = "cpu", seed=0
) -> Path:
    """Random weights of ``transformers.LlamaConfig(**config)`` (built on ``device``, in
    ``dtype``) saved under ``directory`` with the word tokenizer; EOS removed from the config and
    the generation config. Returns the directory."""
    import torch
    import transformers

    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"dtype must be 'float32' or 'bfloat16', got {dtype!r}")
    out = Path(directory)
    hf = transformers.LlamaConfig(**{**config, "eos_token_id": None})
    torch.manual_seed(seed)
    model = random_llama(hf, dtype=dtype, device=device)
    model.save_pretrained(str(out))
    del model
    save_word_tokenizer(out, hf.vocab_size)
    return out
