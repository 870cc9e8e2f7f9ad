"""Structured output: `StructuredOutputsParams` (vLLM's names), compiled once per (structure,
tokenizer) and cached, and the per-sequence `Matcher` the decoders enforce it with.

    params = remask.StructuredOutputsParams(json={"type": "object", "properties": {...}})
    llm.generate(prompt, remask.SamplingParams(max_tokens=64, structured_outputs=params))

The matcher library is **llguidance** (guidance-ai, MIT; the Rust core behind llama.cpp's and
SGLang's llguidance backends), chosen over xgrammar because:

* its `LLMatcher` has the operations a masked-diffusion commit needs, not only the next-token
  mask of autoregressive decoding: `try_consume_tokens` / `validate_tokens` (how many tokens of a
  run the grammar accepts, without committing), `deep_copy` (a clone for the lookahead, ~1 µs),
  `rollback` (revocations), `is_accepting`;
* it compiles the whole of JSON Schema (plus Lark / GBNF grammars, regexes, choice lists) lazily
  (Earley parser + lexer): no schema-size blow-up, grammar errors come back as messages we can
  return as a 400;
* it is one abi3 wheel (cp39-abi3 manylinux, ~3 MB) with no dependency: nothing downloads at run
  time, it imports no torch, and it builds a tokenizer from a byte table, so character vocabularies
  (the shipped tiny models) work as well as Hugging Face byte-level / sentencepiece ones.
  (xgrammar 0.2 pulls torch, transformers, ninja and apache-tvm-ffi, and its matcher has no
  try-consume without committing.)

`import remask` stays light: llguidance is imported on first compile (`_ll()`).

What is enforced where (docs: the decoders' docstrings): `ARDecoder.sample` / `ar_generate` mask
the next token; LLaDA's `BlockDecoder.commit` (and every masked-diffusion method's commit: Dream's,
FreeDave, dInfer, WINO, dKV-Cache, d2Cache, Elastic-Cache) runs `remask.diffusion.parts.constrain` (the first
undecided position masked before the rule scores it, commits beyond it kept only if a clone
accepts the lookahead fill, the matcher advanced over the contiguous committed run, end tokens only
where the grammar accepts). An answer that runs out of budget ends with finish reason `length` and
a valid prefix; `stop` only after an accepted structure.
"""
from __future__ import annotations

import json as _json
import math
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Sequence

FIELDS = ("json", "regex", "choice", "grammar", "json_object")
MAX_SCHEMA_CHARS = 200_000      # a schema / regex / grammar text larger than this is refused (a request's cost bound)
MAX_CHOICES = 4096


class StructuredOutputsError(ValueError):
    """A structured-output request that cannot be honoured; `field` names the offending parameter
    (`json`, `regex`, `choice`, `grammar`, `json_object`, or `max_tokens`), so a server can name it
    in its 400."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"structured_outputs.{field}: {message}" if field in FIELDS else message)
        self.field = field


def _ll():
    import llguidance   # noqa: PLC0415  (lazy: `import remask` does not load it)

    return llguidance


@dataclass(frozen=True)
class StructuredOutputsParams:
    """What the answer must be, exactly one of (vLLM's `StructuredOutputsParams`):

    * `json`: a JSON Schema (a dict, or its JSON text); the answer is one JSON value it validates;
    * `regex`: a regular expression (Rust `regex` syntax) the whole answer matches;
    * `choice`: a list of strings, the answer is one of them;
    * `grammar`: a Lark grammar (llguidance's dialect) or a GBNF / EBNF one (llama.cpp's);
    * `json_object`: True — any JSON object (OpenAI's `{"type": "json_object"}`).

    `disable_any_whitespace` (default True, unlike vLLM): JSON is written compactly (`,` and `:`
    with no free whitespace), so a small budget fits and the shortest output is known; False allows
    JSON whitespace between tokens. A schema's own `"x-guidance"` options override it.

    Built once, validated at once: a missing / double / mistyped field or a schema, regex or
    grammar llguidance rejects raises `StructuredOutputsError` (a ValueError) naming the field.
    """

    json: Any = None
    regex: str | None = None
    choice: Sequence[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = True
    _grammar: str = field(default="", init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        given = [name for name in FIELDS if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise StructuredOutputsError(
                "structured_outputs", f"structured_outputs takes exactly one of {list(FIELDS)}, got "
                + (f"{given}" if given else "none"))
        if not isinstance(self.disable_any_whitespace, bool):
            raise StructuredOutputsError("structured_outputs", "structured_outputs.disable_any_whitespace must be "
                                         f"True or False, got {self.disable_any_whitespace!r}")
        kind = given[0]
        if kind == "json":
            schema = self.json
            if isinstance(schema, str):
                if len(schema) > MAX_SCHEMA_CHARS:
                    raise StructuredOutputsError("json", f"the schema is {len(schema)} characters; at most "
                                                 f"{MAX_SCHEMA_CHARS}")
                try:
                    schema = _json.loads(schema)
                except ValueError as err:
                    raise StructuredOutputsError("json", f"not valid JSON text: {err}") from None
            if schema is True:
                schema = {}
            if not isinstance(schema, dict):
                raise StructuredOutputsError("json", f"a JSON Schema must be an object (a dict), got "
                                             f"{type(schema).__name__}")
            try:
                text = _json.dumps(schema)   # key order kept: it is the order properties are written in
            except (TypeError, ValueError) as err:
                raise StructuredOutputsError("json", f"the schema is not JSON-serialisable: {err}") from None
            if len(text) > MAX_SCHEMA_CHARS:
                raise StructuredOutputsError("json", f"the schema is {len(text)} characters; at most {MAX_SCHEMA_CHARS}")
            object.__setattr__(self, "json", schema)
            options = {"whitespace_flexible": not self.disable_any_whitespace}
            grammar = _ll().LLMatcher.grammar_from_json_schema(text, defaults=options)
        elif kind == "json_object":
            if self.json_object is not True:
                raise StructuredOutputsError("json_object", f"must be True, got {self.json_object!r}")
            options = {"whitespace_flexible": not self.disable_any_whitespace}
            grammar = _ll().LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=options)
        elif kind == "regex":
            if not isinstance(self.regex, str) or not self.regex:
                raise StructuredOutputsError("regex", f"must be a non-empty str, got {self.regex!r}")
            if len(self.regex) > MAX_SCHEMA_CHARS:
                raise StructuredOutputsError("regex", f"{len(self.regex)} characters; at most {MAX_SCHEMA_CHARS}")
            grammar = _ll().LLMatcher.grammar_from_regex(self.regex)
        elif kind == "choice":
            choice = self.choice
            if isinstance(choice, str) or not isinstance(choice, (list, tuple)) or not choice:
                raise StructuredOutputsError("choice", f"must be a non-empty list of strings, got {choice!r}")
            if len(choice) > MAX_CHOICES:
                raise StructuredOutputsError("choice", f"{len(choice)} choices; at most {MAX_CHOICES}")
            for item in choice:
                if not isinstance(item, str) or not item:
                    raise StructuredOutputsError("choice", f"every choice must be a non-empty str, got {item!r}")
            if sum(map(len, choice)) > MAX_SCHEMA_CHARS:
                raise StructuredOutputsError("choice", f"the choices exceed {MAX_SCHEMA_CHARS} characters")
            object.__setattr__(self, "choice", tuple(choice))
            # a Lark alternation of string literals (llguidance's own `grammar_from("choice", ...)`)
            grammar = _ll().LLMatcher.grammar_from_lark("start: " + " | ".join(_json.dumps(c) for c in choice))
        else:
            if not isinstance(self.grammar, str) or not self.grammar.strip():
                raise StructuredOutputsError("grammar", f"must be a non-empty str, got {self.grammar!r}")
            if len(self.grammar) > MAX_SCHEMA_CHARS:
                raise StructuredOutputsError("grammar", f"{len(self.grammar)} characters; at most {MAX_SCHEMA_CHARS}")
            try:
                grammar = _ll().grammar_from("grammar", self.grammar)   # Lark, or GBNF converted to Lark
            except ValueError as err:
                raise StructuredOutputsError("grammar", str(err)) from None
        is_error, messages = _ll().LLMatcher.validate_grammar_with_warnings(grammar)
        if is_error:
            raise StructuredOutputsError(kind, f"rejected: {messages[0].strip()}")
        object.__setattr__(self, "_grammar", grammar)

    @property
    def kind(self) -> str:
        return next(name for name in FIELDS if getattr(self, name) not in (None, False))

    @property
    def key(self) -> str:
        """The compiled grammar's text: equal structures share one compile."""
        return self._grammar

    def template_format(self) -> dict[str, Any] | None:
        """The JSON format this structure asks for, in OpenAI's `response_format` shape, for a chat template that
        shows it to the model (`LLM.chat_ids(response_format=...)`); None for a regex, grammar or choice."""
        if self.json is not None:
            return {"type": "json_schema", "json_schema": {"name": "structured_outputs", "schema": self.json}}
        return {"type": "json_object"} if self.json_object else None

    @classmethod
    def from_response_format(cls, response_format: Any) -> "StructuredOutputsParams | None":
        """OpenAI's `response_format`: `{"type": "text"}` (None), `{"type": "json_object"}`, or
        `{"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}`.
        Errors start with `response_format` (the field a server's 400 names)."""
        if response_format is None:
            return None
        if not isinstance(response_format, dict):
            raise StructuredOutputsError("response_format", f"response_format must be an object, got "
                                         f"{type(response_format).__name__}")
        kind = response_format.get("type")
        extra = sorted(set(response_format) - {"type", "json_schema"})
        if extra:
            raise StructuredOutputsError("response_format", f"response_format: unknown fields {extra}")
        if kind == "text":
            return None
        if kind == "json_object":
            return cls(json_object=True)
        if kind != "json_schema":
            raise StructuredOutputsError("response_format", "response_format.type must be 'text', 'json_object' or "
                                         f"'json_schema', got {kind!r}")
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict):
            raise StructuredOutputsError("response_format", "response_format.json_schema must be an object "
                                         "{name, schema, strict, description}")
        unknown = sorted(set(spec) - {"name", "schema", "strict", "description"})
        if unknown:
            raise StructuredOutputsError("response_format", f"response_format.json_schema: unknown fields {unknown}")
        name = spec.get("name")
        if not isinstance(name, str) or not name:
            raise StructuredOutputsError("response_format", "response_format.json_schema.name must be a non-empty str")
        if spec.get("strict") not in (None, True, False):
            raise StructuredOutputsError("response_format", "response_format.json_schema.strict must be true or false")
        schema = spec.get("schema", {})
        try:
            return cls(json=schema)
        except StructuredOutputsError as err:
            raise StructuredOutputsError("response_format", "response_format.json_schema.schema: "
                                         + str(err).split(": ", 1)[-1]) from None

    @classmethod
    def from_json(cls, body: Any, name: str = "structured_outputs") -> "StructuredOutputsParams":
        """From a JSON body (vLLM's `structured_outputs` field: `{"json": ...}`, `{"regex": ...}`,
        `{"choice": [...]}`, `{"grammar": ...}`, `{"json_object": true}`)."""
        if isinstance(body, cls):
            return body
        if not isinstance(body, dict):
            raise StructuredOutputsError("structured_outputs", f"{name} must be an object with one of "
                                         f"{list(FIELDS)}, got {type(body).__name__}")
        known = set(FIELDS) | {"disable_any_whitespace"}
        unknown = sorted(set(body) - known)
        if unknown:
            raise StructuredOutputsError("structured_outputs", f"{name} has unknown fields {unknown}; it takes "
                                         f"{sorted(known)}")
        return cls(**body)

    def min_bytes(self) -> int | None:
        """A lower bound on the bytes of the shortest valid answer (its end token not counted), or
        None where none is known (grammars)."""
        kind = self.kind
        if kind == "json":
            return _schema_min_bytes(self.json, self.json, 0)
        if kind == "json_object":
            return 2
        if kind == "choice":
            return min(len(c.encode()) for c in self.choice)
        if kind == "regex":
            return _regex_min_chars(self.regex)
        return None


# ---- the shortest answer: lower bounds (a request shorter than one cannot be valid) ----------

def _regex_min_chars(pattern: str) -> int | None:
    """Python's parse of the pattern gives its minimum width in characters (each >= 1 byte); a
    pattern Python's `re` does not parse (Rust-only syntax) gives None."""
    try:
        import re._parser as sre_parse   # Python 3.11+
    except ImportError:                  # pragma: no cover
        import sre_parse                 # type: ignore[no-redef]
    try:
        return int(sre_parse.parse(pattern).getwidth()[0])
    except Exception:   # noqa: BLE001  (any parse failure: unknown, not an error)
        return None


def _compact(value: Any) -> int:
    return len(_json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode())


def _resolve(ref: str, root: Any) -> Any:
    if not ref.startswith("#"):
        return None
    node = root
    for part in ref[1:].split("/")[1:] if ref.startswith("#/") else []:
        part = part.replace("~1", "/").replace("~0", "~")
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def _int_min_len(low: float | None, high: float | None) -> int:
    if low is not None and low > 0:
        return len(str(int(math.ceil(low))))
    if high is not None and high < 0:
        return len(str(int(math.floor(high))))
    return 1


def _schema_min_bytes(schema: Any, root: Any, depth: int) -> int:
    """Bytes of the shortest compact JSON text `schema` admits, or a lower bound of it (never more)."""
    if depth > 32 or schema is True or not isinstance(schema, dict) or not schema:
        return 1   # any value: `0`
    if "$ref" in schema:
        target = _resolve(schema["$ref"], root)
        return _schema_min_bytes(target, root, depth + 1) if target is not None else 1
    if "const" in schema:
        return _compact(schema["const"])
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        return min(_compact(v) for v in schema["enum"])
    bounds = [_schema_min_bytes(s, root, depth + 1) for s in schema.get("allOf", []) if isinstance(s, dict)]
    for key in ("anyOf", "oneOf"):
        options = [s for s in schema.get(key, []) if isinstance(s, (dict, bool))]
        if options:
            bounds.append(min(_schema_min_bytes(s, root, depth + 1) for s in options))
    types = schema.get("type")
    if types is not None:
        types = [types] if isinstance(types, str) else [t for t in types if isinstance(t, str)]
        if types:
            bounds.append(min(_type_min_bytes(t, schema, root, depth) for t in types))
    return max(bounds) if bounds else 1


def _type_min_bytes(kind: str, schema: dict, root: Any, depth: int) -> int:
    if kind in ("null", "true"):
        return 4
    if kind == "boolean":
        return 4
    if kind == "integer":
        low = schema.get("minimum", schema.get("exclusiveMinimum"))
        high = schema.get("maximum", schema.get("exclusiveMaximum"))
        low = low if isinstance(low, (int, float)) and not isinstance(low, bool) else None
        high = high if isinstance(high, (int, float)) and not isinstance(high, bool) else None
        if "exclusiveMinimum" in schema and "minimum" not in schema and low is not None:
            low = math.floor(low) + 1
        if "exclusiveMaximum" in schema and "maximum" not in schema and high is not None:
            high = math.ceil(high) - 1
        return _int_min_len(low, high)
    if kind == "number":
        return 1
    if kind == "string":
        length = schema.get("minLength", 0)
        length = length if isinstance(length, int) and not isinstance(length, bool) else 0
        pattern = schema.get("pattern")
        if isinstance(pattern, str):
            width = _regex_min_chars(pattern)
            length = max(length, width or 0)
        return 2 + length
    if kind == "array":
        count = schema.get("minItems", 0)
        count = count if isinstance(count, int) and not isinstance(count, bool) else 0
        if count <= 0:
            return 2
        prefix = schema.get("prefixItems") if isinstance(schema.get("prefixItems"), list) else []
        items = schema.get("items", True)
        sizes = [_schema_min_bytes(prefix[i] if i < len(prefix) else items, root, depth + 1) for i in range(min(count, 256))]
        return 2 + sum(sizes) + (count - 1)
    if kind == "object":
        required = [r for r in schema.get("required", []) if isinstance(r, str)]
        props = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
        if not required:
            return 2
        size = 2 + (len(required) - 1)
        for name in required:
            size += _compact(name) + 1 + _schema_min_bytes(props.get(name, True), root, depth + 1)
        return size
    return 1


# ---- compiling against a tokenizer ------------------------------------------------------------

_LOCK = threading.Lock()
_TOKENIZERS: "OrderedDict[tuple[int, int], _Vocab]" = OrderedDict()
_COMPILED: "OrderedDict[tuple[str, int, int], CompiledStructure]" = OrderedDict()
MAX_CACHED = 64


@dataclass
class _Vocab:
    """A tokenizer as the matcher sees it: llguidance's `LLTokenizer` over `size` ids (the
    model's vocabulary), the ids never allowed inside a structure (special tokens, mask, ids the
    tokenizer does not have) and the longest token in bytes."""

    tokenizer: Any            # kept alive: the cache is keyed by its id()
    ll: Any
    size: int
    banned: Any               # torch.BoolTensor [size]
    max_token_bytes: int


def _vocab(tokenizer: Any, vocab_size: int, extra_banned: Sequence[int] = ()) -> _Vocab:
    import torch

    ll = _ll()
    key = (id(tokenizer), vocab_size)
    with _LOCK:
        hit = _TOKENIZERS.get(key)
        if hit is not None and hit.tokenizer is tokenizer:
            _TOKENIZERS.move_to_end(key)
            return hit
    n_tok = len(tokenizer)
    size = max(vocab_size, n_tok)
    special = {int(i) for i in getattr(tokenizer, "all_special_ids", []) if i is not None}
    mask_id = getattr(tokenizer, "mask_token_id", None)
    if mask_id is not None:
        special.add(int(mask_id))
    special |= {int(i) for i in extra_banned}
    eos = getattr(tokenizer, "eos_token_id", None)
    lltok = None
    try:   # fast Hugging Face tokenizers: byte-level BPE, sentencepiece (byte fallback), ...
        import llguidance.hf

        lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=size)
    except Exception:   # noqa: BLE001  (a decoder llguidance does not know: build the byte table here)
        lltok = None
    if lltok is None:
        # Character / word-level vocabularies (the tiny models' WordLevel + Fuse decoder): each
        # token's text is what decoding it alone gives.
        tokens: list[bytes] = []
        for i in range(size):
            if i >= n_tok:
                tokens.append(b"")
            elif i in special:
                tokens.append(str(tokenizer.convert_ids_to_tokens(i)).encode())
            else:
                tokens.append(tokenizer.decode([i]).encode())

        class _Wrapped:
            eos_token_id = eos if eos is not None else 0
            bos_token_id = getattr(tokenizer, "bos_token_id", None)
            special_token_ids = sorted(i for i in special if i < n_tok)

            def __init__(self) -> None:
                self.tokens = tokens

            def __call__(self, text: Any) -> list[int]:
                text = text.decode("utf-8", "replace") if isinstance(text, bytes) else text
                return list(tokenizer(text, add_special_tokens=False)["input_ids"])

        lltok = ll.LLTokenizer(ll.TokenizerWrapper(_Wrapped()), n_vocab=size)
    banned = torch.zeros(size, dtype=torch.bool)
    banned[n_tok:] = True
    for i in special:
        if 0 <= i < size:
            banned[i] = True
    lengths = [len(lltok.decode_bytes([i])) for i in range(min(n_tok, size)) if not banned[i]]
    vocab = _Vocab(tokenizer=tokenizer, ll=lltok, size=size, banned=banned, max_token_bytes=max(lengths or [1]))
    with _LOCK:
        _TOKENIZERS[key] = vocab
        while len(_TOKENIZERS) > MAX_CACHED:
            _TOKENIZERS.popitem(last=False)
    return vocab


@dataclass
class CompiledStructure:
    """A structure compiled against one tokenizer: a template matcher that each sequence's
    `Matcher` deep-copies, and the shortest answer in tokens where known (`min_tokens`)."""

    params: StructuredOutputsParams
    vocab: _Vocab
    template: Any
    vocab_size: int           # the logits' last dimension (the model's vocabulary)
    min_tokens: int | None

    def matcher(self, end_ids: Sequence[int]) -> "Matcher":
        """A fresh matcher at the answer's start; `end_ids` are the ids that end the answer (the
        model's EOS/EOT and the request's stop ids): allowed exactly where the structure is complete."""
        return Matcher(self, self.template.deep_copy(), tuple(sorted({int(i) for i in end_ids})))

    def check_budget(self, max_tokens: int) -> None:
        """A `max_tokens` shorter than the shortest valid answer (where known) is refused, naming it."""
        if self.min_tokens is not None and max_tokens < self.min_tokens:
            raise StructuredOutputsError(
                "max_tokens", f"max_tokens: {max_tokens} is shorter than the shortest answer the structure "
                f"({self.params.kind}) allows: at least {self.min_tokens} tokens")


def compile_structure(params: StructuredOutputsParams, tokenizer: Any, vocab_size: int,
                      banned_ids: Sequence[int] = ()) -> CompiledStructure:
    """`params` compiled against `tokenizer` for a model with `vocab_size` logits (cached per
    (structure, tokenizer, vocab_size)). `banned_ids`: ids never allowed inside the structure
    besides the tokenizer's special ones (the model's mask id)."""
    if not isinstance(params, StructuredOutputsParams):
        raise TypeError(f"structured_outputs must be a remask.StructuredOutputsParams, got {type(params).__name__}")
    if tokenizer is None:
        raise ValueError("structured_outputs needs the model's tokenizer (the structure is compiled against its "
                         "vocabulary): pass tokenizer=")
    key = (params.key, id(tokenizer), int(vocab_size), tuple(sorted(int(i) for i in banned_ids)))
    with _LOCK:
        hit = _COMPILED.get(key)
        if hit is not None and hit.vocab.tokenizer is tokenizer:
            _COMPILED.move_to_end(key)
            return hit
    vocab = _vocab(tokenizer, int(vocab_size), banned_ids)
    ll = _ll()
    template = ll.LLMatcher(vocab.ll, params.key, log_level=0)
    if template.is_error():
        raise StructuredOutputsError(params.kind, f"rejected: {template.get_error().strip()}")
    low = params.min_bytes()
    min_tokens = None if low is None else math.ceil(low / vocab.max_token_bytes)
    compiled = CompiledStructure(params=params, vocab=vocab, template=template, vocab_size=int(vocab_size),
                                 min_tokens=min_tokens)
    with _LOCK:
        _COMPILED[key] = compiled
        while len(_COMPILED) > MAX_CACHED:
            _COMPILED.popitem(last=False)
    return compiled


# ---- one sequence's matcher -------------------------------------------------------------------

class Matcher:
    """One answer's position in its structure. Tokens are the model's ids; an end id (EOS, EOT,
    stop ids) is accepted exactly where the structure is complete, and after it only end ids.

    * `allowed()`: the ids allowed at the next position (BoolTensor `[vocab_size]`);
    * `mask_logits(logits)`: −inf where not allowed (the last dimension is the vocabulary);
    * `advance(tokens)`: consume tokens (all must be accepted, else ValueError and nothing changes);
    * `accepts(tokens)`: how many of `tokens` would be accepted from here, without committing;
    * `clone()`, `rollback(n)`; `position` (tokens consumed), `ended`, `is_accepting()`.
    """

    def __init__(self, compiled: CompiledStructure, ll_matcher: Any, end_ids: tuple[int, ...]) -> None:
        self.compiled, self._m, self.end_ids = compiled, ll_matcher, end_ids
        self._end_set = frozenset(end_ids)
        self.position = 0            # tokens consumed (the end ids included)
        self._ended_at: int | None = None
        self.mask_seconds = 0.0      # time spent computing masks (the bench reads it)

    @property
    def ended(self) -> bool:
        return self._ended_at is not None

    def is_accepting(self) -> bool:
        return self.ended or self._m.is_accepting()

    def clone(self) -> "Matcher":
        other = Matcher(self.compiled, self._m.deep_copy(), self.end_ids)
        other.position, other._ended_at = self.position, self._ended_at
        return other

    def allowed(self):
        """BoolTensor `[vocab_size]` of the ids allowed next (on the CPU)."""
        import time

        import numpy as np
        import torch

        size = self.compiled.vocab_size
        out = torch.zeros(size, dtype=torch.bool)
        if self.ended:
            out[list(self.end_ids)] = True
            return out
        began = time.perf_counter()
        bits = np.unpackbits(np.frombuffer(self._m.compute_bitmask(), dtype=np.uint8), bitorder="little")
        n = min(size, bits.shape[0])
        out[:n] = torch.from_numpy(bits[:n].astype(bool))
        out[:n] &= ~self.compiled.vocab.banned[:n]
        if self._m.is_accepting():
            out[[i for i in self.end_ids if i < size]] = True
        self.mask_seconds += time.perf_counter() - began
        if not bool(out.any()):
            raise RuntimeError(f"structured output: no token can continue the answer here "
                               f"({self._m.get_error() or 'the grammar allows none of the vocabulary'})")
        return out

    def mask_logits(self, logits):
        """`logits` (`[..., V]`) with −inf where the next token is not allowed (a new tensor)."""
        import torch

        allowed = self.allowed().to(logits.device)
        V = logits.shape[-1]
        if V > allowed.shape[0]:
            allowed = torch.cat([allowed, allowed.new_zeros(V - allowed.shape[0])])
        return logits.masked_fill(~allowed[:V], -torch.inf)

    def accepts(self, tokens: Sequence[int]) -> int:
        """How many of `tokens`, from the current state, the structure accepts (nothing committed)."""
        tokens = [int(t) for t in tokens]
        count = 0
        if not self.ended:
            body = []
            for t in tokens:
                if t in self._end_set:
                    break
                body.append(t)
            if body:
                count = self._m.validate_tokens(body)
            if count < len(body):
                return count
            if count == len(tokens):
                return count
            # tokens[count] is an end id: accepted where the structure is complete after `body`
            if not body:
                complete = self._m.is_accepting()
            else:
                probe = self._m.deep_copy()
                probe.consume_tokens(body)
                complete = probe.is_accepting()
            if not complete:
                return count
        for t in tokens[count:]:
            if t not in self._end_set:
                break
            count += 1
        return count

    def try_advance(self, token: int) -> bool:
        """Consume `token` if the structure accepts it here; False (and nothing changed) if not."""
        token = int(token)
        if self.ended or token in self._end_set:
            if token not in self._end_set or not self.is_accepting():
                return False
            if self._ended_at is None:
                self._ended_at = self.position
            self.position += 1
            return True
        if self._m.try_consume_tokens([token]) != 1:
            return False
        self.position += 1
        return True

    def advance(self, tokens: Sequence[int]) -> None:
        """Consume `tokens` (each must be accepted; else ValueError, the matcher unchanged)."""
        tokens = [int(t) for t in tokens]
        if not tokens:
            return
        if self.accepts(tokens) != len(tokens):
            raise ValueError(f"structured output: the tokens {tokens} do not continue the answer")
        for i, t in enumerate(tokens):
            if self.ended or t in self._end_set:
                if self._ended_at is None:
                    self._ended_at = self.position
                self.position += 1
                continue
            ok = self._m.consume_token(t)
            assert ok, self._m.get_error()
            self.position += 1

    def rollback(self, n: int) -> None:
        """Undo the last `n` tokens consumed (a revocation)."""
        if n < 0 or n > self.position:
            raise ValueError(f"cannot roll back {n} tokens of {self.position}")
        target = self.position - n
        if self._ended_at is not None and target <= self._ended_at:
            body = n - (self.position - self._ended_at)
            self._ended_at = None
        else:
            body = 0 if self._ended_at is not None else n
        if body:
            self._m.rollback(body)
        self.position = target

    def valid(self, tokens: Sequence[int]) -> bool:
        """Whether `tokens` (an answer from the start state, end ids included) continue this structure."""
        return self.accepts(tokens) == len(list(tokens))


_MODEL_TOKENIZERS: dict[str, Any] = {}


def model_vocab_size(model: Any) -> int:
    """The model's logits width as its config gives it (a mismatch is harmless: `Matcher.mask_logits`
    pads or cuts the mask to the logits)."""
    config = getattr(model, "config", None)
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    sizes = [getattr(config, name, None) for name in ("vocab_size", "embedding_size")]
    sizes = [int(s) for s in sizes if isinstance(s, int)]
    if not sizes:
        raise ValueError("structured_outputs: the model's config has no vocab_size")
    return max(sizes)


def tokenizer_for(model: Any, tokenizer: Any = None) -> Any:
    """`tokenizer`, or the one saved beside the model's checkpoint (a local folder: nothing is
    downloaded); an error naming `tokenizer=` if there is none."""
    if tokenizer is not None:
        return tokenizer
    import os

    path = getattr(model, "name_or_path", None) or getattr(getattr(model, "config", None), "_name_or_path", None)
    if isinstance(path, str) and os.path.isdir(path):
        if path not in _MODEL_TOKENIZERS:
            from transformers import AutoTokenizer

            _MODEL_TOKENIZERS[path] = AutoTokenizer.from_pretrained(path)
        return _MODEL_TOKENIZERS[path]
    raise ValueError("structured_outputs needs the model's tokenizer (the structure is compiled against its "
                     "vocabulary): pass tokenizer=")


# ---- tool calls (OpenAI's `tools` / `tool_choice`) ----------------------------------------------

TOOL_CALL_TAG = "<tool_call>"     # what starts a call in an `auto` answer (Hermes / Qwen's tag)
MAX_TOOLS = 128                   # OpenAI's limit on `tools`
_TOOL_NAME = __import__("re").compile(r"[a-zA-Z0-9_-]{1,64}")


@dataclass(frozen=True)
class ToolCallSpec:
    """A chat request's `tools`, `tool_choice` and `parallel_tool_calls`, checked, and the structure
    that enforces them.

    * `mode`: `none` (plain text, the tools only checked), `named` (one call of `name`; the answer
      is the call's arguments, a JSON object held to that function's `parameters`), `required`
      (calls of the listed tools: the Lark grammar `start: call+`, each `call` being
      `"<tool_call>" %json{...}` where the JSON is `{"name": ..., "arguments": {...}}`, a JSON
      Schema `anyOf` over the tools, each `name` a `const` and its `arguments` that tool's
      parameters) or `auto` (free text or calls: `start: TEXT | call+`, where `TEXT` is any
      non-empty text that does not begin with `<tool_call>`; an answer that begins with the tag
      is a call);
    * `parallel`: `parallel_tool_calls` (OpenAI's default true): false makes the grammars'
      `call+` a single `call`, so a `required` / `auto` answer holds at most one call;
    * `structure`: the `StructuredOutputsParams` the answer is held to (None for `none`);
    * `tools`: name → parameters schema, in the request's order.
    """

    mode: str
    tools: tuple[tuple[str, Any], ...]
    name: str | None = None
    structure: StructuredOutputsParams | None = None
    parallel: bool = True

    def calls_of(self, text: str) -> list[dict[str, Any]] | None:
        """The calls a finished answer holds, each `{"name", "arguments"}` (arguments: the JSON
        text of the answer, compact as generated), or None when it holds text (`none`, or `auto`
        answered in text)."""
        if self.mode == "none" or not self.is_call(text):
            return None
        return [{"name": name, "arguments": arguments} for name, arguments, _ in self.scan(text)]

    def scan(self, text: str) -> list[tuple[str | None, str, bool]]:
        """The calls in (a prefix of) an answer that is a call, as far as they have come: per call
        `(name or None while it is not complete, the arguments' JSON text so far, whether the
        arguments are complete)`. Text only grows, so each call's arguments so far are a prefix of
        its final arguments (what streaming sends as fragments)."""
        if self.mode == "named":
            return [(self.name, text, False)]
        calls: list[tuple[str | None, str, bool]] = []
        at = 0
        while text.startswith(TOOL_CALL_TAG, at):
            name, arguments, complete, at = _scan_call(text, at + len(TOOL_CALL_TAG))
            calls.append((name, arguments, complete))
            if at is None:
                break
        return calls

    def is_call(self, text: str) -> bool | None:
        """Whether an answer that begins with `text` is a call: True / False, or None while it
        cannot be told yet (`auto`, `text` a proper prefix of the tag)."""
        if self.mode in ("named", "required"):
            return True
        if self.mode == "none":
            return False
        if text.startswith(TOOL_CALL_TAG):
            return True
        return None if TOOL_CALL_TAG.startswith(text) else False


def _skip_json(text: str, at: int) -> int | None:
    """The index just past the JSON value that starts at `text[at]`, or None when the text ends
    first (the value is still being generated). The text is grammar-made: valid JSON so far."""
    if at >= len(text):
        return None
    if text[at] == '"':
        i = at + 1
        while i < len(text):
            if text[i] == "\\":
                i += 2
                continue
            if text[i] == '"':
                return i + 1
            i += 1
        return None
    if text[at] in "{[":
        depth, i = 0, at
        while i < len(text):
            ch = text[i]
            if ch == '"':
                end = _skip_json(text, i)
                if end is None:
                    return None
                i = end
                continue
            if ch in "{[":
                depth += 1
            elif ch in "}]":
                depth -= 1
                if depth == 0:
                    return i + 1
            i += 1
        return None
    end = at   # a number, true, false or null: complete once something follows it
    while end < len(text) and text[end] not in ",}] \t\n\r":
        end += 1
    return end if end < len(text) else None


def _scan_call(text: str, at: int) -> tuple[str | None, str, bool, int | None]:
    """One call's JSON object `{"name": ..., "arguments": {...}}` from `text[at]` on: (its name
    once complete, the arguments' text so far, whether they are complete, the index past the
    object or None while it is incomplete)."""
    name, arguments, complete = None, "", False
    i = at + 1                                    # past "{"
    while i < len(text):
        while i < len(text) and text[i] in " \t\n\r,":
            i += 1
        if i < len(text) and text[i] == "}":
            return name, arguments, complete, i + 1
        key_end = _skip_json(text, i)
        if key_end is None:
            break
        key = _json.loads(text[i:key_end])
        i = key_end
        while i < len(text) and text[i] in " \t\n\r:":
            i += 1
        end = _skip_json(text, i)
        if key == "arguments":
            arguments, complete = text[i:len(text) if end is None else end], end is not None
        elif key == "name" and end is not None:
            name = _json.loads(text[i:end])
        if end is None:
            break
        i = end
    return name, arguments, complete, None


TOOL_RESPONSE_TAGS = ("<tool_response>", "</tool_response>")   # Hermes / Qwen's wrapping of a tool's result
_PROBE_NAME, _PROBE_RESULT = "remask_probe_function", "remask_probe_result"
_template_support: dict[str, tuple[bool, bool]] = {}


def template_tool_support(tokenizer: Any) -> tuple[bool, bool]:
    """Whether the tokenizer's chat template renders (an assistant message's `tool_calls`, a `tool`
    message as a role of its own), found by rendering a probe conversation once per template: the
    call's name must appear, and a tool message must render unlike the same message as `user` or
    `assistant`. A template that raises on the probe reads neither."""
    template = getattr(tokenizer, "chat_template", None)
    key = template if isinstance(template, str) else repr(template)
    if key not in _template_support:
        def render(messages: list[dict[str, Any]]) -> str | None:
            try:
                return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
            except Exception:  # noqa: BLE001 - any refusal (jinja's raise_exception, a KeyError) means "not read"
                return None

        call = {"role": "assistant", "content": "", "tool_calls": [{"id": "call_0", "type": "function", "function": {
            "name": _PROBE_NAME, "arguments": "{}"}}]}
        with_call = render([{"role": "user", "content": "q"}, call])
        head = [{"role": "user", "content": "q"}, call]
        as_role = {role: render([*head, {"role": role, "content": _PROBE_RESULT,
                                         **({"tool_call_id": "call_0"} if role == "tool" else {})}])
                   for role in ("tool", "user", "assistant")}
        reads_calls = with_call is not None and _PROBE_NAME in with_call
        reads_tool = as_role["tool"] is not None and _PROBE_RESULT in as_role["tool"] and \
            as_role["tool"] not in (as_role["user"], as_role["assistant"])
        _template_support[key] = (reads_calls, reads_tool)
    return _template_support[key]


def messages_for_template(tokenizer: Any, messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation as the chat template can render it. An assistant message's `tool_calls`
    and `tool` messages go to a template that reads them as they are; for one that does not
    (`template_tool_support`: it would drop them, or render a tool's result as an assistant's
    turn), they are written in the form remask's tool grammar generates (Hermes' convention):
    each call appended to the assistant's content as `<tool_call>{"name": ..., "arguments": {...}}`
    (compact JSON; arguments that are not JSON kept as a string), and a tool message becomes a
    `user` message `<tool_response>{content}</tool_response>`. Nothing is dropped."""
    if not any(m.get("tool_calls") or m.get("role") == "tool" for m in messages):
        return list(messages)
    reads_calls, reads_tool = template_tool_support(tokenizer)
    out = []
    for message in messages:
        message = dict(message)
        if message.get("tool_calls") and not reads_calls:
            calls = []
            for call in message.pop("tool_calls"):
                function = call.get("function") or {}
                arguments = function.get("arguments")
                try:
                    arguments = _json.loads(arguments) if isinstance(arguments, str) else arguments
                except ValueError:
                    pass
                calls.append(TOOL_CALL_TAG + _json.dumps({"name": function.get("name"), "arguments": arguments},
                                                         separators=(",", ":"), ensure_ascii=False))
            message["content"] = (message.get("content") or "") + "".join(calls)
        if message.get("role") == "tool" and not reads_tool:
            message = {"role": "user", "content": f"{TOOL_RESPONSE_TAGS[0]}{message.get('content') or ''}"
                                                  f"{TOOL_RESPONSE_TAGS[1]}"}
        out.append(message)
    return out


def _tool_error(field: str, message: str) -> StructuredOutputsError:
    return StructuredOutputsError(field, f"{field}: {message}" if not message.startswith(field) else message)


def _rebase_refs(schema: Any, prefix: str) -> tuple[Any, dict[str, Any]]:
    """A tool's parameters schema with its local definitions (`$defs` / `definitions`, and the
    root itself for `"$ref": "#"`) renamed under `prefix`, so several tools' schemas can sit in one
    document (`{"$defs": {...}, "anyOf": [...]}`): (the schema, its definitions)."""
    defs: dict[str, Any] = {}
    for key in ("$defs", "definitions"):
        if isinstance(schema.get(key), dict):
            for name, sub in schema[key].items():
                defs[f"{prefix}{name}"] = sub

    def rewrite(node: Any) -> Any:
        if isinstance(node, dict):
            out = {}
            for k, v in node.items():
                if k in ("$defs", "definitions") and node is schema:
                    continue
                if k == "$ref" and isinstance(v, str):
                    if v == "#":
                        v = f"#/$defs/{prefix}_root"
                        defs.setdefault(f"{prefix}_root", None)
                    else:
                        for head in ("#/$defs/", "#/definitions/"):
                            if v.startswith(head):
                                v = f"#/$defs/{prefix}{v[len(head):]}"
                out[k] = rewrite(v)
            return out
        if isinstance(node, list):
            return [rewrite(v) for v in node]
        return node

    body = rewrite(schema)
    defs = {name: (body if sub is None else rewrite(sub)) for name, sub in defs.items()}
    return body, defs


def _call_schema(tools: Sequence[tuple[str, Any]]) -> dict[str, Any]:
    """`{"name": const, "arguments": parameters}` for each tool, as one JSON Schema (`anyOf`)."""
    options, defs = [], {}
    for i, (name, params) in enumerate(tools):
        body, own = _rebase_refs(params, f"t{i}_")
        defs.update(own)
        options.append({"type": "object", "properties": {"name": {"const": name}, "arguments": body},
                        "required": ["name", "arguments"], "additionalProperties": False})
    schema: dict[str, Any] = options[0] if len(options) == 1 else {"anyOf": options}
    if defs:
        schema = {**schema, "$defs": defs}
    return schema


def tool_call_spec(tools: Any, tool_choice: Any, parallel_tool_calls: Any = None,
                   disable_any_whitespace: bool = True) -> ToolCallSpec | None:
    """OpenAI's `tools` (`[{"type": "function", "function": {"name", "description", "parameters",
    "strict"}}]`) and `tool_choice` (`"none"`, `"auto"` (the default with tools), `"required"`, or
    `{"type": "function", "function": {"name": ...}}`) checked and turned into a `ToolCallSpec`
    (None when neither is given). A bad value raises `StructuredOutputsError` whose `field` (and
    message's start) is `tools…` or `tool_choice`. `parallel_tool_calls` (true / false; OpenAI's
    default true): whether a `required` / `auto` answer may hold several calls (a named
    `tool_choice` is one call either way)."""
    if tools is None:
        if tool_choice not in (None, "none"):
            raise _tool_error("tool_choice", f"tool_choice {tool_choice!r} needs tools")
        return None
    if parallel_tool_calls not in (None, True, False):
        raise _tool_error("parallel_tool_calls", f"parallel_tool_calls must be true or false, got {parallel_tool_calls!r}")
    if not isinstance(tools, list) or not tools:
        raise _tool_error("tools", "tools must be a non-empty list of {\"type\": \"function\", \"function\": {...}}")
    if len(tools) > MAX_TOOLS:
        raise _tool_error("tools", f"{len(tools)} tools; at most {MAX_TOOLS}")
    table: list[tuple[str, Any]] = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise _tool_error("tools", f"{where}: must be {{\"type\": \"function\", \"function\": {{\"name\", "
                                       f"\"parameters\", ...}}}}, got {tool!r}"[:400])
        extra = sorted(set(tool) - {"type", "function"})
        if extra:
            raise _tool_error("tools", f"{where}: unknown fields {extra}")
        function = tool["function"]
        extra = sorted(set(function) - {"name", "description", "parameters", "strict"})
        if extra:
            raise _tool_error("tools", f"{where}.function: unknown fields {extra}")
        name = function.get("name")
        if not isinstance(name, str) or not _TOOL_NAME.fullmatch(name):
            raise _tool_error("tools", f"{where}.function.name: 1 to 64 letters, digits, '_' or '-', got {name!r}")
        if any(name == seen for seen, _ in table):
            raise _tool_error("tools", f"{where}.function.name: {name!r} is listed twice")
        if function.get("description") is not None and not isinstance(function["description"], str):
            raise _tool_error("tools", f"{where}.function.description must be a str")
        if function.get("strict") not in (None, True, False):
            raise _tool_error("tools", f"{where}.function.strict must be true or false")
        params = function.get("parameters")
        if params is None:
            params = {"type": "object", "properties": {}, "additionalProperties": False}
        try:
            checked = StructuredOutputsParams(json=params, disable_any_whitespace=disable_any_whitespace)
        except StructuredOutputsError as err:
            raise _tool_error("tools", f"{where}.function.parameters: {str(err).split(': ', 1)[-1]}") from None
        table.append((name, checked.json))
    if tool_choice is None:
        tool_choice = "auto"
    if tool_choice == "none":
        return ToolCallSpec("none", tuple(table))
    if isinstance(tool_choice, dict):
        function = tool_choice.get("function")
        if tool_choice.get("type") != "function" or not isinstance(function, dict) or set(tool_choice) != {
                "type", "function"} or set(function) != {"name"}:
            raise _tool_error("tool_choice", "tool_choice must be 'none', 'auto', 'required' or "
                                             "{\"type\": \"function\", \"function\": {\"name\": ...}}")
        name = function["name"]
        params = dict(table).get(name) if isinstance(name, str) else None
        if params is None:
            raise _tool_error("tool_choice", f"tool_choice names the function {name!r}, which is not in tools "
                                             f"({[n for n, _ in table]})")
        return ToolCallSpec("named", tuple(table), name,
                            StructuredOutputsParams(json=params, disable_any_whitespace=disable_any_whitespace))
    if tool_choice not in ("required", "auto"):
        raise _tool_error("tool_choice", f"tool_choice must be 'none', 'auto', 'required' or {{\"type\": \"function\", "
                                         f"\"function\": {{\"name\": ...}}}}, got {tool_choice!r}")
    parallel = parallel_tool_calls is not False
    schema = _call_schema(table)
    schema["x-guidance"] = {"whitespace_flexible": not disable_any_whitespace}
    calls = "call+" if parallel else "call"
    start = calls if tool_choice == "required" else f"TEXT | {calls}"
    text = f"TEXT: /(.|\\n)+/ & ~/{_lark_regex_literal(TOOL_CALL_TAG)}(.|\\n)*/\n" if tool_choice == "auto" else ""
    grammar = f"start: {start}\n{text}call: {_json.dumps(TOOL_CALL_TAG)} %json {_json.dumps(schema)}\n"
    try:
        structure = StructuredOutputsParams(grammar=grammar)
    except StructuredOutputsError as err:
        raise _tool_error("tools", f"tools: {str(err).split(': ', 1)[-1]}") from None
    return ToolCallSpec(tool_choice, tuple(table), None, structure, parallel)


def _lark_regex_literal(text: str) -> str:
    import re

    return re.escape(text).replace("/", "\\/")
