"""The OpenAI request bodies the server accepts, and how they become `SamplingParams`.

Fields are OpenAI's (`/v1/completions`, `/v1/chat/completions`) plus remask's decoding settings
and vLLM's `ignore_eos` / `min_tokens` / `structured_outputs`, which the `openai` client sends
through `extra_body`. `response_format` (`json_object`, `json_schema`) and `structured_outputs`
become `SamplingParams.structured_outputs` (remask/structured.py); so do a chat request's `tools`
/ `tool_choice` (`remask.structured.tool_call_spec`: the call's grammar; `ChatCompletionRequest.tools_spec`
keeps it for the answer's `tool_calls`). `logprobs` (completions: an int; chat: `logprobs` /
`top_logprobs`) and `max_completion_tokens` (chat) become `SamplingParams.logprobs` / `max_tokens`.
Unknown fields are refused (400 naming them), and so are OpenAI fields remask does not implement
when they are set — nothing is silently ignored. Numbers and booleans are strict (`true` is no 1,
`1` no `true`, `"1"` neither): pydantic's lax mode would turn `max_tokens: true` into 1. Values are
then checked by `SamplingParams`, the validation layer `remask.generate` and `LLM` share.
"""
from __future__ import annotations

from typing import Annotated, Any, Callable, Literal

from pydantic import BaseModel, ConfigDict, PrivateAttr, Strict, StrictBool, StrictInt

from remask.diffusion.parts.checks import MAX_LOGPROBS, check_int
from remask.diffusion.parts.sparse import SparseConfig
from remask.engine import SamplingParams

# OpenAI fields remask does not implement: refused when set to anything but their default.
UNSUPPORTED = {"echo": False, "presence_penalty": 0.0,
               "frequency_penalty": 0.0, "logit_bias": None, "best_of": None, "suffix": None, "tools": None,
               "tool_choice": None}
# remask's settings, passed to SamplingParams as they are.
REMASK_FIELDS = ("top_k", "steps", "block_length", "threshold", "factor", "frechet_margin", "remasking", "use_cache",
                 "cfg_scale", "alg", "alg_temp", "eps", "early_stop", "stop_token_ids", "ignore_eos", "min_tokens")


# A JSON number where a float belongs: an int or a float, never a bool (strict mode keeps ints).
StrictNumber = Annotated[float, Strict()]


class UnsupportedParameter(ValueError):
    """OpenAI fields remask does not implement, set in a request (`names`: the fields)."""

    def __init__(self, names: list[str]) -> None:
        super().__init__(f"not supported by remask: {', '.join(names)}")
        self.names = names


class StreamOptions(BaseModel):
    """`include_usage` (OpenAI): a last chunk with no choices and the request's `usage`;
    `continuous_usage_stats` (vLLM's): `usage` so far in every chunk with choices too;
    `include_drafts` (remask): also send the provisional canvas after every denoising step, in
    chunks with no choices and a `draft` field."""

    model_config = ConfigDict(extra="forbid")
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False
    include_drafts: StrictBool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str
    max_tokens: StrictInt | None = None
    temperature: StrictNumber | None = None
    top_p: StrictNumber | None = None
    n: StrictInt = 1
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: StrictInt | None = None
    user: str | None = None
    # remask's: seconds after which the request is aborted (504), at most the server's request_timeout
    timeout: StrictNumber | None = None
    # OpenAI fields not implemented (refused when set)
    echo: Any = False
    presence_penalty: Any = 0.0
    frequency_penalty: Any = 0.0
    logit_bias: Any = None
    best_of: Any = None
    suffix: Any = None
    tools: Any = None
    tool_choice: Any = None
    # structured output: OpenAI's response_format, or vLLM's structured_outputs body field
    response_format: Any = None
    structured_outputs: Any = None
    # remask's decoding settings (the client's `extra_body`)
    top_k: StrictInt | None = None
    steps: StrictInt | None = None
    block_length: StrictInt | None = None
    threshold: StrictNumber | None = None
    factor: StrictNumber | None = None
    frechet_margin: StrictNumber | None = None
    remasking: str | None = None
    use_cache: str | dict[str, Any] | None = None   # a name, or a cache config {"name": "dkv", ...}
    # a decoder config {"name": "freedave", ...}, {"name": "sdar", ...}; APD's {"name": "apd", "verifier": <a served
    # autoregressive model's name>, ...}
    decoder: dict[str, Any] | None = None
    cfg_scale: StrictNumber | None = None
    alg: str | None = None
    alg_temp: StrictNumber | None = None
    eps: StrictNumber | None = None
    early_stop: StrictBool | None = None
    stop_token_ids: list[StrictInt] | None = None
    # vLLM's extra body fields; typed loosely so SamplingParams alone judges them (1 is no bool)
    ignore_eos: Any = None
    min_tokens: Any = None
    sparse: dict[str, Any] | None = None

    def unsupported(self) -> list[str]:
        return [name for name, default in UNSUPPORTED.items() if getattr(self, name) != default]

    def sampling_params(self, defaults: dict[str, Any] | None = None,
                        verifier: Callable[[str], Any] | None = None) -> SamplingParams:
        """The request's settings over the server's defaults for the model; `ValueError` naming
        the field when a value or a combination is not allowed. `verifier(name)`: the loaded model
        served under `name` (APD's `decoder.verifier`)."""
        unsupported = self.unsupported()
        if unsupported:
            raise UnsupportedParameter(unsupported)
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only with stream=true")
        logprobs = self.requested_logprobs()
        values: dict[str, Any] = dict(defaults or {})
        for name in ("temperature", "top_p", "seed", *REMASK_FIELDS):
            value = getattr(self, name)
            if value is not None:
                values[name] = value
        max_tokens = self.requested_max_tokens()
        if max_tokens is not None:
            values["max_tokens"] = max_tokens
        values["n"] = self.n
        if logprobs is not None:
            values["logprobs"] = logprobs
        if self.stop is not None:
            values["stop"] = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        if "stop_token_ids" in values:
            values["stop_token_ids"] = list(values["stop_token_ids"])
        if self.sparse is not None:
            try:
                values["sparse"] = SparseConfig(**self.sparse)
            except TypeError as err:     # an unknown field
                raise ValueError(f"sparse: {err}") from None
        if self.decoder is not None:   # SamplingParams builds the config (docs/decoders.md)
            values["decoder"] = dict(self.decoder)
            if self.decoder.get("name") == "apd" and "verifier" in self.decoder:   # a served model, by its name
                if verifier is None:
                    raise ValueError("decoder.verifier: no verifier can be served here")
                values["decoder"]["verifier"] = verifier(self.decoder["verifier"])
        structured = self.structured()
        if structured is not None:
            values["structured_outputs"] = structured
        return SamplingParams(**values)

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def requested_logprobs(self) -> int | None:
        """`SamplingParams.logprobs`: how many alternatives per token, None for no logprobs."""
        return None

    def structured(self) -> Any:
        """`response_format` (OpenAI) or `structured_outputs` (vLLM) as a `StructuredOutputsParams`,
        or None; a ValueError naming the field (`response_format…` / `structured_outputs…`)."""
        if self.response_format is None and self.structured_outputs is None:
            return None
        from remask.structured import StructuredOutputsParams

        if self.structured_outputs is not None:
            if self.response_format is not None and self.response_format != {"type": "text"}:
                raise ValueError("response_format: give response_format or structured_outputs, not both")
            return StructuredOutputsParams.from_json(self.structured_outputs)
        return StructuredOutputsParams.from_response_format(self.response_format)


class CompletionRequest(_Common):
    prompt: str | list[StrictInt]
    # OpenAI's legacy form: the number of alternatives per token (0: the sampled token's only)
    logprobs: StrictInt | None = None

    def requested_logprobs(self) -> int | None:
        return self.logprobs


class ContentPart(BaseModel):
    """One part of OpenAI's array form of `content` (`[{"type": "text", "text": ...}, ...]`, which
    the SDKs' helpers send). Other types (`image_url`, `input_audio`, `file`, …) are read only to be
    refused by name (`ChatMessage.text`), so their fields pass here."""

    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    """A chat message. Besides system / user / assistant text: an assistant message's `tool_calls`
    (OpenAI's shape; `content` may then be null) and a `tool` message (a call's result, with its
    `tool_call_id`), passed to the tokenizer's chat template as they are (a template that knows
    tools renders them; the tiny models' template reads `content` only)."""

    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    def text(self, where: str) -> str:
        """The message's text: `content` itself, or its text parts joined by newlines (as vLLM
        joins them); `ValueError` naming the part (`where`: "messages[i]") for any other part."""
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError(f"{where}.tool_calls: only an assistant message carries tool_calls")
        if self.tool_call_id is not None and self.role != "tool":
            raise ValueError(f"{where}.tool_call_id: only a tool message carries tool_call_id")
        if self.content is None:
            if self.role == "assistant" and self.tool_calls:
                return ""
            raise ValueError(f"{where}.content: required (null only in an assistant message with tool_calls)")
        if isinstance(self.content, str):
            return self.content
        texts = []
        for j, part in enumerate(self.content):
            if part.type != "text":
                raise ValueError(f"{where}.content[{j}]: content parts of type {part.type!r} are not supported "
                                 "(remask's models read text: only {'type': 'text', 'text': ...} parts)")
            if part.text is None:
                raise ValueError(f"{where}.content[{j}]: a text part needs its 'text'")
            texts.append(part.text)
        return "\n".join(texts)


class ChatCompletionRequest(_Common):
    """A chat request. `tools` / `tool_choice` / `parallel_tool_calls` (OpenAI's) are read here
    (the completions route refuses them): `structured()` returns the calls' structure
    (remask/structured.py, `tool_call_spec`; `parallel_tool_calls: false` holds it to one call),
    and `tools_spec` holds the checked spec the answer's `tool_calls` are read with."""

    messages: list[ChatMessage]
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = None
    parallel_tool_calls: Any = None
    _tools: Any = PrivateAttr(default=None)

    def unsupported(self) -> list[str]:
        return [name for name in super().unsupported() if name not in ("tools", "tool_choice")]

    @property
    def tools_spec(self) -> Any:
        """The request's `ToolCallSpec` (None without tools), once `structured()` has run."""
        return self._tools

    def structured(self) -> Any:
        if self.tools is None and self.tool_choice is None and self.parallel_tool_calls is None:
            return super().structured()
        from remask.structured import tool_call_spec

        spec = tool_call_spec(self.tools, self.tool_choice, self.parallel_tool_calls)
        self._tools = spec
        own = super().structured()
        if spec is None or spec.structure is None:
            return own
        if own is not None:
            raise ValueError(f"tool_choice: {spec.mode!r} holds the answer to a tool call; response_format / "
                             "structured_outputs only with tool_choice 'none'")
        return spec.structure

    def template_response_format(self) -> dict[str, Any] | None:
        """The JSON format asked for, in OpenAI's `response_format` shape, for the chat template
        (a template that reads `response_format` shows the model the schema: the zoo's chat
        models do): `response_format` json_schema / json_object as given, vLLM's
        `structured_outputs` json / json_object in the same shape; None otherwise (text, a regex,
        a grammar, choices). Read after `structured()` has checked the fields."""
        if isinstance(self.response_format, dict) and self.response_format.get("type") in ("json_schema",
                                                                                           "json_object"):
            return self.response_format
        if not isinstance(self.structured_outputs, dict):
            return None
        from remask.structured import StructuredOutputsParams

        return StructuredOutputsParams.from_json(self.structured_outputs).template_format()

    def requested_logprobs(self) -> int | None:
        """`logprobs: true` with `top_logprobs: k` alternatives (0 by default), as OpenAI."""
        if self.top_logprobs is not None:
            if not self.logprobs:
                raise ValueError("top_logprobs: only with logprobs: true")
            check_int("top_logprobs", self.top_logprobs, minimum=0, maximum=MAX_LOGPROBS)
        return (self.top_logprobs or 0) if self.logprobs else None

    def requested_max_tokens(self) -> int | None:
        if self.max_tokens is not None and self.max_completion_tokens is not None \
                and self.max_tokens != self.max_completion_tokens:
            raise ValueError("max_tokens and max_completion_tokens disagree: give one")
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
