"""
The simulator playing an agent's model: a tool call when the prompt asks
for one, and an answer that uses the tool's result once it comes back.

An agent's command line takes only a prompt, so the prompt drives it.  In a
chat request, among the messages after the last C{assistant} message:

  - a C{tool} message (the result of the call the simulator made) makes the
    answer the text C{The tool said: RESULT}, RESULT being the first
    L{QUOTE_CHARS} characters of the tool messages' contents joined by
    newlines;
  - otherwise, a line C{sim: call NAME} or C{sim: call NAME {JSON}} in a
    C{user} message (the last such line counts) makes the answer a call of
    the tool NAME with the JSON object as its arguments (C{{}} without one),
    when the request's C{tools} offer a function of that name, with
    C{finish_reason} C{"tool_calls"}; when they offer none, or the
    arguments are not a JSON object, the answer is a text that says so,
    with C{"stop"}.

Any other request gets the simulator's usual generated text.  The shapes
follow vLLM's chat completions (its C{serving_chat} and tool parsers): a
non-streamed answer carries C{message.tool_calls} of C{{"id", "type":
"function", "function": {"name", "arguments"}}} with C{content} null; a
stream sends the role chunk, then a delta C{{"tool_calls": [{"id", "type",
"index": 0, "function": {"name"}}]}}, then the arguments in pieces as
C{{"tool_calls": [{"index": 0, "function": {"arguments"}}]}}, then an empty
delta with the finish reason.  Each piece (a word with the white space
before it) is one token of the answer.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass

QUOTE_CHARS = 400
"""
Characters of a tool's result that the answer after it quotes.
"""

_CALL = re.compile(r"^\s*sim: call\s+(\S+?)\s*(\{.*\})?\s*$")
_PIECE = re.compile(r"\s*\S+\s*$|\s*\S+")


@dataclass(frozen=True, slots=True)
class Script:
    """
    A scripted answer: a text, or a call of one tool.

    @ivar text: the answer's text, or None for a tool call.
    @ivar tool: the called tool's name, or None for a text.
    @ivar arguments: the call's arguments as a JSON object's text.
    """

    text: str | None = None
    tool: str | None = None
    arguments: str = "{}"

    @property
    def finish_reason(self) -> str:
        """
        C{"tool_calls"} for a call, C{"stop"} for a text.
        """
        return "stop" if self.tool is None else "tool_calls"

    def pieces(self) -> list[str]:
        """
        The answer's tokens: the words of the text or of the arguments,
        each with the white space before it (and the last with the white
        space after it), joining into the whole; at least one.
        """
        whole = self.arguments if self.text is None else self.text
        return _PIECE.findall(whole) or [""]

    @property
    def tokens(self) -> int:
        """
        Completion tokens: the pieces, and for a call one more for its name.
        """
        return len(self.pieces()) + (0 if self.tool is None else 1)


def _text(content: object) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(
            part["text"]
            for part in content
            if isinstance(part, dict) and isinstance(part.get("text"), str)
        )
    return ""


def _offered(tools: object) -> set[str]:
    names = set()
    if isinstance(tools, list):
        for tool in tools:
            function = tool.get("function") if isinstance(tool, dict) else None
            if isinstance(function, dict) and isinstance(function.get("name"), str):
                names.add(function["name"])
    return names


def _call(name: str, raw: str | None, tools: object) -> Script:
    if name not in _offered(tools):
        return Script(text=f"sim: this request offers no tool named {name}.")
    try:
        arguments = json.loads(raw) if raw else {}
    except ValueError:
        arguments = None
    if not isinstance(arguments, dict):
        return Script(text=f"sim: the arguments for {name} are not a JSON object.")
    return Script(tool=name, arguments=json.dumps(arguments, ensure_ascii=False))


def plan(messages: Sequence[object], tools: object) -> Script | None:
    """
    The scripted answer to a chat request, if its messages ask for one.

    @param messages: the request's C{messages}, already checked to be
        objects.
    @param tools: the request's C{tools}, unchecked.
    @return: the answer, or None for the usual generated text.
    """
    tail: list[dict[str, object]] = []
    for message in reversed(messages):
        if not isinstance(message, dict) or message.get("role") == "assistant":
            break
        tail.insert(0, message)
    results = [_text(m.get("content")) for m in tail if m.get("role") == "tool"]
    if results:
        return Script(text="The tool said: " + "\n".join(results)[:QUOTE_CHARS])
    found: Script | None = None
    for message in tail:
        if message.get("role") != "user":
            continue
        for line in _text(message.get("content")).splitlines():
            match = _CALL.match(line)
            if match is not None:
                found = _call(match.group(1), match.group(2), tools)
    return found


def _dumps(obj: object) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode(
        "utf-8", "surrogatepass"
    )


def full_message(script: Script, call_id: str) -> dict[str, object]:
    """
    The non-streamed answer's C{message}.

    @param call_id: the tool call's id.
    """
    if script.tool is None:
        return {"role": "assistant", "content": script.text}
    return {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": call_id,
                "type": "function",
                "function": {"name": script.tool, "arguments": script.arguments},
            }
        ],
    }


def stream_deltas(script: Script, call_id: str) -> list[dict[str, object]]:
    """
    The C{delta} of each token's chunk, in order: L{Script.tokens} of them.

    @param call_id: the tool call's id.
    """
    if script.tool is None:
        return [{"content": piece} for piece in script.pieces()]
    name: dict[str, object] = {
        "tool_calls": [
            {
                "id": call_id,
                "type": "function",
                "index": 0,
                "function": {"name": script.tool},
            }
        ]
    }
    return [name] + [
        {"tool_calls": [{"index": 0, "function": {"arguments": piece}}]}
        for piece in script.pieces()
    ]


def stream_chunks(
    head: dict[str, object],
    script: Script,
    call_id: str,
    usage: dict[str, int] | None,
) -> list[bytes]:
    """
    The streamed answer's events before C{[DONE]}: the role chunk, one
    chunk per token, the finish chunk and, when C{usage} is given, the usage
    chunk (then every other chunk carries C{"usage": null}).

    @param head: the fields every chunk starts with (C{id}, C{object},
        C{created}, C{model}).
    @param call_id: the tool call's id.
    @param usage: the usage object, or None when not asked for.
    """
    deltas: list[dict[str, object]] = [{"role": "assistant", "content": ""}]
    deltas += stream_deltas(script, call_id)
    events = []
    for i, delta in enumerate([*deltas, {}]):
        last = i == len(deltas)
        choice = {
            "index": 0,
            "delta": delta,
            "logprobs": None,
            "finish_reason": script.finish_reason if last else None,
        }
        chunk: dict[str, object] = {**head, "choices": [choice]}
        if usage is not None:
            chunk["usage"] = None
        events.append(b"data: " + _dumps(chunk) + b"\n\n")
    if usage is not None:
        counts = _dumps({**head, "choices": [], "usage": usage})
        events.append(b"data: " + counts + b"\n\n")
    return events
