"""Conversations to tokens with a "trained on" mask: one path for chat SFT and multi-turn RL.

A conversation alternates environment text (system, user, tool messages and the template's
role headers) and assistant turns. A ``Renderer`` makes the tokens of each piece:

- ``continuation(history, new)``: the ids that follow ``history`` (empty, or ending with an
  assistant turn) when the environment adds ``new`` messages, up to and including the next
  generation prompt (``<|im_start|>assistant\\n``): never trained on;
- ``assistant_ids(history, message)``: the canonical ids of an assistant turn (its content
  and the stop token that ends it): trained on.

``render(messages)`` concatenates the pieces of a whole conversation (SFT). A rollout does
the same incrementally: the generator samples each assistant turn after the ids it was
shown, those sampled ids are appended verbatim (not re-tokenised from their text), and the
environment's next messages are appended as ``continuation(...)``. So the ids a trainer
recomputes log-probs on are exactly the ids the generator saw and produced, turn after turn,
and a conversation whose assistant turns were sampled as their canonical ids renders to the
same ids and mask either way.

Two renderers: ``ChatTemplateRenderer`` renders a Hugging Face Jinja chat template (as
``transformers``' ``apply_chat_template`` does, ``add_generation_prompt`` included) and
tokenises the text pieces; ``SimpleChatRenderer`` is a built-in template for tokenizers
without one (the byte-level tokenizer): role prefixes, and EOS ending each assistant turn.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from .messages import ROLES, Message, as_message
from .tokenizer import Tokenizer


@dataclass(frozen=True, slots=True)
class RenderedTokens:
    """A rendered conversation: token ids and which of them the model produced."""

    ids: list[int]
    """Token ids of the whole conversation."""
    mask: list[bool]
    """True on assistant tokens (content and stop token: trained on), False elsewhere."""


@runtime_checkable
class Renderer(Protocol):
    """Messages to token ids (see the module docstring)."""

    tokenizer: Tokenizer
    stop_token_ids: tuple[int, ...]
    """The ids that end an assistant turn (the generator's stop tokens)."""

    def continuation(
        self,
        history: Sequence[Message],
        new: Sequence[Message],
        *,
        add_generation_prompt: bool = True,
    ) -> list[int]:
        """Ids after ``history`` (empty or ending with an assistant turn) for ``new``
        environment messages, with the next turn's generation prompt."""
        ...

    def assistant_ids(self, history: Sequence[Message], message: Message) -> list[int]:
        """Canonical ids of assistant ``message`` after ``history``: content + stop token."""
        ...

    def render(
        self,
        messages: Sequence[Message | Mapping[str, Any]],
        *,
        add_generation_prompt: bool = False,
    ) -> RenderedTokens:
        """The whole conversation's ids and mask."""
        ...


class _Rendering(ABC):
    """``render`` from the two pieces, shared by every renderer (one path)."""

    @abstractmethod
    def continuation(
        self,
        history: Sequence[Message],
        new: Sequence[Message],
        *,
        add_generation_prompt: bool = True,
    ) -> list[int]: ...

    @abstractmethod
    def assistant_ids(self, history: Sequence[Message], message: Message) -> list[int]: ...

    def render(
        self,
        messages: Sequence[Message | Mapping[str, Any]],
        *,
        add_generation_prompt: bool = False,
    ) -> RenderedTokens:
        """The ids of ``messages`` and the mask of the assistant turns (content and stop
        token; role headers and what follows the stop token are not trained on)."""
        ids: list[int] = []
        mask: list[bool] = []
        history: list[Message] = []
        pending: list[Message] = []
        for message in map(as_message, messages):
            if message.role != "assistant":
                pending.append(message)
                continue
            env = self.continuation(history, pending, add_generation_prompt=True)
            history += pending
            turn = self.assistant_ids(history, message)
            history.append(message)
            pending = []
            ids += env + turn
            mask += [False] * len(env) + [True] * len(turn)
        tail = self.continuation(history, pending, add_generation_prompt=add_generation_prompt)
        return RenderedTokens(ids + tail, mask + [False] * len(tail))


def _check_history(history: Sequence[Message]) -> None:
    if history and history[-1].role != "assistant":
        raise ValueError(
            "continuation(history, new): history must be empty or end with an assistant turn "
            f"(the environment's messages come together in `new`), got a {history[-1].role!r} "
            "message last"
        )


_DEFAULT_ROLES = {
    "system": "system: ",
    "user": "user: ",
    "tool": "tool: ",
    "assistant": "assistant: ",
}


class SimpleChatRenderer(_Rendering):
    """A built-in template: ``BOS``, each environment message as ``prefix + content +
    separator``, the generation prompt ``prefix["assistant"]``, and each assistant turn as its
    content followed by ``EOS`` (the stop token).

    ``roles`` maps each role to its prefix (default ``"system: "``, ``"user: "``, ``"tool: "``,
    ``"assistant: "``). With empty prefixes and separator it is plain text: the layout of a
    pre-training document ``prompt + answer``.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        roles: Mapping[str, str] | None = None,
        separator: str = "\n",
        bos: bool = True,
    ) -> None:
        """``roles``: prefix of each role (missing roles keep the default); ``separator``:
        text after each environment message; ``bos``: start with ``tokenizer.bos_id``."""
        prefixes = {**_DEFAULT_ROLES, **(roles or {})}
        unknown = sorted(set(prefixes) - set(ROLES))
        if unknown:
            raise ValueError(f"SimpleChatRenderer roles {unknown} are not among {ROLES}")
        self.tokenizer, self.roles, self.separator, self.bos = tokenizer, prefixes, separator, bos
        self.stop_token_ids = (tokenizer.eos_id,)

    def continuation(
        self,
        history: Sequence[Message],
        new: Sequence[Message],
        *,
        add_generation_prompt: bool = True,
    ) -> list[int]:
        """``BOS`` (at the start), each message of ``new``, then the assistant prefix."""
        _check_history(history)
        text = "".join(self.roles[m.role] + m.content + self.separator for m in new)
        if add_generation_prompt:
            text += self.roles["assistant"]
        start = [self.tokenizer.bos_id] if self.bos and not history else []
        return start + (self.tokenizer.encode(text) if text else [])

    def assistant_ids(self, history: Sequence[Message], message: Message) -> list[int]:
        """The content's ids and ``EOS``."""
        if message.tool_calls:
            raise ValueError(
                "SimpleChatRenderer renders an assistant message's content only: write tool "
                "calls in the content, in the environment's own format"
            )
        return [*self.tokenizer.encode(message.content), self.tokenizer.eos_id]


class ChatTemplateRenderer(_Rendering):
    """A Hugging Face Jinja chat template (``tokenizer_config.json``'s ``chat_template``),
    rendered as ``transformers`` does, then tokenised piece by piece.

    Each piece is the difference of two renderings: ``continuation(history, new)`` is the
    rendering of ``history + new`` (with the generation prompt) past the end of ``history``'s
    last stop token; an assistant turn is its rendering up to and including the stop token.
    So the template must render conversations incrementally (a rendering of the first ``k``
    messages is a prefix of a longer one's): a template that rewrites earlier turns (drops
    past reasoning, say) is refused with a ``ValueError`` when it happens.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        chat_template: str,
        *,
        special_tokens: Mapping[str, str] | None = None,
        stop_text: str | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        """``special_tokens``: the template's variables ``bos_token``, ``eos_token``, ...
        (``from_tokenizer_config`` reads them); ``stop_text``: the text of the token that ends
        an assistant turn (default: found by rendering a probe turn: the first token after
        its content); ``template_kwargs``: more variables (``tools``, ``enable_thinking``)."""
        if not isinstance(chat_template, str) or not chat_template.strip():
            raise ValueError(
                f"chat_template must be a non-empty Jinja string, got {chat_template!r}"
            )
        self.tokenizer = tokenizer
        self._template = _compile(chat_template)
        self._variables = {**(special_tokens or {}), **(template_kwargs or {})}
        self.stop_text = stop_text if stop_text is not None else self._probe_stop_text()
        stop_ids = tokenizer.encode(self.stop_text)
        if len(stop_ids) != 1:
            raise ValueError(
                f"stop_text={self.stop_text!r} is {len(stop_ids)} tokens {stop_ids}; the end of "
                "an assistant turn must be one token (the generator's stop token)"
            )
        self.stop_token_ids = (stop_ids[0],)

    @classmethod
    def from_tokenizer_config(
        cls, config: str | Path | Mapping[str, Any], tokenizer: Tokenizer, **kwargs: Any
    ) -> ChatTemplateRenderer:
        """From a ``tokenizer_config.json`` (a path, its folder, or the parsed dict): its
        ``chat_template`` (the ``default`` one of a list) and special tokens."""
        if not isinstance(config, Mapping):
            path = Path(config)
            path = path / "tokenizer_config.json" if path.is_dir() else path
            if not path.is_file():
                raise ValueError(f"tokenizer config {str(path)!r}: no such file")
            config = json.loads(path.read_text())
        template = config.get("chat_template")
        if isinstance(template, list):  # [{"name": ..., "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default")
        if not isinstance(template, str):
            raise ValueError("tokenizer config has no chat_template (a string or a 'default')")
        special = {}
        for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
            value = config.get(key)
            value = value.get("content") if isinstance(value, Mapping) else value
            if isinstance(value, str):
                special[key] = value
        return cls(tokenizer, template, special_tokens=special, **kwargs)

    def text(
        self, messages: Sequence[Message | Mapping[str, Any]], *, add_generation_prompt: bool
    ) -> str:
        """The template's rendering of ``messages`` (what ``apply_chat_template`` gives with
        ``tokenize=False``)."""
        dicts = [as_message(m).to_dict() for m in messages]
        return self._template.render(
            messages=dicts, add_generation_prompt=add_generation_prompt, **self._variables
        )

    def continuation(
        self,
        history: Sequence[Message],
        new: Sequence[Message],
        *,
        add_generation_prompt: bool = True,
    ) -> list[int]:
        """The ids of the rendering of ``history + new`` past ``history``'s last stop token."""
        _check_history(history)
        done = self._rendered_through_stop(history)
        full = self.text([*history, *new], add_generation_prompt=add_generation_prompt)
        self._check_prefix(done, full, len(history))
        rest = full[len(done) :]
        return self.tokenizer.encode(rest) if rest else []

    def assistant_ids(self, history: Sequence[Message], message: Message) -> list[int]:
        """The ids of the assistant turn's rendering after the generation prompt, through
        its stop token."""
        turn = self._assistant_text(history, message)
        return self.tokenizer.encode(turn)

    def _rendered_through_stop(self, history: Sequence[Message]) -> str:
        """The rendering of ``history`` up to its last assistant turn's stop token."""
        if not history:
            return ""
        before = self.text(history[:-1], add_generation_prompt=True)
        return before + self._assistant_text(history[:-1], history[-1])

    def _assistant_text(self, history: Sequence[Message], message: Message) -> str:
        prompt = self.text(history, add_generation_prompt=True)
        full = self.text([*history, message], add_generation_prompt=False)
        self._check_prefix(prompt, full, len(history))
        turn = full[len(prompt) :]
        end = turn.rfind(self.stop_text)
        if end < 0:
            raise ValueError(
                f"the chat template renders an assistant turn without its stop text "
                f"{self.stop_text!r}: {turn[-80:]!r}"
            )
        return turn[: end + len(self.stop_text)]

    @staticmethod
    def _check_prefix(prefix: str, full: str, k: int) -> None:
        if not full.startswith(prefix):
            at = next((i for i, (a, b) in enumerate(zip(prefix, full, strict=False)) if a != b), 0)
            raise ValueError(
                f"the chat template does not render incrementally: the rendering of the first "
                f"{k} messages is not a prefix of a longer conversation's (they differ at "
                f"character {at}: {prefix[at : at + 40]!r} vs {full[at : at + 40]!r}); tokens "
                "sampled in earlier turns would not be the tokens trained on"
            )

    def _probe_stop_text(self) -> str:
        sentinel = "\x00titan-rl-probe\x00"
        convo = [Message("user", "hi")]
        prompt = self.text(convo, add_generation_prompt=True)
        full = self.text([*convo, Message("assistant", sentinel)], add_generation_prompt=False)
        self._check_prefix(prompt, full, 1)
        after = full[full.rfind(sentinel) + len(sentinel) :]
        first = self.tokenizer.encode(after)[:1]
        for end in range(1, len(after) + 1):  # the text of the first token after the content
            if first and self.tokenizer.encode(after[:end]) == first:
                return after[:end]
        raise ValueError(
            "the chat template puts no token after an assistant turn's content "
            f"({after!r}): pass stop_text= (the text of the model's end-of-turn token)"
        )


def _compile(chat_template: str):
    """The template compiled in the sandboxed Jinja environment ``transformers`` uses (chat
    templates from a hub are untrusted): trim/lstrip blocks, ``loopcontrols``, its ``tojson``,
    ``raise_exception`` and ``strftime_now``, and ``{% generation %}`` blocks rendered as their
    body."""
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class _Generation(Extension):
        tags = {"generation"}  # noqa: RUF012 - jinja2 declares `tags: set[str]`

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(
                lineno
            )

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, loopcontrols]
    )
    env.filters["tojson"] = tojson
    env_globals: dict[str, Any] = env.globals  # typed by jinja2's defaults, holds anything
    env_globals["raise_exception"] = raise_exception
    env_globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)  # Llama 3.1's date
    return env.from_string(chat_template)
