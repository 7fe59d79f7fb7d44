"""N-gram speculation on the real SmolLM2-135M-Instruct (the embedded GGUF): a prompt asking to
repeat a text gets most proposals accepted, a request for new text few; the greedy outputs are the
same as without speculation either way. (A prompt of random token ids is no "low" case for this
model: it answers noise with loops of its own, which prompt lookup predicts, 70-100% accepted.)"""

from __future__ import annotations

import pytest
from pagedjax.models.loader import default_model_path

from pagedjax import LLM, SamplingParams

pytestmark = pytest.mark.slow

TEXT = (
    "The river bends twice before it reaches the old mill, where the water slows and turns green "
    "under the willows. In summer the children of the village swim there, and in winter the "
    "miller's dog walks across the ice to bark at the ducks on the other side."
)
SPEC = {
    "method": "ngram",
    "num_speculative_tokens": 4,
    "prompt_lookup_min": 2,
    "prompt_lookup_max": 4,
}


def test_copying_is_accepted_and_random_text_is_not():
    kw = dict(max_model_len=256, num_blocks=64, enable_prefix_caching=False)
    plain = LLM(default_model_path(), **kw)
    fast = LLM(default_model_path(), speculative_config=SPEC, **kw)
    tok = plain.tokenizer
    chat = [{"role": "user", "content": f"Repeat the following text exactly:\n\n{TEXT}"}]
    story = [{"role": "user", "content": "Tell me a story about a robot who learns to paint."}]
    params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    rates = {}
    for name, messages in [("copy", chat), ("story", story)]:
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prompt = tok(text)["input_ids"]
        want = plain.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
        out = fast.generate([prompt], params, use_tqdm=False)[0]
        assert out.outputs[0].token_ids == want, name
        rates[name] = out.spec_decoding.acceptance_rate
    assert rates["copy"] > 0.7 and rates["story"] < 0.5, rates
