"""DeepSeek-V3's chat template and a checkpoint directory carrying it with the tool-call
tokens: shared by the unit and dataplane tiers' tool-calling tests."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from pdd_sidecar.serve.openai.tool_parser import CALL_BEGIN, CALL_END, CALLS_BEGIN, CALLS_END, SEP

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
SPECIALS = [BOS, EOS, "<｜User｜>", "<｜Assistant｜>", CALLS_BEGIN, CALL_BEGIN, SEP, CALL_END,
            CALLS_END, "<｜tool▁outputs▁begin｜>", "<｜tool▁output▁begin｜>",
            "<｜tool▁output▁end｜>", "<｜tool▁outputs▁end｜>"]

# DeepSeek-V3's chat template, as its tokenizer_config.json publishes it (deepseek-ai/DeepSeek-V3
# on Hugging Face): tool calls and tool outputs, but no `tools` variable.
V3_TEMPLATE = (
    "{% if not add_generation_prompt is defined %}{% set add_generation_prompt = false %}"
    "{% endif %}{% set ns = namespace(is_first=false, is_tool=false, is_output_first=true, "
    "system_prompt='', is_first_sp=true) %}{%- for message in messages %}{%- if "
    "message['role'] == 'system' %}{%- if ns.is_first_sp %}{% set ns.system_prompt = "
    "ns.system_prompt + message['content'] %}{% set ns.is_first_sp = false %}{%- else %}"
    "{% set ns.system_prompt = ns.system_prompt + '\\n\\n' + message['content'] %}{%- endif %}"
    "{%- endif %}{%- endfor %}{{bos_token}}{{ns.system_prompt}}"
    "{%- for message in messages %}{%- if message['role'] == 'user' %}{%- set ns.is_tool = "
    "false -%}{{'<｜User｜>' + message['content']}}{%- endif %}{%- if message['role'] == "
    "'assistant' and message['content'] is none %}{%- set ns.is_tool = false -%}{%- for tool "
    "in message['tool_calls']%}{%- if not ns.is_first %}{{'<｜Assistant｜><｜tool▁calls▁begin｜>"
    "<｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + tool['function']['name'] + "
    "'\\n' + '```json' + '\\n' + tool['function']['arguments'] + '\\n' + '```' + "
    "'<｜tool▁call▁end｜>'}}{%- set ns.is_first = true -%}{%- else %}{{'\\n' + "
    "'<｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + tool['function']['name'] + "
    "'\\n' + '```json' + '\\n' + tool['function']['arguments'] + '\\n' + '```' + "
    "'<｜tool▁call▁end｜>'}}{{'<｜tool▁calls▁end｜><｜end▁of▁sentence｜>'}}{%- endif %}"
    "{%- endfor %}{%- endif %}{%- if message['role'] == 'assistant' and message['content'] is "
    "not none %}{%- if ns.is_tool %}{{'<｜tool▁outputs▁end｜>' + message['content'] + "
    "'<｜end▁of▁sentence｜>'}}{%- set ns.is_tool = false -%}{%- else %}{{'<｜Assistant｜>' + "
    "message['content'] + '<｜end▁of▁sentence｜>'}}{%- endif %}{%- endif %}{%- if "
    "message['role'] == 'tool' %}{%- set ns.is_tool = true -%}{%- if ns.is_output_first %}"
    "{{'<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>' + message['content'] + "
    "'<｜tool▁output▁end｜>'}}{%- set ns.is_output_first = false %}{%- else %}{{'\\n"
    "<｜tool▁output▁begin｜>' + message['content'] + '<｜tool▁output▁end｜>'}}{%- endif %}"
    "{%- endif %}{%- endfor -%}{% if ns.is_tool %}{{'<｜tool▁outputs▁end｜>'}}{% endif %}"
    "{% if add_generation_prompt and not ns.is_tool %}{{'<｜Assistant｜>'}}{% endif %}"
)
# The same with the tool definitions rendered after the system prompt (this project's own
# wording, the way vLLM's tool_chat_template_deepseekv3.jinja adds them).
TOOLS_BLOCK = (
    "{% if tools %}{{ '\\n\\n## Tools\\nYou have access to the following tools:\\n' }}"
    "{% for tool in tools %}{{ '\\n### ' + tool['function']['name'] + '\\nDescription: ' + "
    "(tool['function']['description'] or '') + '\\nParameters: ' + "
    "(tool['function']['parameters'] | tojson) + '\\n' }}{% endfor %}"
    "{{ '\\nTo call tools, answer with <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function"
    "<｜tool▁sep｜>NAME, a json block of the arguments, <｜tool▁call▁end｜>, and end with "
    "<｜tool▁calls▁end｜>.' }}{% endif %}"
)
TOOL_TEMPLATE = V3_TEMPLATE.replace("{{bos_token}}{{ns.system_prompt}}",
                                    "{{bos_token}}{{ns.system_prompt}}" + TOOLS_BLOCK)
assert TOOL_TEMPLATE != V3_TEMPLATE

CORPUS = ["Hello world, the weather in Paris is sunny. get_weather city Paris "
          '{"city": "Paris", "unit": "celsius"} ```json\n{"a": 1}\n``` héllo 日本語 🙂'] * 30

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"enum": ["celsius", "kelvin"]}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}}}}


def deepseek_dir(path: Path, template: str = TOOL_TEMPLATE, model_vocab: int | None = None
                 ) -> Path:
    """A checkpoint directory with DeepSeek's special tokens (the tool-call ones among them)
    and ``template`` as its chat template. ``model_vocab``: the directory already holds a
    model of that vocabulary (its config.json is kept, eos and bos set): the tokenizer is
    trained on printable ASCII to fit in it."""
    tok = Tokenizer(models.BPE())
    level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.pre_tokenizer = level
    tok.decoder = decoders.ByteLevel()
    if model_vocab is None:
        trainer = trainers.BpeTrainer(vocab_size=500, special_tokens=SPECIALS[:2],
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    else:
        alphabet = [level.pre_tokenize_str(chr(c))[0][0] for c in range(32, 127)] + ["Ċ"]
        trainer = trainers.BpeTrainer(vocab_size=model_vocab - len(SPECIALS) + 2,
                                      special_tokens=SPECIALS[:2], initial_alphabet=alphabet,
                                      limit_alphabet=len(alphabet))
    tok.train_from_iterator(CORPUS, trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t in SPECIALS[2:]])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": BOS, "eos_token": EOS, "add_bos_token": False, "add_eos_token": False,
        "tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False,
        "chat_template": template}))
    ids = {"eos_token_id": tok.token_to_id(EOS), "bos_token_id": tok.token_to_id(BOS)}
    if model_vocab is None:
        (path / "config.json").write_text(json.dumps({
            "vocab_size": tok.get_vocab_size(), "max_position_embeddings": 4096, **ids}))
        return path
    assert tok.get_vocab_size() <= model_vocab
    for name in ("config.json", "generation_config.json"):
        file = path / name
        if file.is_file():
            file.write_text(json.dumps({**json.loads(file.read_text()), **ids}))
    return path


def block(*calls: tuple[str, str], end: bool = True) -> str:
    """A tool-call block as DeepSeek-V3 writes one."""
    body = "\n".join(f"{CALL_BEGIN}function{SEP}{name}\n```json\n{args}\n```{CALL_END}"
                     for name, args in calls)
    return CALLS_BEGIN + body + (CALLS_END + EOS if end else "")
