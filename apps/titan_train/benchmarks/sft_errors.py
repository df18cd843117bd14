"""Where a chat SFT run's exact-match errors are: per question table of the ``facts`` corpus.

    uv run python apps/titan_train/benchmarks/sft_errors.py [--steps 500] [--conversations 400]
        [-- extra titan-train args]

Trains ``llama3_debug_sft`` for ``--steps`` (its schedule stretched to them) in this process,
then checks ``--conversations`` conversations of a corpus seed the run never saw, greedy and
teacher-forced: a question is right when every token of its reply and the reply's stop token
is the model's first choice (the recipe's ``answer_accuracy`` rule, per question). Prints the
share right per table (capitals, opposites, weekdays, sums) and per conversation.
"""

from __future__ import annotations

import argparse
import collections
import tempfile

import torch

UNSEEN_SEED = 99  # corpus seed of the checked conversations (training uses --training.seed)


def _table(question: str) -> str:
    for word, table in (("capital", "capitals"), ("opposite", "opposites"), ("day", "weekdays")):
        if word in question:
            return table
    return "sums"


def _spans(mask: list[bool]) -> list[tuple[int, int]]:
    """[start, end) of each run of trained tokens."""
    spans, start = [], None
    for i, m in enumerate([*mask, False]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            spans.append((start, i))
            start = None
    return spans


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--conversations", type=int, default=400)
    ap.add_argument("extra", nargs="*", help="titan-train arguments (after --)")
    args = ap.parse_args()

    from titan_train.cli import parse_config
    from titan_train.data.chat import chat_renderer
    from titan_train.data.chat_corpus import builtin_conversations
    from titan_train.data.tokenizers import build_tokenizer
    from titan_train.trainer import train

    with tempfile.TemporaryDirectory() as out:
        argv = ["--output-dir", out, "--training.steps", str(args.steps)]
        argv += ["--checkpoint.interval", "0", "--metrics.validate-every", "0", *args.extra]
        cfg = parse_config(argv, "llama3_debug_sft")
        model = train(cfg)["model"].eval()
    tokenizer = build_tokenizer(cfg.data.tokenizer)
    renderer = chat_renderer(tokenizer, "")
    conversation = builtin_conversations(cfg.data.chat_environment, UNSEEN_SEED)
    right: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
    whole = [0, 0]
    with torch.no_grad():
        for i in range(args.conversations):
            messages = conversation(i)
            rendered = renderer.render(messages)
            ids = torch.tensor(list(rendered.ids))
            predicted = model(ids[None, :-1]).argmax(-1)[0]
            targets, mask = ids[1:], list(rendered.mask)[1:]
            questions = [m.content for m in messages if m.role == "user"]
            ok_all = True
            for (a, b), question in zip(_spans(mask), questions, strict=True):
                ok = bool((predicted[a:b] == targets[a:b]).all())
                right[_table(question)][0] += ok
                right[_table(question)][1] += 1
                ok_all &= ok
            whole[0] += ok_all
            whole[1] += 1
    print(f"llama3_debug_sft after {args.steps} steps, {args.conversations} unseen conversations:")
    for table, (ok, n) in sorted(right.items()):
        print(f"  {table:9s} {ok / n:.3f} of {n} questions")
    print(f"  exact match per conversation: {whole[0] / whole[1]:.3f}")


if __name__ == "__main__":
    main()
