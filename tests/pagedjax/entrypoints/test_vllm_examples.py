"""vLLM's offline examples (examples/offline_inference/ in vLLM's repository), each rewritten only
in its import (``vllm`` -> ``pagedjax``) and its model (the embedded SmolLM2-135M-Instruct GGUF;
for multi-LoRA a tiny local model with a PEFT adapter), with small limits (max_model_len,
num_blocks, max_tokens) so that they run fast on a CPU. Where an example's code goes on from
what the model wrote, the test says what it does for a model that does not write that."""

from __future__ import annotations

import argparse
import gc
import json
import random
import string

import pytest

SMALL = ["--max-model-len", "512", "--num-blocks", "96", "--max-num-seqs", "8"]
SMALL_KW = dict(max_model_len=512, num_blocks=96, max_num_seqs=8)
PROMPTS = [
    "Hello, my name is",
    "The president of the United States is",
    "The capital of France is",
    "The future of AI is",
]


@pytest.fixture(scope="module")
def smol() -> str:
    from pagedjax.models.loader import default_model_path

    return default_model_path()


@pytest.fixture(autouse=True)
def _free_engines():
    yield
    gc.collect()  # each example's engine (its weights, its pool) goes before the next loads


# ---- basic/generate.py: EngineArgs' flags on a parser of the script's own ------------------


def test_basic_generate(smol, capsys):
    from pagedjax import LLM, EngineArgs
    from pagedjax.utils import FlexibleArgumentParser

    def main(args: dict):
        # Pop arguments not used by LLM
        max_tokens = args.pop("max_tokens")
        temperature = args.pop("temperature")
        top_p = args.pop("top_p")
        top_k = args.pop("top_k")

        # Create an LLM
        llm = LLM(**args)

        # Create a sampling params object
        sampling_params = llm.get_default_sampling_params()
        if max_tokens is not None:
            sampling_params.max_tokens = max_tokens
        if temperature is not None:
            sampling_params.temperature = temperature
        if top_p is not None:
            sampling_params.top_p = top_p
        if top_k is not None:
            sampling_params.top_k = top_k

        outputs = llm.generate(PROMPTS, sampling_params)
        for output in outputs:
            prompt = output.prompt
            generated_text = output.outputs[0].text
            print(f"Prompt: {prompt!r}, Generated text: {generated_text!r}")

    parser = FlexibleArgumentParser()
    engine_group = parser.add_argument_group("Engine arguments")
    EngineArgs.add_cli_args(engine_group)
    engine_group.set_defaults(model=smol)
    sampling_group = parser.add_argument_group("Sampling parameters")
    sampling_group.add_argument("--max-tokens", type=int)
    sampling_group.add_argument("--temperature", type=float)
    sampling_group.add_argument("--top-p", type=float)
    sampling_group.add_argument("--top-k", type=int)
    args: dict = vars(parser.parse_args(["--max-tokens", "8", "--temperature", "0", *SMALL]))
    main(args)
    out = capsys.readouterr().out
    assert [line.split(",")[0] for line in out.splitlines() if line.startswith("Prompt: ")] == [
        f"Prompt: {p!r}".split(",")[0] for p in PROMPTS
    ]
    assert "The capital of France is', Generated text: ' Paris" in out


# ---- basic/chat.py (with its utils.py's sampling flags) ------------------------------------


def test_basic_chat(smol, tmp_path, capsys):
    from pagedjax import LLM, EngineArgs, SamplingParams
    from pagedjax.utils import FlexibleArgumentParser

    def add_sampling_params_args(parser):  # the example's utils.py
        sampling_params = SamplingParams()
        parser.add_argument("--max-tokens", type=int, default=sampling_params.max_tokens)
        parser.add_argument("--temperature", type=float, default=sampling_params.temperature)
        parser.add_argument("--top-p", type=float, default=sampling_params.top_p)
        parser.add_argument("--top-k", type=int, default=sampling_params.top_k)
        return parser

    def del_sampling_params_args(args):
        del args.max_tokens
        del args.temperature
        del args.top_p
        del args.top_k
        return args

    def main(args: argparse.Namespace):
        chat_template_path = args.chat_template_path
        del args.chat_template_path
        sampling_params = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
        )
        args = del_sampling_params_args(args)
        llm = LLM(**vars(args))

        def print_outputs(outputs):
            for output in outputs:
                prompt = output.prompt
                generated_text = output.outputs[0].text
                print(f"Prompt: {prompt!r}")
                print(f"Generated text: {generated_text!r}")
            print("-" * 80)

        conversation = [
            {"role": "system", "content": "You are a helpful assistant"},
            {"role": "user", "content": "Hello"},
            {"role": "assistant", "content": "Hello! How can I assist you today?"},
            {
                "role": "user",
                "content": "Write an essay about the importance of higher education.",
            },
        ]
        outputs = llm.chat(conversation, sampling_params, use_tqdm=False)
        print_outputs(outputs)
        conversations = [conversation for _ in range(10)]
        outputs = llm.chat(conversations, sampling_params, use_tqdm=True)
        print_outputs(outputs)
        if chat_template_path:
            with open(chat_template_path) as f:
                chat_template = f.read()
            outputs = llm.chat(
                conversations, sampling_params, use_tqdm=False, chat_template=chat_template
            )
            print_outputs(outputs)

    parser = FlexibleArgumentParser()
    parser = EngineArgs.add_cli_args(parser)
    parser = add_sampling_params_args(parser)
    parser.set_defaults(model=smol)
    parser.add_argument("--chat-template-path", type=str, default=None)
    template = tmp_path / "template.jinja"
    template.write_text("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}")
    argv = ["--max-tokens", "4", "--chat-template-path", str(template), *SMALL]
    main(parser.parse_args(argv))
    out = capsys.readouterr().out
    assert out.count("Generated text: ") == 21
    assert "Prompt: '<|im_start|>system\\nYou are a helpful assistant<|im_end|>" in out
    assert "Prompt: 'system: You are a helpful assistant\\nuser: Hello\\n" in out


# ---- chat_with_tools.py --------------------------------------------------------------------


def test_chat_with_tools(smol, capsys):
    """The example's LLM keywords (Mistral's tokenizer, config and load formats) are accepted
    for another model; SmolLM2-135M's chat template does not show tools and the model answers
    in text, so where the example parses its tool call the test takes the call a tool-calling
    model writes for this question, and goes on as the example does."""
    from pagedjax import LLM
    from pagedjax.sampling_params import SamplingParams

    sampling_params = SamplingParams(max_tokens=8192, temperature=0.0)
    llm = LLM(
        model=smol,
        tokenizer_mode="mistral",
        config_format="mistral",
        load_format="mistral",
        **SMALL_KW,
    )

    def generate_random_id(length=9):
        characters = string.ascii_letters + string.digits
        return "".join(random.choice(characters) for _ in range(length))

    def get_current_weather(city: str, state: str, unit: str):
        return (
            f"The weather in {city}, {state} is 85 degrees {unit}. It is "
            "partly cloudly, with highs in the 90's."
        )

    tool_functions = {"get_current_weather": get_current_weather}
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_current_weather",
                "description": "Get the current weather in a given location",
                "parameters": {
                    "type": "object",
                    "properties": {
                        "city": {"type": "string", "description": "The city, e.g. 'Dallas'"},
                        "state": {"type": "string", "description": "e.g. 'TX'"},
                        "unit": {
                            "type": "string",
                            "description": "The unit to fetch the temperature in",
                            "enum": ["celsius", "fahrenheit"],
                        },
                    },
                    "required": ["city", "state", "unit"],
                },
            },
        }
    ]
    messages = [
        {
            "role": "user",
            "content": "Can you tell me what the temperate will be in Dallas, in fahrenheit?",
        }
    ]
    outputs = llm.chat(messages, sampling_params=sampling_params, tools=tools)
    output = outputs[0].outputs[0].text.strip()
    output = output.removeprefix("[TOOL_CALLS]")
    assert output and outputs[0].outputs[0].finish_reason == "stop"
    messages.append({"role": "assistant", "content": output})
    try:
        tool_calls = json.loads(output)
    except json.JSONDecodeError:  # SmolLM2-135M answers in text (see the docstring)
        tool_calls = [
            {
                "name": "get_current_weather",
                "arguments": {"city": "Dallas", "state": "TX", "unit": "fahrenheit"},
            }
        ]
    tool_answers = [tool_functions[call["name"]](**call["arguments"]) for call in tool_calls]
    messages.append(
        {"role": "tool", "content": "\n\n".join(tool_answers), "tool_call_id": generate_random_id()}
    )
    outputs = llm.chat(messages, sampling_params, tools=tools)
    print(outputs[0].outputs[0].text.strip())
    assert capsys.readouterr().out.strip()
    assert "The weather in Dallas, TX is 85 degrees fahrenheit" in outputs[0].prompt


# ---- llm_engine_example.py: LLMEngine.from_engine_args(EngineArgs.from_cli_args(...)) -----


def test_llm_engine_example(smol, capsys):
    from pagedjax import EngineArgs, LLMEngine, RequestOutput, SamplingParams
    from pagedjax.utils import FlexibleArgumentParser

    def create_test_prompts() -> list[tuple[str, SamplingParams]]:
        return [
            (
                "A robot may not injure a human being",
                SamplingParams(temperature=0.0, logprobs=1, prompt_logprobs=1),
            ),
            ("To be or not to be,", SamplingParams(temperature=0.8, top_k=5, presence_penalty=0.2)),
            (
                "What is the meaning of life?",
                SamplingParams(n=2, best_of=5, temperature=0.8, top_p=0.95, frequency_penalty=0.1),
            ),
        ]

    def process_requests(engine: LLMEngine, test_prompts: list[tuple[str, SamplingParams]]):
        request_id = 0
        while test_prompts or engine.has_unfinished_requests():
            if test_prompts:
                prompt, sampling_params = test_prompts.pop(0)
                engine.add_request(str(request_id), prompt, sampling_params)
                request_id += 1
            request_outputs: list[RequestOutput] = engine.step()
            for request_output in request_outputs:
                if request_output.finished:
                    print(request_output)

    def initialize_engine(args: argparse.Namespace) -> LLMEngine:
        engine_args = EngineArgs.from_cli_args(args)
        return LLMEngine.from_engine_args(engine_args)

    parser = FlexibleArgumentParser(description="Demo on using the LLMEngine class directly")
    parser = EngineArgs.add_cli_args(parser)
    args = parser.parse_args(["--model", smol, *SMALL])
    engine = initialize_engine(args)
    process_requests(engine, create_test_prompts())
    out = capsys.readouterr().out
    assert out.count("RequestOutput(request_id=") == 3
    assert "decoded_token=" in out and "prompt_logprobs=[None, {" in out
    assert out.count("CompletionOutput(index=") == 1 + 1 + 2  # best_of=5 returns n=2


# ---- multilora_inference.py: a tiny model and its PEFT adapter for Llama-2 and its LoRA ----


def test_multilora_inference(tmp_path, capsys):
    from hf_models import make_tiny_model, save_word_tokenizer
    from peft_adapters import save_random_adapter

    from pagedjax import EngineArgs, LLMEngine, RequestOutput, SamplingParams
    from pagedjax.lora.request import LoRARequest

    model_dir, lora_path = tmp_path / "base", tmp_path / "sql-lora"
    hf = make_tiny_model("llama_gqa", model_dir, vocab_size=32064)  # the example's token 32003
    save_word_tokenizer(model_dir)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj"]
    save_random_adapter(hf, lora_path, seed=1, r=8, lora_alpha=16, target_modules=targets)
    lora_path = str(lora_path)

    def create_test_prompts(lora_path: str):
        sql = (
            "[user] Write a SQL query to answer the question based on the table schema.\n\n "
            "context: CREATE TABLE table_name_74 (icao VARCHAR, airport VARCHAR)\n\n question: "
            "Name the ICAO for lilongwe international airport [/user] [assistant]"
        )
        return [
            (
                "A robot may not injure a human being",
                SamplingParams(temperature=0.0, logprobs=1, prompt_logprobs=1, max_tokens=128),
                None,
            ),
            (
                "To be or not to be,",
                SamplingParams(temperature=0.8, top_k=5, presence_penalty=0.2, max_tokens=128),
                None,
            ),
            (
                sql,
                SamplingParams(
                    temperature=0.0,
                    logprobs=1,
                    prompt_logprobs=1,
                    max_tokens=128,
                    stop_token_ids=[32003],
                ),
                LoRARequest("sql-lora", 1, lora_path),
            ),
            (
                sql,
                SamplingParams(
                    temperature=0.0,
                    logprobs=1,
                    prompt_logprobs=1,
                    max_tokens=128,
                    stop_token_ids=[32003],
                ),
                LoRARequest("sql-lora2", 2, lora_path),
            ),
        ]

    def process_requests(engine: LLMEngine, test_prompts):
        request_id = 0
        print("-" * 50)
        while test_prompts or engine.has_unfinished_requests():
            if test_prompts:
                prompt, sampling_params, lora_request = test_prompts.pop(0)
                engine.add_request(
                    str(request_id), prompt, sampling_params, lora_request=lora_request
                )
                request_id += 1
            request_outputs: list[RequestOutput] = engine.step()
            for request_output in request_outputs:
                if request_output.finished:
                    print(request_output)
                    print("-" * 50)
                    finished[request_output.request_id] = request_output

    def initialize_engine() -> LLMEngine:
        engine_args = EngineArgs(
            model=str(model_dir),
            enable_lora=True,
            max_loras=1,
            max_lora_rank=8,
            max_cpu_loras=2,
            max_num_seqs=256,
            num_blocks=256,
        )
        return LLMEngine.from_engine_args(engine_args)

    finished: dict[str, RequestOutput] = {}
    engine = initialize_engine()
    process_requests(engine, create_test_prompts(lora_path))
    assert sorted(finished) == ["0", "1", "2", "3"]
    sql_one, sql_two = finished["2"].outputs[0], finished["3"].outputs[0]
    assert sql_one.token_ids == sql_two.token_ids  # the same adapter under two names
    assert capsys.readouterr().out.count("RequestOutput(request_id=") == 4


# ---- beam search with dict prompts, logprobs, metrics -------------------------------------


def test_beam_search_with_dict_prompts(smol, capsys):
    from pagedjax import LLM
    from pagedjax.sampling_params import BeamSearchParams

    llm = LLM(model=smol, **SMALL_KW)
    params = BeamSearchParams(beam_width=2, max_tokens=8)
    outputs = llm.beam_search([{"prompt": p} for p in PROMPTS[2:]], params)
    for output in outputs:
        for sequence in output.sequences:
            print(f"{sequence.text!r} (cumulative logprob {sequence.cum_logprob:.3f})")
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 4 and lines[0].startswith("'The capital of France is Paris")


def test_logprobs(smol, capsys):
    """vLLM's documented use: generated and prompt logprobs as token id -> Logprob(logprob,
    rank, decoded_token)."""
    from pagedjax import LLM, SamplingParams

    llm = LLM(model=smol, **SMALL_KW)
    params = SamplingParams(temperature=0, max_tokens=4, logprobs=3, prompt_logprobs=2)
    (output,) = llm.generate(["The capital of France is"], params)
    for position in output.outputs[0].logprobs:
        for token_id, logprob in position.items():
            print(token_id, repr(logprob.decoded_token), round(logprob.logprob, 3), logprob.rank)
    first = output.outputs[0].logprobs[0]
    best = min(first.values(), key=lambda lp: lp.rank)
    assert best.rank == 1 and best.decoded_token == " Paris"
    assert output.prompt_logprobs[0] is None and len(output.prompt_logprobs) == len(
        output.prompt_token_ids
    )
    assert "' Paris'" in capsys.readouterr().out


def test_metrics(smol, capsys):
    from pagedjax import LLM, SamplingParams
    from pagedjax.metrics.reader import Counter, Gauge, Histogram, Vector

    sampling_params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=8)
    llm = LLM(model=smol, disable_log_stats=False, **SMALL_KW)
    outputs = llm.generate(PROMPTS, sampling_params)
    print("-" * 50)
    for output in outputs:
        prompt = output.prompt
        generated_text = output.outputs[0].text
        print(f"Prompt: {prompt!r}\nGenerated text: {generated_text!r}")
        print("-" * 50)
    for metric in llm.get_metrics():
        if isinstance(metric, Gauge):
            print(f"{metric.name} (gauge) = {metric.value}")
        elif isinstance(metric, Counter):
            print(f"{metric.name} (counter) = {metric.value}")
        elif isinstance(metric, Vector):
            print(f"{metric.name} (vector) = {metric.values}")
        elif isinstance(metric, Histogram):
            print(f"{metric.name} (histogram)")
            print(f"    sum = {metric.sum}")
            print(f"    count = {metric.count}")
            for bucket_le, value in metric.buckets.items():
                print(f"    {bucket_le} = {value}")
    out = capsys.readouterr().out
    assert "vllm:num_requests_running (gauge) = 0" in out
    assert "vllm:request_success (counter) = 4" in out or "(counter) = 4" in out
    assert "vllm:e2e_request_latency_seconds (histogram)\n    sum = " in out
    assert "    count = 4\n" in out
