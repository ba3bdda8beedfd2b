"""Train the built-in `default` model on ARC-AGI-2 training tasks (byte tokens, CPU, fixed seed).

A sequence is the workload's prompt format (``server/bench/arc.py``): few-shot pairs
``Input:\\n<grid>Output:\\n<grid>\\n``, then the query input, ``Output:\\n``, the answer grid, and
end-of-sequence. Loss covers every token except the blank line after each few-shot output grid:
that target is masked so that "an output grid is finished" is only ever taught as EOS (a causal
model cannot otherwise tell the last pair from the earlier ones). The last 10% of tasks by sorted
file name are held out and never read here. Sequences longer than --max-len drop leading pairs.

Epoch 0 is the tasks as they are (test inputs as queries, train pairs in order); later epochs
augment: a random pair is the query, pairs are shuffled, colours 1-9 permuted, and the grids
rotated/reflected, all from one seeded generator.

    python -m tools.train_default                           # the first run (then --init continuations:
                                                            # docs/design/builtin-model.md lists them)
    python -m tools.train_default --measure                 # tokens/s of candidate sizes
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared/data/arc-agi-2/training"
OUT = ROOT / "server/models/weights/default"
RESULTS = ROOT / "benchmarks/out"  # run outputs (git-ignored); docs cite benchmarks/results/
BOS, EOS, PAD, IGNORE = 256, 257, 258, -100
NEWLINE = ord("\n")
SIZES = {  # hidden, layers, heads, kv heads, intermediate
    "s": (192, 4, 3, 1, 512),
    "m": (256, 4, 4, 2, 704),
    "l": (256, 6, 4, 2, 704),
}


def split_tasks(data: Path = DATA) -> tuple[list[tuple[str, dict]], list[tuple[str, dict]]]:
    """(train, held-out) lists of (task id, task): held out = the last 10% by sorted file name."""
    files = sorted(data.glob("*.json"))
    if not files:
        raise SystemExit(f"no ARC tasks under {data}")
    tasks = [(f.stem, json.loads(f.read_text())) for f in files]
    held = len(tasks) // 10
    return tasks[:-held], tasks[-held:]


def grid_text(grid: list[list[int]]) -> str:
    return "".join("".join(str(c) for c in row) + "\n" for row in grid)


def encode(shots: list[dict], query: dict, max_len: int) -> tuple[list[int], list[int]] | None:
    """(input ids, labels) for one sequence, dropping leading shots to fit; None if the query cannot."""

    def pair_ids(pair: dict, last: bool) -> tuple[list[int], list[int]]:
        text = "Input:\n" + grid_text(pair["input"]) + "Output:\n" + grid_text(pair["output"])
        ids = list(text.encode())
        if last:
            return ids + [EOS], ids + [EOS]
        return ids + [ord("\n")], ids + [IGNORE]  # the separator is never a target (see docstring)

    parts = [pair_ids(s, False) for s in shots] + [pair_ids(query, True)]
    while parts and 1 + sum(len(p[0]) for p in parts) > max_len:
        if len(parts) == 1:
            return None
        parts.pop(0)
    ids = [BOS] + [t for p in parts for t in p[0]]
    labels = [t for p in parts for t in p[1]]  # labels[i] is the target after ids[i]
    return ids[:-1], labels


def _transform(grid: list[list[int]], k: int, colours: list[int]) -> list[list[int]]:
    g = [[colours[c] for c in row] for row in grid]
    if k & 4:
        g = [list(r) for r in zip(*g, strict=True)]  # transpose
    for _ in range(k & 3):
        g = [list(r) for r in zip(*g[::-1], strict=True)]  # rotate 90 degrees clockwise
    return g


def synthetic_task(rng: random.Random) -> list[dict]:
    """Grids under one simple rule (copy, flip, transpose, rotate, recolour, scale x2): pairs to learn grid shape."""
    rule = rng.randrange(7)
    colours = [0, *rng.sample(range(1, 10), 9)]
    h, w = rng.randint(1, 15), rng.randint(1, 15)
    if rule == 6:
        h, w = (h + 1) // 2, (w + 1) // 2

    def out(g: list[list[int]]) -> list[list[int]]:
        if rule == 1:
            return [row[::-1] for row in g]
        if rule == 2:
            return g[::-1]
        if rule == 3:
            return [list(r) for r in zip(*g, strict=True)]
        if rule == 4:
            return [row[::-1] for row in g[::-1]]
        if rule == 5:
            return [[colours[c] for c in row] for row in g]
        if rule == 6:
            return [[c for c in row for _ in (0, 1)] for row in g for _ in (0, 1)]
        return [list(row) for row in g]

    pairs = []
    for _ in range(rng.randint(3, 5)):
        hh, ww = max(1, h + rng.randint(-1, 1)), max(1, w + rng.randint(-1, 1))
        g = [[rng.randint(1, 9) if rng.random() < 0.4 else 0 for _ in range(ww)] for _ in range(hh)]
        pairs.append({"input": g, "output": out(g)})
    return pairs


def epoch_sequences(
    tasks: list[tuple[str, dict]], epoch: int, rng: random.Random, max_len: int, synthetic: int = 0
) -> list[tuple[list[int], list[int]]]:
    """One sequence per test input (epoch 0) or per task (later epochs, augmented), + synthetic ones."""
    seqs = []
    for _ in range(synthetic):
        pairs = synthetic_task(rng)
        seqs.append(encode(pairs[1:], pairs[0], max_len))
    for _, task in tasks:
        if epoch == 0:
            for test in task["test"]:
                seq = encode(task["train"], test, max_len)
                if seq:
                    seqs.append(seq)
            continue
        colours = [0, *rng.sample(range(1, 10), 9)]
        k = rng.randrange(8)
        pairs = [
            {
                "input": _transform(p["input"], k, colours),
                "output": _transform(p["output"], k, colours),
            }
            for p in task["train"] + task["test"]
        ]
        rng.shuffle(pairs)
        seq = encode(pairs[1:], pairs[0], max_len)
        if seq:
            seqs.append(seq)
    return seqs


def batches(
    tasks: list[tuple[str, dict]],
    rng: random.Random,
    max_len: int,
    budget: int,
    epoch: int = 0,
    synthetic: int = 0,
) -> object:
    """Endless padded batches (ids, labels) of about `budget` tokens; similar lengths together."""
    while True:
        seqs = epoch_sequences(tasks, epoch, rng, max_len, synthetic)
        rng.shuffle(seqs)
        groups = []
        for start in range(0, len(seqs), 64):  # sort within windows: less padding, still mixed
            window = sorted(seqs[start : start + 64], key=lambda s: len(s[0]))
            group: list = []
            for seq in window:
                if group and (len(group) + 1) * len(seq[0]) > budget:
                    groups.append(group)
                    group = []
                group.append(seq)
            if group:
                groups.append(group)
        rng.shuffle(groups)
        for group in groups:
            width = max(len(s[0]) for s in group)
            ids = torch.full((len(group), width), PAD, dtype=torch.long)
            labels = torch.full((len(group), width), IGNORE, dtype=torch.long)
            for row, (x, y) in enumerate(group):
                ids[row, : len(x)] = torch.tensor(x)
                labels[row, : len(y)] = torch.tensor(y)
            yield epoch, ids, labels
        epoch += 1


def model_config(size: str) -> dict:
    """A config.json dict the sloserve loader and transformers both read (same keys as MODELS)."""
    from sloserve.models.default import _COMMON

    hidden, layers, heads, kv, inter = SIZES[size]
    return {
        **_COMMON,
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": hidden // heads,
    }


def build_model(cfg: dict):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        **{k: v for k, v in cfg.items() if k not in ("architectures", "model_type")}
    )
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config)


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def measure(args: argparse.Namespace, train: list) -> None:
    for size in SIZES:
        torch.manual_seed(0)
        model = build_model(model_config(size))
        params = sum(p.numel() for p in model.parameters())
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        gen = batches(train, random.Random(0), args.max_len, args.batch_tokens)
        rates = []
        for i in range(4):
            _, ids, labels = next(gen)
            start = time.perf_counter()
            loss = model(input_ids=ids, labels=None).logits
            loss = torch.nn.functional.cross_entropy(
                loss.flatten(0, 1), labels.flatten(), ignore_index=IGNORE
            )
            loss.backward()
            opt.step()
            opt.zero_grad()
            if i:
                rates.append(ids.numel() / (time.perf_counter() - start))
        print(
            f"size {size} {SIZES[size]}: {params / 1e6:.2f}M params, {sum(rates) / len(rates):,.0f} padded tok/s"
        )


def save(model, cfg: dict, folder: Path, meta: dict) -> None:
    """model.safetensors, config.json and the tokenizer files: a folder sloserve and transformers load."""
    from safetensors.torch import save_file
    from sloserve.models.default import write_tokenizer_files

    folder.mkdir(parents=True, exist_ok=True)
    tensors = {
        name: t.detach()
        .to(torch.float16 if meta["dtype"] == "float16" else torch.float32)
        .contiguous()
        for name, t in model.state_dict().items()
    }
    save_file(
        tensors,
        str(folder / "model.safetensors"),
        metadata={"format": "pt", **{k: str(v) for k, v in meta.items()}},
    )
    (folder / "model.safetensors").chmod(0o644)  # save_file makes it private
    (folder / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    write_tokenizer_files(folder, cfg)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=SIZES, default="m")
    parser.add_argument("--steps", type=int, default=800)
    parser.add_argument("--max-len", type=int, default=1536, help="tokens per sequence, at most")
    parser.add_argument(
        "--batch-tokens", type=int, default=6144, help="padded tokens per step, about"
    )
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--warmup", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--log-every", type=int, default=20)
    parser.add_argument(
        "--dtype", choices=("float32", "float16"), default="float32", help="storage dtype"
    )
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument(
        "--init", type=Path, default=None, help="continue from this checkpoint folder"
    )
    parser.add_argument("--first-epoch", type=int, default=0, help="1+: augmented passes only")
    parser.add_argument(
        "--synthetic", type=int, default=0, help="synthetic rule tasks added per pass"
    )
    parser.add_argument(
        "--answer-weight", type=float, default=1.0, help="loss weight of answer grid + EOS"
    )
    parser.add_argument(
        "--eos-weight",
        type=float,
        default=None,
        help="loss weight of the answer's EOS (default: --answer-weight)",
    )
    parser.add_argument(
        "--row-end-weight",
        type=float,
        default=None,
        help="loss weight of the answer's newlines, the tokens that fix a grid's width "
        "(default: --answer-weight)",
    )
    parser.add_argument(
        "--save-every", type=int, default=0, help="also save to --out every N steps"
    )
    parser.add_argument(
        "--bf16",
        action="store_true",
        help="bfloat16 autocast for matmuls (float32 master weights and loss): x1.7 tokens/s here",
    )
    parser.add_argument(
        "--measure", action="store_true", help="time a few steps of each size and stop"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from sloserve.executor.host_memory import keep_freed_memory

    # Freed activations stay in the heap for the next step: size m, bf16, 1,024-token sequences
    # trained at 7.8k padded tokens/s against 6.5-6.8k with glibc's defaults (two runs each).
    keep_freed_memory()
    torch.manual_seed(args.seed)
    train, held = split_tasks()
    if args.measure:
        measure(args, train)
        return
    cfg = model_config(args.size)
    model = build_model(cfg)
    if args.init is not None:
        from safetensors.torch import load_file

        model.load_state_dict(
            {k: v.float() for k, v in load_file(str(args.init / "model.safetensors")).items()}
        )
    params = sum(p.numel() for p in model.parameters())
    print(
        f"train {len(train)} tasks, held out {len(held)} (from {held[0][0]}); size {args.size} "
        f"{SIZES[args.size]} = {params:,} params; {args.steps} steps of ~{args.batch_tokens} tokens, "
        f"max len {args.max_len}, lr {args.lr}, seed {args.seed}, answer weight {args.answer_weight}, "
        f"EOS weight {args.eos_weight}, row-end weight {args.row_end_weight}, "
        f"init {args.init}, first epoch {args.first_epoch}, synthetic {args.synthetic}, bf16 {args.bf16}",
        flush=True,
    )
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    other = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.05}, {"params": other, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
    )
    gen = batches(
        train,
        random.Random(args.seed),
        args.max_len,
        args.batch_tokens,
        args.first_epoch,
        args.synthetic,
    )
    curve: list[tuple[int, float, float]] = []
    started = time.perf_counter()
    window, answer_window, tokens = [], [], 0
    for step in range(args.steps):
        epoch, ids, labels = next(gen)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args.steps, args.lr, args.warmup)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
            logits = model(input_ids=ids).logits
        targets = labels.flatten()
        per_token = torch.nn.functional.cross_entropy(
            logits.float().flatten(0, 1), targets, ignore_index=IGNORE, reduction="none"
        )
        mask = targets != IGNORE
        answer = _answer_mask(ids, labels).flatten()
        weight = mask.float() + (args.answer_weight - 1.0) * answer.float()
        # the answer's end: EOS, where the model may write "Output:" instead
        if args.eos_weight is not None:
            weight = torch.where(targets == EOS, args.eos_weight, weight)
        # a row ends: one token early or late makes the grid ragged
        if args.row_end_weight is not None:
            weight = torch.where(answer & (targets == NEWLINE), args.row_end_weight, weight)
        loss = (per_token * weight).sum() / weight.sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        # the answer = tokens after the last "Output:\n": the final grid and EOS
        with torch.no_grad():
            answer_loss = (per_token[answer].sum() / answer.sum()).item()
        window.append((per_token.sum() / mask.sum()).item())
        answer_window.append(answer_loss)
        tokens += int(mask.sum())
        if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            mean, ans = sum(window) / len(window), sum(answer_window) / len(answer_window)
            curve.append((step + 1, mean, ans))
            elapsed = time.perf_counter() - started
            print(
                f"step {step + 1:5d}  epoch {epoch}  loss {mean:.4f}  answer loss {ans:.4f}  "
                f"lr {opt.param_groups[0]['lr']:.2e}  {tokens / elapsed:,.0f} tok/s  {elapsed:6.0f} s",
                flush=True,
            )
            window, answer_window = [], []
        if args.save_every and (step + 1) % args.save_every == 0 and step + 1 < args.steps:
            save(
                model,
                cfg,
                args.out,
                {"steps": step + 1, "seed": args.seed, "size": args.size, "dtype": args.dtype},
            )
    elapsed = time.perf_counter() - started
    print(
        f"done: {args.steps} steps, {tokens:,} target tokens, {elapsed / 60:.1f} min, final loss "
        f"{curve[-1][1]:.4f}, answer loss {curve[-1][2]:.4f}",
        flush=True,
    )
    if args.out.exists():
        shutil.rmtree(args.out)
    save(
        model,
        cfg,
        args.out,
        {
            "steps": args.steps,
            "seed": args.seed,
            "size": args.size,
            "dtype": args.dtype,
            "final_loss": round(curve[-1][1], 4),
            "train_minutes": round(elapsed / 60, 1),
        },
    )
    plot(
        curve,
        RESULTS / "train_default_loss.png",
        f"{params / 1e6:.1f}M-param Llama, {args.steps} steps",
    )
    print(f"wrote {args.out}/model.safetensors and {RESULTS / 'train_default_loss.png'}")


def _answer_mask(ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """True at the positions whose target belongs to the final answer grid or its EOS."""
    out = torch.zeros_like(labels, dtype=torch.bool)
    marker = list(b"Output:\n")
    for row in range(ids.shape[0]):
        seq = ids[row].tolist()
        end = int((labels[row] != IGNORE).nonzero().max()) + 1
        for i in range(end - len(marker), -1, -1):
            if seq[i : i + len(marker)] == marker:
                out[row, i + len(marker) - 1 : end] = True
                break
    return out


def plot(curve: list[tuple[int, float, float]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps, loss, answer = zip(*curve, strict=True)
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, loss, label="all targets")
    ax.plot(steps, answer, label="answer grid + EOS")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_yscale("log")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main()
