"""The character-level vocabulary of remask's tiny models, and its transformers tokenizer.

One id per character (printable ASCII) plus special tokens; the tokenizer is a `tokenizers`
WordLevel model that splits text into single characters, saved as `tokenizer.json` so
`AutoTokenizer.from_pretrained(folder)` loads it. The chat template is

    <|bos|><|user|>{prompt}<|eot|><|assistant|>{answer}<|eos|><|eos|>…

and an answer is followed by `<|eos|>` up to the generation length (LLaDA's SFT convention: the
EOS padding belongs to the answer). `encode_chat` builds the same ids without the tokenizer,
which is what the training loop and the samplers' evaluation use; tests check they agree.
"""
from __future__ import annotations

import string

SPECIAL_TOKENS = ("<|pad|>", "<|bos|>", "<|eos|>", "<|eot|>", "<|mask|>", "<|user|>", "<|assistant|>", "<|unk|>")
CHARS = tuple(string.digits + string.ascii_letters + string.punctuation + " ")
VOCAB: tuple[str, ...] = SPECIAL_TOKENS + CHARS
VOCAB_SIZE = 128   # padded (embedding rows beyond len(VOCAB) are never produced by the data)

PAD_ID, BOS_ID, EOS_ID, EOT_ID, MASK_ID, USER_ID, ASSISTANT_ID, UNK_ID = range(len(SPECIAL_TOKENS))
CHAR_TO_ID = {c: i for i, c in enumerate(VOCAB) if c not in SPECIAL_TOKENS}

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}<|user|>{{ message['content'] }}<|eot|>"
    "{% else %}<|assistant|>{{ message['content'] }}<|eos|>{% endif %}"
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
        out.append(VOCAB[i] if i < len(VOCAB) else "<|unk|>")
    return "".join(out)


def build_tokenizer():
    """The transformers tokenizer (a `PreTrainedTokenizerFast`) for this vocabulary."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(VOCAB)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<|unk|>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens(list(SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<|bos|>", eos_token="<|eos|>", pad_token="<|pad|>",
        mask_token="<|mask|>", unk_token="<|unk|>", additional_special_tokens=["<|eot|>", "<|user|>", "<|assistant|>"],
        chat_template=CHAT_TEMPLATE, padding_side="left", model_max_length=64)
