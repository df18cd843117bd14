"""Padding and trainer log-prob time: right-padded rows (``sequence_logprobs``) vs packed rows
(``packed_sequence_logprobs``) on batches of the search environment's episodes.

Episodes are played by a scripted policy that searches 0-3 times (random towns, so some
reads are useless) before answering: the spread of lengths an RL batch has. The batch is
``--prompts`` groups of ``--group`` episodes, rendered with the built-in chat template on the
byte tokenizer; the model is titan_models' llama3 ``debug`` flavour (fp32). Packed rows hold
at most ``--row-tokens`` tokens; ``align=32`` is the dense-mask (``sdpa``) backend's
bitwise setting.

    uv run python libs/titan_rl/benchmarks/packing.py --rounds 3 --threads 2
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

import titan_models
from titan_rl import (
    Message,
    SimpleChatRenderer,
    pack_rows,
    packed_sequence_logprobs,
    sequence_logprobs,
)
from titan_rl.envs import SearchEnv


class Bytes:
    bos_id, eos_id, pad_id = 256, 257, 258
    encode = staticmethod(lambda text: list(text.encode()))
    decode = staticmethod(lambda ids: bytes(i for i in ids if i < 256).decode(errors="replace"))


def episode(env: SearchEnv, seed: int, rng: random.Random) -> list[Message]:
    question, query, answer = env.problem(seed)
    convo = [Message("user", question)]
    for _ in range(rng.randint(0, 3)):
        q = query if rng.random() < 0.5 else rng.choice(env.towns)["town"] + " river"
        convo += [Message("assistant", f"<search>{q}</search>"), Message("tool", env.search(q))]
    return [*convo, Message("assistant", f"<answer>{answer}</answer>")]


def batch(num_prompts: int, group: int, seed: int = 0):
    env, renderer, rng = SearchEnv(), SimpleChatRenderer(Bytes()), random.Random(seed)
    prompts, rows = [], []
    for p in range(num_prompts):
        for _ in range(group):
            out = renderer.render(episode(env, p, rng))
            k = out.mask.index(True)
            prompts.append(out.ids[:k])
            rows.append((out.ids[k:], out.mask[k:]))
    T = max(len(ids) for ids, _ in rows)
    responses = torch.zeros(len(rows), T, dtype=torch.long)
    mask = torch.zeros(len(rows), T, dtype=torch.bool)
    for i, (ids, m) in enumerate(rows):
        responses[i, : len(ids)] = torch.tensor(ids)
        mask[i, : len(m)] = torch.tensor(m)
    return prompts, responses, mask


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--row-tokens", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    prompts, responses, mask = batch(args.prompts, args.group)
    lengths = pack_rows(prompts, responses, mask).lengths
    padded_positions = len(prompts) * int(lengths.max())
    print(
        f"{len(prompts)} episodes, {int(lengths.sum())} tokens, lengths {int(lengths.min())}"
        f"-{int(lengths.max())} (mean {float(lengths.float().mean()):.0f})"
    )
    model_cls, config = titan_models.get_model("llama3", "debug", vocab_size=264, num_layers=2)
    with torch.device("meta"):
        model = model_cls(config)
    model.init_weights(device="cpu", seed=0)

    def padded():
        return sequence_logprobs(model, prompts, responses, mask)

    def packed(align: int):
        return lambda: packed_sequence_logprobs(
            model, prompts, responses, mask, max_row_tokens=args.row_tokens, align=align
        )

    rows = [("right-padded rows (sequence_logprobs)", padded, padded_positions)]
    for align in (1, 32):
        p = pack_rows(prompts, responses, mask, max_row_tokens=args.row_tokens, align=align)
        rows.append(
            (
                f"packed, rows <= {args.row_tokens}, align={align}",
                packed(align),
                p.input_ids.numel(),
            )
        )
    print("| path | positions | padding | forward s (median) | vs padded |")
    print("|---|---:|---:|---:|---:|")
    base = None
    for name, fn, positions in rows:
        times = []
        with torch.no_grad():
            fn()  # warm-up
            for _ in range(args.rounds):
                start = time.perf_counter()
                fn()
                times.append(time.perf_counter() - start)
        t = statistics.median(times)
        base = base or t
        pad = 1 - int(lengths.sum()) / positions
        print(f"| {name} | {positions:,} | {pad:.1%} | {t:.3f} | {base / t:.2f}x |")


if __name__ == "__main__":
    main()
