"""Chat data: conversations rendered to token ids with a "trained on" mask (chat SFT).

A conversation is a list of messages (``role``, ``content``, optional ``tool_calls``), the
common ``messages`` layout of chat datasets. It is rendered by titan_rl's renderer — the same
path multi-turn RL renders its episodes with — so SFT and RL see the same tokens: a tokenizer
with a chat template (``tokenizer_config.json`` beside an HF ``tokenizer.json``) renders
through that template; the built-in byte tokenizer through ``titan_rl.SimpleChatRenderer``.
Only the assistant turns carry a loss unless ``train_on="all"``.

Conversations come from local json / jsonl / parquet files (HF ``datasets``, streamed), or
from a built-in corpus (``titan_train.data.chat_corpus``: generated ``digits`` tasks, or an RL
environment's demonstrations), offline, with answers that are learnable.

A sample longer than ``max_tokens`` (the sequence length) is truncated or dropped
(``overlong``) and counted (``ChatSource.overlong_count``).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from titan_train.data.file_records import FileRecords, in_validation

if TYPE_CHECKING:
    from titan_train.config import JobConfig
    from titan_train.data.tokenizers import Tokenizer

Document = tuple[list[int], list[bool]]
"""A rendered sample: token ids and, per token, whether it carries a loss."""


class ChatSource:
    """Rendered conversations of one split for one data-parallel rank (a ``PackedLoader``
    source: ``documents`` yields ``(ids, loss_mask)`` pairs)."""

    kind = "chat"

    def __init__(
        self,
        *,
        split: Literal["train", "validation"],
        renderer: Any,
        max_tokens: int,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        validation_fraction: float = 0.01,
        paths: tuple[str, ...] = (),
        messages_field: str = "messages",
        conversations: Callable[[int], Sequence[Any]] | None = None,
        train_on: Literal["assistant", "all"] = "assistant",
        overlong: Literal["truncate", "drop"] = "truncate",
        streaming: bool = False,
        shuffle_buffer: int = 10_000,
    ) -> None:
        """``renderer``: a ``titan_rl.Renderer``. Either ``paths`` (files of records with a
        ``messages_field`` list) or ``conversations`` (index -> messages, endless) is given.
        ``streaming``, ``shuffle_buffer``: how files are dealt to ranks and shuffled (see
        ``file_records``)."""
        if (not paths) == (conversations is None):
            raise ValueError("ChatSource: give data.paths or a built-in conversation source")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} must be in [0, world_size={world_size})")
        if train_on not in ("assistant", "all"):
            raise ValueError(f"data.chat_train_on={train_on!r} must be 'assistant' or 'all'")
        if overlong not in ("truncate", "drop"):
            raise ValueError(f"data.chat_overlong={overlong!r} must be 'truncate' or 'drop'")
        if streaming and not paths:
            raise ValueError(
                "data.streaming needs files to stream: data.chat_environment's demonstrations "
                "are generated; give data.paths instead"
            )
        self.split, self.renderer, self.max_tokens = split, renderer, max_tokens
        self.rank, self.world_size, self.seed = rank, world_size, seed
        self.validation_fraction, self.paths = validation_fraction, paths
        self.messages_field, self.conversations = messages_field, conversations
        self.train_on, self.overlong = train_on, overlong
        self.overlong_count = 0
        """Samples over ``max_tokens`` met so far (truncated or dropped)."""
        self.files: FileRecords | None = None
        """The files' records (with ``paths``)."""
        if paths:
            self.files = FileRecords(
                paths,
                seed=seed,
                shuffle_buffer=shuffle_buffer,
                rank=rank,
                world_size=world_size,
                streaming=streaming,
            )
            first = self.files.first()
            if first is None:
                raise ValueError(f"data.paths={list(paths)}: the files hold no records")
            self._messages(first)

    def documents(self, *, start: int = 0, epoch: int = 0) -> Iterator[Document]:
        """This rank's rendered samples of ``epoch`` from its ``start``-th one on."""
        if self.files is not None:
            records = self.files.split(self.split, self.validation_fraction, epoch=epoch)
            mine = ((self.files.name(rec), self._messages(rec)) for rec in records)
        else:  # endless and deterministic: epochs never end
            conversations = self.conversations
            assert conversations is not None, "ChatSource: __init__ requires paths or conversations"
            in_split = (
                (f"conversation {i}", conversations(i))
                for i in itertools.count()
                if in_validation(i, self.validation_fraction) == (self.split == "validation")
            )
            mine = itertools.islice(in_split, self.rank, None, self.world_size)
        for name, messages in itertools.islice(mine, start, None):
            doc = self._render(name, messages)
            # A dropped sample still counts as consumed: a resume skips it again.
            yield doc if doc is not None else ([], [])

    def _render(self, name: str, messages: Sequence[Any]) -> Document | None:
        try:
            rendered = self.renderer.render(messages)
        except (ValueError, TypeError, KeyError) as e:
            raise ValueError(f"data: {name} cannot be rendered: {e}") from None
        ids, mask = list(rendered.ids), list(rendered.mask)
        if self.train_on == "all":
            mask = [True] * len(ids)
        if len(ids) > self.max_tokens:
            self.overlong_count += 1
            if self.overlong == "drop":
                return None
            ids, mask = ids[: self.max_tokens], mask[: self.max_tokens]
        return ids, mask

    def _messages(self, record: Mapping[str, Any]) -> Sequence[Any]:
        value = record.get(self.messages_field)
        if not isinstance(value, list) or not all(isinstance(m, Mapping) for m in value):
            raise ValueError(
                f"data.messages_field={self.messages_field!r}: a record holds no list of "
                f"messages there (fields: {FileRecords.fields(record)})"
            )
        return value


def chat_sources(
    cfg: JobConfig, tokenizer: Tokenizer, *, dp_rank: int = 0, dp_size: int = 1
) -> tuple[ChatSource, ChatSource]:
    """The training and validation ``ChatSource`` of a job's ``data`` config (``source=chat``)
    for one data-parallel rank."""
    d = cfg.data
    conversations = None
    if d.chat_environment:
        from titan_train.data.chat_corpus import builtin_conversations

        conversations = builtin_conversations(d.chat_environment, cfg.training.seed)
    renderer = chat_renderer(tokenizer, d.tokenizer if d.tokenizer != "byte" else "")

    def source(split: Literal["train", "validation"]) -> ChatSource:
        return ChatSource(
            split=split,
            renderer=renderer,
            max_tokens=cfg.training.seq_len,
            rank=dp_rank,
            world_size=dp_size,
            seed=cfg.training.seed,
            validation_fraction=d.validation_fraction,
            paths=d.paths,
            messages_field=d.messages_field,
            conversations=conversations,
            train_on=d.chat_train_on,
            overlong=d.chat_overlong,
            streaming=d.streaming,
            shuffle_buffer=d.shuffle_buffer,
        )

    return source("train"), source("validation")


def chat_renderer(tokenizer: Any, tokenizer_path: str) -> Any:
    """The renderer of ``tokenizer``: its chat template when ``tokenizer_config.json`` beside
    the tokenizer has one, else titan_rl's built-in ``SimpleChatRenderer``."""
    import titan_rl

    if tokenizer_path:
        folder = Path(tokenizer_path)
        config = (folder if folder.is_dir() else folder.parent) / "tokenizer_config.json"
        if config.is_file():
            return titan_rl.ChatTemplateRenderer.from_tokenizer_config(config, tokenizer)
    return titan_rl.SimpleChatRenderer(tokenizer)
