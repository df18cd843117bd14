"""Chat messages: what environments, renderers and SFT data exchange.

A conversation is a list of ``Message``: ``system``, ``user`` and ``tool`` messages come from
the environment (never trained on), ``assistant`` messages are the model's turns. A message
converts to the plain dict a Hugging Face chat template reads (``to_dict``) and back
(``as_message``), so SFT data in the usual JSON form renders through the same path.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

ROLES = ("system", "user", "assistant", "tool")
"""The roles a message may have."""


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A tool call of an assistant message, as chat templates render it."""

    name: str
    """The tool's name."""
    arguments: str | Mapping[str, Any]
    """The call's arguments: a JSON object (a mapping) or the tool's raw input text."""

    def to_dict(self) -> dict[str, Any]:
        """The OpenAI / Hugging Face form ``{"type": "function", "function": {...}}``."""
        args = dict(self.arguments) if isinstance(self.arguments, Mapping) else self.arguments
        return {"type": "function", "function": {"name": self.name, "arguments": args}}


@dataclass(frozen=True, slots=True)
class Message:
    """One chat message."""

    role: str
    """``system``, ``user``, ``assistant`` (the model) or ``tool`` (a tool's output)."""
    content: str
    """The message's text (an assistant turn: the decoded text the model sampled)."""
    tool_calls: tuple[ToolCall, ...] = ()
    """Structured tool calls of an assistant message (templates render them after content)."""
    name: str | None = None
    """A tool message's tool name (templates that show it)."""

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"Message.role={self.role!r} is not one of {', '.join(ROLES)}")
        if not isinstance(self.content, str):
            raise TypeError(
                f"Message.content must be a str, got {type(self.content).__name__} "
                f"for a {self.role} message"
            )
        if self.tool_calls and self.role != "assistant":
            raise ValueError(f"Message.tool_calls are for assistant messages, not {self.role}")

    def to_dict(self) -> dict[str, Any]:
        """The dict a chat template reads (``tool_calls`` and ``name`` only when set)."""
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            out["tool_calls"] = [c.to_dict() for c in self.tool_calls]
        if self.name is not None:
            out["name"] = self.name
        return out


def as_message(message: Message | Mapping[str, Any]) -> Message:
    """``message`` as a ``Message`` (a dict with ``role``, ``content`` and optionally
    ``tool_calls`` in the OpenAI form and ``name``)."""
    if isinstance(message, Message):
        return message
    if not isinstance(message, Mapping) or "role" not in message:
        raise TypeError(f"a chat message is a Message or a dict with 'role', got {message!r}")
    calls = []
    for call in message.get("tool_calls") or ():
        fn = call.get("function", call)
        calls.append(ToolCall(fn["name"], fn.get("arguments", "")))
    return Message(message["role"], message.get("content") or "", tuple(calls), message.get("name"))
