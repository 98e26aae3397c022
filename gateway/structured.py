"""Structured output on the gateway side: the engine's grammar specs that a request asks for, their
validation with xgrammar before anything is sent, and the parsing of tool calls that a grammar forced.

A spec is built here (:class:`engine.protocol.StructuredOutput`) and checked by compiling it without a
tokenizer (:func:`check_grammars`, meant for a worker thread: a large schema takes milliseconds), so that a
bad schema, regex or grammar is a 400 naming its request field; the engine compiles it again with its
vocabulary. ``tool_choice: "required"`` becomes a JSON schema of a non-empty array of calls
``{"name", "arguments"}``, a named ``tool_choice`` the schema of that function's arguments (the output
*is* the arguments, as in vLLM); :class:`RequiredCalls` and :class:`NamedCall` turn those outputs into
tool calls with the interface of :class:`gateway.tool_parsers.ToolCallParser`.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

from engine.protocol import StructuredOutput, grammar_error_message
from gateway.errors import APIError
from gateway.tool_parsers import ParsedDelta, ToolCall, ToolCallDelta, new_call_id

# A function without parameters takes an empty object (as OpenAI reads a missing ``parameters``).
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
# xgrammar's errors start with "[time] /path/file.cc:line: " and sometimes "Check failed: (...) is false: "
_REF_PREFIXES = ("#/$defs/", "#/definitions/")
_CACHED_SPEC_CHARS = 64 * 1024  # larger specs are checked each time rather than kept


class Constraint(NamedTuple):
    """An output constraint, the request field it came from and how a 400 for it begins: ``what`` is
    followed by xgrammar's reason (``"response_format.json_schema.schema is not a valid JSON schema"``)."""

    structured: StructuredOutput
    param: str
    what: str


@dataclass(frozen=True, slots=True)
class ToolUse:
    """What a chat request asks of tool calling. ``tools`` are the OpenAI tool dicts that the chat
    template renders (none with ``tool_choice: "none"``); ``name`` is the function a named tool_choice
    forces; ``parallel`` is ``parallel_tool_calls``."""

    mode: Literal["none", "auto", "required", "named"]
    tools: tuple[dict[str, Any], ...] = ()
    name: str | None = None
    parallel: bool = True

    @property
    def names(self) -> list[str]:
        return [t["function"]["name"] for t in self.tools]

    def parameters(self, name: str) -> dict[str, Any]:
        tool = next(t for t in self.tools if t["function"]["name"] == name)
        return tool["function"].get("parameters") or NO_PARAMETERS

    def constraint(self) -> Constraint | None:
        """The grammar that enforces a required or named tool_choice; None for none and auto."""
        if self.mode == "named":
            schema = self.parameters(self.name)
        elif self.mode == "required":
            schema = required_calls_schema(self)
        else:
            return None
        return Constraint(StructuredOutput("json_schema", schema_text(schema)), "tool_choice",
                          "the schema of the calls that tool_choice enforces is not valid")

    def checks(self) -> list[Constraint]:
        """Each tool's parameters as a JSON schema to check."""
        return [Constraint(StructuredOutput("json_schema", schema_text(t["function"]["parameters"])), "tools",
                           f"tools[{i}].function.parameters is not a valid JSON schema")
                for i, t in enumerate(self.tools) if "parameters" in t["function"]]


def schema_text(schema: Any) -> str:
    """A JSON schema as the spec text the engine compiles (compact, key order kept)."""
    return json.dumps(schema, ensure_ascii=False, separators=(",", ":"))


def required_calls_schema(tools: ToolUse) -> dict[str, Any]:
    """A non-empty array of ``{"name": const, "arguments": schema}``, any of the tools: at most one
    item without parallel calls, else at most one per tool offered (a bound: unbounded, a small model
    at temperature 0 repeats its call until max_tokens). Each tool's ``$defs`` move to the root under
    ``<name>.``, its ``$ref``\\s with them: refs resolve against the document root, which is no longer
    the tool's."""
    defs: dict[str, Any] = {}
    items = []
    for name in tools.names:
        parameters = _hoist_defs(tools.parameters(name), f"{name}.", defs)
        items.append({"type": "object", "properties": {"name": {"const": name}, "arguments": parameters},
                      "required": ["name", "arguments"]})
    schema: dict[str, Any] = {"type": "array", "items": {"anyOf": items}, "minItems": 1,
                              "maxItems": len(items) if tools.parallel else 1}
    if defs:
        schema["$defs"] = defs
    return schema


def _hoist_defs(schema: dict[str, Any], prefix: str, defs: dict[str, Any]) -> dict[str, Any]:
    local = {**schema.get("definitions", {}), **schema.get("$defs", {})}
    if not local:
        return schema

    def move(node: Any) -> Any:
        if isinstance(node, list):
            return [move(x) for x in node]
        if not isinstance(node, dict):
            return node
        out = {k: move(v) for k, v in node.items()}
        ref = out.get("$ref")
        if isinstance(ref, str):
            for p in _REF_PREFIXES:
                if ref.startswith(p):
                    out["$ref"] = "#/$defs/" + prefix + ref[len(p):]
        return out

    for key, value in local.items():
        defs[prefix + key] = move(value)
    return move({k: v for k, v in schema.items() if k not in ("$defs", "definitions")})


def check_grammars(checks: Sequence[Constraint]) -> None:
    """Raise a 400 for the first spec that xgrammar cannot compile. Blocking (run it in a worker)."""
    for check in checks:
        error = _grammar_error(check.structured.kind, check.structured.spec)
        if error is not None:
            raise APIError(400, f"{check.what}: {error}", param=check.param)


def _grammar_error(kind: str, spec: str) -> str | None:
    """Why the spec does not compile, or None; cached but for huge specs: agents resend theirs."""
    return _compile_error(kind, spec) if len(spec) > _CACHED_SPEC_CHARS else _cached_compile_error(kind, spec)


def _compile_error(kind: str, spec: str) -> str | None:
    """xgrammar's reason (its first line, without the source location) or None."""
    import xgrammar as xgr  # on first use: it imports torch, which the gateway otherwise never loads

    compile_spec = {"json_schema": xgr.Grammar.from_json_schema, "regex": xgr.Grammar.from_regex,
                    "grammar": xgr.Grammar.from_ebnf}.get(kind)
    if compile_spec is None:  # json_object and choice need no compiling to be known valid
        return None
    try:
        compile_spec(spec)
    except (RuntimeError, ValueError, TypeError) as exc:
        return grammar_error_message(exc)
    return None


_cached_compile_error = functools.lru_cache(maxsize=1024)(_compile_error)


class NamedCall:
    """Output constrained to one function's arguments: one call, its arguments streamed as they come
    (the raw text, also in the whole call, so that streamed and non-streamed calls are alike)."""

    def __init__(self, name: str):
        self.id = new_call_id()
        self.name = name
        self._arguments: list[str] = []
        self._started = False

    def feed(self, text: str) -> ParsedDelta:
        if not text:
            return ParsedDelta()
        self._arguments.append(text)
        if self._started:
            return ParsedDelta(tool_calls=(ToolCallDelta(0, arguments=text),))
        self._started = True
        return ParsedDelta(tool_calls=(ToolCallDelta(0, self.id, self.name, text),))

    def finish(self) -> ParsedDelta:
        if self._started:
            return ParsedDelta()
        self._started = True  # an empty output is still the call the request forced
        return ParsedDelta(tool_calls=(ToolCallDelta(0, self.id, self.name),))

    @property
    def calls(self) -> list[ToolCall]:
        return [ToolCall(self.id, self.name, "".join(self._arguments))] if self._started else []


class RequiredCalls:
    """Output constrained to a JSON array of ``{"name", "arguments"}``: its calls are known when the
    array is complete, at the end; an output that is not such an array (cut by max_tokens) is content."""

    def __init__(self) -> None:
        self._text: list[str] = []
        self._calls: list[ToolCall] = []

    def feed(self, text: str) -> ParsedDelta:
        self._text.append(text)
        return ParsedDelta()

    def finish(self) -> ParsedDelta:
        text = "".join(self._text)
        try:
            items = json.loads(text)
            calls = [ToolCall(new_call_id(), item["name"], json.dumps(item["arguments"], ensure_ascii=False))
                     for item in items]
        except (ValueError, TypeError, KeyError):
            return ParsedDelta(text)
        if not calls or not all(isinstance(c.name, str) for c in calls):
            return ParsedDelta(text)
        self._calls = calls
        return ParsedDelta(tool_calls=tuple(ToolCallDelta(i, c.id, c.name, c.arguments) for i, c in enumerate(calls)))

    @property
    def calls(self) -> list[ToolCall]:
        return list(self._calls)
