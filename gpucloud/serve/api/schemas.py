"""Request bodies of the OpenAI API, validated with pydantic.

Unknown fields are rejected with a message that names them, as OpenAI does. Beyond OpenAI's
fields, requests accept the engine's extra sampling knobs (`top_k`, `min_p`,
`repetition_penalty`, `min_tokens`, `ignore_eos`, `stop_token_ids`, ...) under the names
vLLM uses, so `extra_body=` in the openai client reaches them. Responses are plain dicts
built in `protocol.py`: they are written once per token when streaming.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from gpucloud.serve.params import MAX_ID, MAX_SEED

TokenId = Annotated[int, Field(ge=0, le=MAX_ID)]
Prompt = str | list[str] | list[TokenId] | list[list[TokenId]]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    """OpenAI's `response_format.json_schema`. Every answer follows the schema whatever
    `strict` says (the grammar is the schema)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    json_schema: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsField(BaseModel):
    """vLLM's `structured_outputs` extension, for the JSON kinds (`json`: a schema)."""

    model_config = ConfigDict(extra="forbid")
    json_: dict[str, Any] | str | None = Field(None, alias="json")
    json_object: bool | None = None


class SamplingFields(BaseModel):
    """Fields shared by completions and chat completions. Bounds keep every value within
    what the engine's tensors and generators take: a request is refused here, not in the
    engine's loop."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    model: str
    n: int = Field(1, ge=1, le=128)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # Engine extras (vLLM's names).
    top_k: int = Field(0, ge=-1, le=MAX_ID)
    min_p: float = Field(0.0, ge=0, le=1)
    repetition_penalty: float = Field(1.0, gt=0)
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # vLLM's: lower runs first; the engine pauses worse requests while it waits for its
    # first token. The control plane's gateway sets it from the API key's priority class.
    priority: int = Field(0, ge=-MAX_ID, le=MAX_ID)
    # Structured output: OpenAI's response_format, or vLLM's guided_json / structured_outputs.
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    structured_outputs: StructuredOutputsField | None = None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(SamplingFields):
    prompt: Prompt
    max_tokens: int | None = Field(16, ge=0)  # 0 only with echo: return or score the prompt
    logprobs: int | None = Field(None, ge=0, le=20)  # with echo: the prompt tokens' too
    echo: bool = False
    prompt_logprobs: int | None = Field(None, ge=0, le=20)  # vLLM's: per prompt token dicts


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    add_generation_prompt: bool = True


class LoadLoraAdapterRequest(BaseModel):
    """vLLM's `POST /v1/load_lora_adapter` body."""

    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoraAdapterRequest(BaseModel):
    """vLLM's `POST /v1/unload_lora_adapter` body (`lora_int_id` is accepted and unused)."""

    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None


class TokenizeRequest(BaseModel):
    """vLLM's `POST /tokenize` body for a prompt (its chat form, `messages`, is not served).
    `model` is optional, as in vLLM: the served model and its adapters share one tokenizer.
    `priority` is accepted and unused: the control plane's gateway sets it on what it relays."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True  # the bos first, as completions put it
    return_token_strs: bool = False
    priority: int = Field(0, ge=-MAX_ID, le=MAX_ID)


class DetokenizeRequest(BaseModel):
    """vLLM's `POST /detokenize` body."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: list[TokenId]
    priority: int = Field(0, ge=-MAX_ID, le=MAX_ID)
