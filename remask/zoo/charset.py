"""The character-level vocabulary of remask's tiny models, and its transformers tokenizer.

One id per character (printable ASCII) plus special tokens; the tokenizer is a `tokenizers`
WordLevel model that splits text into single characters, saved as `tokenizer.json` so
`AutoTokenizer.from_pretrained(folder)` loads it. The chat template is

    <|bos|><|user|>{prompt}<|eot|><|assistant|>{answer}<|eos|><|eos|>…

and an answer is followed by `<|eos|>` up to the generation length (LLaDA's SFT convention: the
EOS padding belongs to the answer). `encode_chat` builds the same ids without the tokenizer,
which is what the training loop and the samplers' evaluation use; tests check they agree.

The chat models (`tiny-llada-chat`, `tiny-ar-chat`) add three special tokens after the
characters (ids 103–105, so every older id keeps its meaning) and a chat template that renders
OpenAI's `tools`, `response_format`, assistant `tool_calls` and `tool` messages
(`CHAT_FORMATS_TEMPLATE`, below); a plain conversation renders byte for byte as with
`CHAT_TEMPLATE` (tested).
"""
from __future__ import annotations

import functools
import string

SPECIAL_TOKENS = ("<|pad|>", "<|bos|>", "<|eos|>", "<|eot|>", "<|mask|>", "<|user|>", "<|assistant|>", "<|unk|>")
CHARS = tuple(string.digits + string.ascii_letters + string.punctuation + " ")
VOCAB: tuple[str, ...] = SPECIAL_TOKENS + CHARS
CHAT_CONTEXT = 512  # positions of the chat models (tools, schemas, calls and their results)
VOCAB_SIZE = 128   # padded (embedding rows beyond len(VOCAB) are never produced by the data)

PAD_ID, BOS_ID, EOS_ID, EOT_ID, MASK_ID, USER_ID, ASSISTANT_ID, UNK_ID = range(len(SPECIAL_TOKENS))
CHAR_TO_ID = {c: i for i, c in enumerate(VOCAB) if c not in SPECIAL_TOKENS}
# The chat models' extra tokens: the tool list, a tool's result, the answer's format.
FORMAT_TOKENS = ("<|tools|>", "<|tool|>", "<|format|>")
CHAT_VOCAB: tuple[str, ...] = VOCAB + FORMAT_TOKENS
TOOLS_ID, TOOL_ID, FORMAT_ID = range(len(VOCAB), len(CHAT_VOCAB))

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}<|user|>{{ message['content'] }}<|eot|>"
    "{% else %}<|assistant|>{{ message['content'] }}<|eos|>{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

# A JSON Schema written compactly (what the chat models read; a JSON Schema in full would fill
# their context): `{name:str,result:{value:str,length:int},tags?:[str]}` — `?` an optional
# property, `[T]` an array of T, `a|b` a union / enum / type list, `$ref`s followed (depth 6, then
# `any`), descriptions and titles left out.
_SCHEMA_MACRO = (
    "{% macro schema_type(s, root, depth) %}"
    "{% if s is not mapping or depth > 6 %}any"
    "{% elif '$ref' in s %}{% set ref = s['$ref'] %}"
    "{% if ref == '#' %}{{ schema_type(root, root, depth + 1) }}"
    "{% else %}{{ schema_type((root['$defs'] if '$defs' in root else (root['definitions'] "
    "if 'definitions' in root else {})).get(ref.split('/')[-1]), root, depth + 1) }}{% endif %}"
    "{% elif 'const' in s %}{{ s['const'] | tojson }}"
    "{% elif 'enum' in s %}{% for v in s['enum'] %}{% if not loop.first %}|{% endif %}{{ v | tojson }}"
    "{% endfor %}"
    "{% elif 'anyOf' in s or 'oneOf' in s or 'allOf' in s %}"
    "{% for v in (s['anyOf'] if 'anyOf' in s else (s['oneOf'] if 'oneOf' in s else s['allOf'])) %}"
    "{% if not loop.first %}|{% endif %}{{ schema_type(v, root, depth + 1) }}{% endfor %}"
    "{% elif 'properties' in s or s['type'] == 'object' %}"
    "{% if 'properties' in s and s['properties'] %}{{ '{' }}"
    "{% for key, value in s['properties'].items() %}{% if not loop.first %},{% endif %}{{ key }}"
    "{% if 'required' not in s or key not in s['required'] %}?{% endif %}:"
    "{{ schema_type(value, root, depth + 1) }}{% endfor %}{{ '}' }}{% else %}object{% endif %}"
    "{% elif 'items' in s or s['type'] == 'array' %}"
    "[{{ schema_type(s['items'] if 'items' in s else {}, root, depth + 1) }}]"
    "{% elif 'type' in s %}"
    "{% for t in ([s['type']] if s['type'] is string else s['type']) %}{% if not loop.first %}|{% endif %}"
    "{{ {'string': 'str', 'integer': 'int', 'number': 'num', 'boolean': 'bool'}.get(t, t) }}{% endfor %}"
    "{% else %}any{% endif %}"
    "{% endmacro %}"
)

# The chat models' template: CHAT_TEMPLATE plus (all optional)
#
#     <|tools|>add(a:int,b:int);capital(country:str)<|eot|>        OpenAI `tools`, compact
#     <|format|>{answer:str}<|eot|>                                 `response_format` json_schema
#     <|format|>json<|eot|>                                         `response_format` json_object
#     <|assistant|><tool_call>{"name":"add","arguments":{"a":3,"b":5}}<|eos|>   assistant `tool_calls`
#     <|tool|>8<|eot|>                                              a `tool` message (the call's result)
#
# before / among the turns. A call is written as remask's tool grammar makes the model write it
# (remask/structured.py: `<tool_call>` + compact JSON, arguments in the order given), so a
# conversation that goes back to the server renders what the model generated.
CHAT_FORMATS_TEMPLATE = (
    _SCHEMA_MACRO
    + "{{ bos_token }}"
    "{% if tools %}<|tools|>{% for tool in tools %}"
    "{% set f = tool['function'] if 'function' in tool else tool %}"
    "{% set p = f['parameters'] if 'parameters' in f and f['parameters'] is mapping else {} %}"
    "{% if not loop.first %};{% endif %}{{ f['name'] }}("
    "{% if 'properties' in p %}{% for key, value in p['properties'].items() %}"
    "{% if not loop.first %},{% endif %}{{ key }}{% if 'required' not in p or key not in p['required'] %}?"
    "{% endif %}:{{ schema_type(value, p, 0) }}{% endfor %}{% endif %}){% endfor %}<|eot|>{% endif %}"
    "{% if response_format is defined and response_format is mapping %}"
    "{% if response_format['type'] == 'json_schema' %}{% set s = response_format['json_schema']['schema'] "
    "if 'json_schema' in response_format and response_format['json_schema']['schema'] is defined else {} %}"
    "<|format|>{{ schema_type(s, s, 0) }}<|eot|>"
    "{% elif response_format['type'] == 'json_object' %}<|format|>json<|eot|>{% endif %}{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}<|user|>{{ message['content'] }}<|eot|>"
    "{% elif message['role'] == 'tool' %}<|tool|>{{ message['content'] }}<|eot|>"
    "{% else %}<|assistant|>{% if message['content'] is not none %}{{ message['content'] }}{% endif %}"
    "{% if 'tool_calls' in message and message['tool_calls'] %}{% for call in message['tool_calls'] %}"
    "{% set f = call['function'] if 'function' in call else call %}"
    "<tool_call>{\"name\":{{ f['name'] | tojson }},\"arguments\":"
    "{% if f['arguments'] is string %}{{ f['arguments'] }}"
    "{% else %}{{ f['arguments'] | tojson(separators=(',', ':')) }}"
    "{% endif %}}{% endfor %}{% endif %}<|eos|>{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def encode_text(text: str) -> list[int]:
    """Character ids of `text`; a character outside the vocabulary is an error, not an <|unk|>."""
    try:
        return [CHAR_TO_ID[c] for c in text]
    except KeyError as err:
        raise ValueError(f"character {err.args[0]!r} is not in the tiny models' vocabulary "
                         f"(printable ASCII only)") from None


def encode_chat(prompt: str) -> list[int]:
    """Ids of a one-turn chat prompt with the generation prompt appended (= the chat template)."""
    return [BOS_ID, USER_ID, *encode_text(prompt), EOT_ID, ASSISTANT_ID]


def encode_answer(answer: str, gen_length: int) -> list[int]:
    """An answer followed by EOS up to `gen_length` positions (at least one EOS)."""
    ids = encode_text(answer)
    if len(ids) >= gen_length:
        raise ValueError(f"answer {answer!r} needs {len(ids) + 1} positions with its EOS; gen_length={gen_length}")
    return ids + [EOS_ID] * (gen_length - len(ids))


def decode_answer(ids) -> str:
    """The text of generated ids up to the first EOS/EOT/pad; a mask or other special token is
    kept visible (as its name) so an unfinished answer never reads as a correct one."""
    out = []
    for i in (int(t) for t in ids):
        if i in (EOS_ID, EOT_ID, PAD_ID):
            break
        out.append(CHAT_VOCAB[i] if i < len(CHAT_VOCAB) else "<|unk|>")
    return "".join(out)


@functools.cache
def chat_tokenizer():
    """The chat models' tokenizer, built once per process (the training batches' template)."""
    return build_tokenizer(formats=True)


def build_tokenizer(formats: bool = False):
    """The transformers tokenizer (a `PreTrainedTokenizerFast`) for this vocabulary; `formats`:
    the chat models' one (the extra tokens and `CHAT_FORMATS_TEMPLATE`), else the first models'."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(CHAT_VOCAB if formats else VOCAB)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<|unk|>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens(list(SPECIAL_TOKENS + (FORMAT_TOKENS if formats else ())))
    extra = ["<|eot|>", "<|user|>", "<|assistant|>"] + (list(FORMAT_TOKENS) if formats else [])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<|bos|>", eos_token="<|eos|>", pad_token="<|pad|>",
        mask_token="<|mask|>", unk_token="<|unk|>", additional_special_tokens=extra,
        chat_template=CHAT_FORMATS_TEMPLATE if formats else CHAT_TEMPLATE, padding_side="left",
        model_max_length=CHAT_CONTEXT if formats else 64)
