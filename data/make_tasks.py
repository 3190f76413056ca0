"""Write the bundled fine-tuning data: `sft_tasks.jsonl` (Alpaca-format instruction examples) and
`dpo_pairs.jsonl` (preference pairs), synthetic tasks a small model can learn and that are scored
exactly:

    reverse   Reverse the word: night               -> thgin
    upper     Write the word in capital letters: night -> NIGHT
    count     How many letters are in the word: night   -> 5
    sum       What is 12 + 7?                     -> 19
    complete  Complete the line: 3, 5, 7, 9,      -> 11, 13

Words come from the bundled Shakespeare text (lower-case words of 3 to 6 letters), so the
pretrained model has seen them. The last 10% of each file is the held-out split (the default
`--val-fraction` of `sft` and `dpo`): its words, sums and number lines never occur in the
training part. A pair's rejected response is a plausible mistake (a word left unreversed, an
off-by-one count, a sum off by one or ten, ...).

    python data/make_tasks.py        # rewrites both files next to this script, deterministically
"""

from __future__ import annotations

import collections
import json
import random
import re
from pathlib import Path

HERE = Path(__file__).resolve().parent
SEED = 0
HELDOUT_FRACTION = 0.1
SFT_PER_TASK = 600     # examples of each task in sft_tasks.jsonl, 10% of them held out
DPO_PER_TASK = 300     # pairs of each task in dpo_pairs.jsonl, 10% of them held out


def shakespeare_words() -> list[str]:
    """Lower-case words of 3 to 6 letters seen at least three times in the bundled corpus."""
    text = (HERE / "tinyshakespeare.txt").read_text(encoding="utf-8")
    counts = collections.Counter(w for w in re.findall(r"\b[A-Za-z]+\b", text) if w.islower() and 3 <= len(w) <= 6)
    return sorted(w for w, n in counts.items() if n >= 3)


def number_line(start: int, step: int) -> tuple[str, list[int]]:
    """The first four terms of an arithmetic line as text, and the two that follow."""
    terms = [start + i * step for i in range(6)]
    return ", ".join(map(str, terms[:4])) + ",", terms[4:]


def example(task: str, item, rng: random.Random) -> dict:
    """One task instance: instruction, right output, and a plausible wrong output."""
    if task in ("reverse", "upper", "count"):
        word = item
        if task == "reverse":
            instruction, output = f"Reverse the word: {word}", word[::-1]
            i = rng.randrange(len(word) - 1)
            swapped = output[:i] + output[i + 1] + output[i] + output[i + 2:]
            wrong = rng.choice([c for c in (word, swapped) if c != output] or [output + output[-1]])
        elif task == "upper":
            instruction, output = f"Write the word in capital letters: {word}", word.upper()
            i = rng.randrange(len(word))
            wrong = rng.choice([word.capitalize(), output[:i] + word[i] + output[i + 1:]])
        else:
            instruction, output = f"How many letters are in the word: {word}", str(len(word))
            wrong = str(len(word) + rng.choice([-1, 1]))
    elif task == "sum":
        a, b = item
        instruction, output = f"What is {a} + {b}?", str(a + b)
        wrong = str(a + b + rng.choice([-1, 1, 10] if a + b > 0 else [1, 10]))
    else:
        start, step = item
        line, following = number_line(start, step)
        instruction, output = f"Complete the line: {line}", ", ".join(map(str, following))
        off = rng.choice([(1, 1), (0, 1), (step, step)])  # off by one, a wrong second term, a skipped term
        wrong = ", ".join(str(t + d) for t, d in zip(following, off))
    return {"instruction": instruction, "input": "", "output": output, "rejected": wrong, "task": task}


def split_items(items: list, rng: random.Random) -> tuple[list, list]:
    """(training items, held-out items), disjoint, the held-out ones HELDOUT_FRACTION of them."""
    items = list(items)
    rng.shuffle(items)
    n_heldout = int(len(items) * HELDOUT_FRACTION)
    return items[n_heldout:], items[:n_heldout]


def draw(items: list, n: int, rng: random.Random) -> list:
    """n items: without repeats while there are enough, then cycling through them again."""
    order = list(items)
    rng.shuffle(order)
    return [order[i % len(order)] for i in range(n)]


def task_items(rng: random.Random) -> dict[str, tuple[list, list]]:
    """Each task's (training, held-out) pools of inputs."""
    words = split_items(shakespeare_words(), rng)
    sums = split_items([(a, b) for a in range(30) for b in range(30)], rng)
    lines = split_items([(start, step) for start in range(120) for step in range(1, 6)], rng)
    return {"reverse": words, "upper": words, "count": words, "sum": sums, "complete": lines}


def build(pools: dict[str, tuple[list, list]], per_task: int, rng: random.Random) -> list[dict]:
    """Training examples (shuffled), then the held-out ones: HELDOUT_FRACTION of the whole."""
    n_heldout = int(per_task * HELDOUT_FRACTION)
    training, heldout = [], []
    for task, (train_pool, heldout_pool) in pools.items():
        training += [example(task, item, rng) for item in draw(train_pool, per_task - n_heldout, rng)]
        heldout += [example(task, item, rng) for item in draw(heldout_pool, n_heldout, rng)]
    rng.shuffle(training)
    rng.shuffle(heldout)
    return training + heldout


def generate() -> tuple[list[dict], list[dict]]:
    """The rows of sft_tasks.jsonl and of dpo_pairs.jsonl."""
    rng = random.Random(SEED)
    pools = task_items(rng)  # one split for both files: DPO never trains on what SFT holds out
    sft = [{k: e[k] for k in ("instruction", "input", "output", "task")} for e in build(pools, SFT_PER_TASK, rng)]
    pairs = [{"instruction": e["instruction"], "chosen": e["output"], "rejected": e["rejected"], "task": e["task"]}
             for e in build(pools, DPO_PER_TASK, rng)]
    return sft, pairs


def jsonl(rows: list[dict]) -> str:
    return "".join(json.dumps(row) + "\n" for row in rows)


def main() -> None:
    sft, pairs = generate()
    (HERE / "sft_tasks.jsonl").write_text(jsonl(sft), encoding="utf-8")
    (HERE / "dpo_pairs.jsonl").write_text(jsonl(pairs), encoding="utf-8")
    print(f"wrote {len(sft)} examples to sft_tasks.jsonl and {len(pairs)} pairs to dpo_pairs.jsonl "
          f"(the last {HELDOUT_FRACTION:.0%} of each held out)")


if __name__ == "__main__":
    main()
