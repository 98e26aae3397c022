"""``POST /tokenize`` and ``POST /detokenize`` (vLLM's extras), behind the same auth and admission as
the generation endpoints: a prompt or chat messages (rendered exactly as chat completions render
them) to token ids, and token ids to text."""

from __future__ import annotations

import functools
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.errors import APIError, record_of
from gateway.schemas import ChatCompletionRequest, ChatMessage, Tool, validation_error
from gateway.serving import Serving

_STRICT = ConfigDict(extra="forbid", strict=True)


class TokenizeRequest(BaseModel):
    """Exactly one of ``prompt`` and ``messages``."""

    model_config = _STRICT
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool | None = Field(None, description="default: true for a prompt, false for messages "
                                            "(the template writes them)")
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[Tool] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = _STRICT
    model: str | None = None
    tokens: list[int]
    skip_special_tokens: bool = False


async def _parse(serving: Serving, request: Request, model_cls: type[BaseModel]) -> Any:
    body = await serving.admit(request)
    try:
        req = model_cls.model_validate_json(body)
    except ValidationError as exc:
        raise validation_error(exc) from None
    serving.check_model(req.model)
    return req


async def tokenize(request: Request) -> Response:
    serving: Serving = request.state.serving
    req: TokenizeRequest = await _parse(serving, request, TokenizeRequest)
    if (req.prompt is None) == (req.messages is None):
        raise APIError(400, "give exactly one of prompt and messages", param="messages")
    tok = serving.tokenizer
    if req.prompt is not None:
        token_ids = await serving.workers.run(tok.encode, req.prompt, req.add_special_tokens is not False)
    else:
        chat = ChatCompletionRequest(messages=req.messages, tools=req.tools,
                                     chat_template_kwargs=req.chat_template_kwargs,
                                     add_generation_prompt=req.add_generation_prompt,
                                     continue_final_message=req.continue_final_message)
        chat.check_supported()
        prompt = await serving.workers.run(functools.partial(  # off the loop; cached per tenant
            tok.chat_prompt, chat.template_messages(), chat.tool_use.tools, chat.template_kwargs(),
            chat.add_generation_prompt, chat.continue_final_message, tenant=record_of(request).tenant))
        token_ids = prompt.token_ids
        if req.add_special_tokens:
            token_ids = await serving.workers.run(tok.encode, prompt.text, True)
    body: dict[str, Any] = {"count": len(token_ids), "max_model_len": serving.model.limits.max_model_len,
                            "tokens": token_ids}
    if req.return_token_strs:
        body["token_strs"] = [tok.token_text(t) for t in token_ids]
    return JSONResponse(body)


async def detokenize(request: Request) -> Response:
    serving: Serving = request.state.serving
    req: DetokenizeRequest = await _parse(serving, request, DetokenizeRequest)
    vocab = serving.model.limits.vocab_size
    bad = next((t for t in req.tokens if not 0 <= t < vocab), None)
    if bad is not None:
        raise APIError(400, f"token id {bad} is outside the vocabulary [0, {vocab})", param="tokens")
    return JSONResponse({"prompt": serving.tokenizer.decode(req.tokens, skip_special_tokens=req.skip_special_tokens)})
