"""Structured output on the API side: ``response_format`` and forced ``tool_choice`` as grammars.

``response_format`` ``json_object`` constrains the reply to a JSON object, ``json_schema`` to
its schema (enforced whether or not ``strict`` is set); ``tool_choice`` ``"required"`` forces
one or more calls of the given tools, a named function exactly one call of it, written in the
served model's tool-call format (``tool_parsers.TOOL_PARSERS``), so the reply is parsed into
``tool_calls`` as an ``auto`` reply is, with each call's arguments constrained by its tool's
``parameters`` schema. The grammar compiles on the engine's grammar pool before the request is
queued (``compile_grammar``): the request waits for it, nothing else does; a schema the library
cannot compile is a 400 that names the field and the library's reason.
"""

from __future__ import annotations

from dataclasses import dataclass

from chatfleet.engine.api.tool_parsers import TOOL_PARSERS
from chatfleet.engine.structured.compiler import GrammarCompiler, GrammarError
from chatfleet.engine.structured.spec import ANY_JSON_OBJECT, GrammarSpec
from chatfleet.errors import InvalidRequestError
from chatfleet.protocol.openai import ChatCompletionRequest, ResponseFormat, SamplingFields, ToolDefinition


@dataclass(frozen=True)
class RequestGrammar:
    """A request's grammar and the request field it comes from (for error messages)."""

    spec: GrammarSpec
    param: str


def response_format_grammar(fmt: ResponseFormat | None) -> RequestGrammar | None:
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return RequestGrammar(ANY_JSON_OBJECT, "response_format")
    schema = fmt.json_schema.schema_ if fmt.json_schema is not None else None
    assert schema is not None  # the wire model requires json_schema and its schema for type json_schema
    return RequestGrammar(GrammarSpec.json_schema(schema), "response_format.json_schema.schema")


def forced_tools(req: ChatCompletionRequest) -> tuple[list[ToolDefinition], bool] | None:
    """The tools a reply must call and whether several calls are allowed; None when not forced."""
    choice = req.tool_choice
    if choice is None or choice in ("auto", "none"):
        return None
    tools = list(req.tools or ())
    if choice == "required":
        return tools, True
    assert not isinstance(choice, str)  # the wire model admits the three words or a named function
    name = choice.function.name
    named = [t for t in tools if t.function.name == name]
    if not named:
        raise InvalidRequestError(f"tool_choice names the function {name!r}, which is not among the request's"
                                  " tools", param="tool_choice")
    return named[:1], False


def request_grammar(req: SamplingFields, tool_parser: str) -> RequestGrammar | None:
    """The grammar a request's reply must follow, or None."""
    fmt = response_format_grammar(req.response_format)
    forced = forced_tools(req) if isinstance(req, ChatCompletionRequest) else None
    if forced is None:
        return fmt
    if fmt is not None:
        raise InvalidRequestError("response_format and a forced tool_choice cannot be combined: the reply is"
                                  " either a JSON document or tool calls", param="response_format")
    tools, several = forced
    return RequestGrammar(TOOL_PARSERS.make(tool_parser).grammar(
        [(t.function.name, t.function.parameters) for t in tools], several), "tools")


async def compile_grammar(compiler: GrammarCompiler | None, grammar: RequestGrammar | None) -> None:
    """Compile (or find cached) the request's grammar before it is queued; 400 if it cannot be."""
    if grammar is None:
        return
    if compiler is None:
        raise InvalidRequestError("structured output is not available on this engine (its tokenizer cannot"
                                  " build grammars)", param=grammar.param)
    try:
        await compiler.compile_async(grammar.spec)
    except GrammarError as exc:
        raise InvalidRequestError(f"{grammar.param} cannot be compiled to a grammar: {exc}",
                                  param=grammar.param) from None
