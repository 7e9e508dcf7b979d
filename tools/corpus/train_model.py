"""Train a small speech-token TTS language model (LlamaForCausalLM) on a corpus folder, on CPU.

Each example is `<bos> speaker text <tts>` (the prompt, no loss) followed by `speech tokens <eos_speech>`
(the target, with loss); see tools/corpus/tts_prompt.py for the vocabulary. The held-out set is the corpus
folder's prompts.jsonl (utterances kept out of the corpus), or a seeded slice of the corpus if it has none.
The schedule is fixed by `steps` so a run is reproducible for a seed; `max_minutes` is only a safety cap
(the report says when it cut training short). Saved with `save_pretrained` (safetensors) plus
`echospec_tts.json`, so `AutoModelForCausalLM.from_pretrained(out_dir)` loads it. `device` trains elsewhere than
the CPU (a GPU trains in minutes what one CPU thread trains in hours); only the CPU run is bit-reproducible, since
CUDA's kernels may add in another order from run to run.
"""

from __future__ import annotations

import json
import math
import os
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

from ...datastore.files import SHARED_FILE_MODE, atomic_dir
from .tts_prompt import TTSMeta, encode_prompt, encode_target, text_symbols

IGNORE = -100


class TrainingDataError(ValueError):
    """The corpus folder is missing, empty or malformed."""


@dataclass(frozen=True)
class TrainConfig:
    """Model size and schedule. The defaults give 1.7M parameters and took 12.3 minutes on one thread of 2 busy cores."""

    steps: int = 1600
    batch_size: int = 16
    lr: float = 2e-3
    warmup: int = 100
    weight_decay: float = 0.01
    hidden: int = 192
    layers: int = 4
    heads: int = 6
    kv_heads: int = 2
    max_positions: int = 1024
    max_minutes: float = 20.0
    threads: int = 1  # on a shared machine one thread beats two that keep waiting for each other
    seed: int = 0
    eval_every: int = 500
    heldout_fraction: float = 0.05  # used only when the folder has no prompts.jsonl
    front_end: str = "phonemes"  # what the model reads of a text: tools/corpus/tts_prompt.text_symbols
    device: str = "cpu"  # where the model trains: any torch device ("cuda", "cuda:1", "mps")


@dataclass(frozen=True)
class Example:
    input_ids: list[int]
    n_prompt: int  # positions before the first target token


def read_records(path: Path, tokens_key: str) -> list[dict]:
    """JSONL rows with text, speaker and a list of int tokens under `tokens_key`."""
    rows = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                ok = isinstance(row["text"], str) and isinstance(row["speaker"], str) and all(isinstance(t, int) for t in row[tokens_key])
            except (json.JSONDecodeError, KeyError, TypeError):
                ok = False
            if not ok or not row[tokens_key]:
                raise TrainingDataError(f"{path}:{n}: expected {{text, speaker, {tokens_key}: [int, ...]}} with tokens")
            rows.append({"text": row["text"], "speaker": row["speaker"], "tokens": row[tokens_key]})
    return rows


def load_splits(corpus_dir: str | os.PathLike, cfg: TrainConfig) -> tuple[list[dict], list[dict], int, float]:
    """(train rows, held-out rows, speech vocabulary size, tokens per second) from a make-corpus folder."""
    folder = Path(corpus_dir)
    if not (folder / "corpus.jsonl").is_file():
        raise TrainingDataError(f"{folder}/corpus.jsonl not found (make one with `echospec make-corpus`)")
    train = read_records(folder / "corpus.jsonl", "tokens")
    if not train:
        raise TrainingDataError(f"{folder}/corpus.jsonl is empty")
    prompts = folder / "prompts.jsonl"
    heldout = read_records(prompts, "reference_tokens") if prompts.is_file() else []
    if not heldout:
        random.Random(cfg.seed).shuffle(train)
        n = max(1, int(len(train) * cfg.heldout_fraction))
        heldout, train = train[:n], train[n:]
    if (folder / "tokenizer.npz").is_file():
        with np.load(folder / "tokenizer.npz") as z:
            speech_vocab, frame_rate = len(z["centroids"]), float(z["sample_rate"]) / float(z["hop_length"])
    else:
        speech_vocab, frame_rate = 1 + max(max(r["tokens"]) for r in train + heldout), 25.0
    return train, heldout, speech_vocab, frame_rate


def build_meta(rows: list[dict], speech_vocab_size: int, frame_rate: float, front_end: str) -> TTSMeta:
    symbols = {c for r in rows for c in text_symbols(r["text"], front_end)}
    return TTSMeta.build(symbols, {r["speaker"] for r in rows}, speech_vocab_size, frame_rate, front_end)


def to_examples(meta: TTSMeta, rows: list[dict]) -> list[Example]:
    examples = []
    for r in rows:
        prompt = encode_prompt(meta, r["text"], r["speaker"])
        examples.append(Example(prompt + encode_target(meta, r["tokens"]), len(prompt)))
    return examples


def make_model(meta: TTSMeta, cfg: TrainConfig) -> LlamaForCausalLM:
    """A small Llama with tied embeddings (they are a large share of a model this size)."""
    torch.manual_seed(cfg.seed)
    config = LlamaConfig(
        vocab_size=meta.vocab_size,
        hidden_size=cfg.hidden,
        intermediate_size=64 * math.ceil(cfg.hidden * 8 / 3 / 64),
        num_hidden_layers=cfg.layers,
        num_attention_heads=cfg.heads,
        num_key_value_heads=cfg.kv_heads,
        max_position_embeddings=cfg.max_positions,
        tie_word_embeddings=True,
        pad_token_id=meta.pad_id,
        bos_token_id=meta.bos_id,
        eos_token_id=meta.stop_id,
    )
    return LlamaForCausalLM(config)


def collate(batch: list[Example], pad_id: int, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """Right-padded ids, attention mask, and labels that score only the target (speech + stop), on `device`."""
    width = max(len(e.input_ids) for e in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    labels = torch.full((len(batch), width), IGNORE, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for i, e in enumerate(batch):
        n = len(e.input_ids)
        ids[i, :n] = torch.tensor(e.input_ids)
        labels[i, e.n_prompt : n] = ids[i, e.n_prompt : n]
        mask[i, :n] = 1
    return {"input_ids": ids.to(device), "attention_mask": mask.to(device), "labels": labels.to(device)}


def length_bucketed_batches(examples: list[Example], batch_size: int, rng: random.Random):
    """Endless batches of similar length (little padding), in a seeded random order."""
    while True:
        order = list(range(len(examples)))
        rng.shuffle(order)
        chunk = batch_size * 32
        batches = []
        for start in range(0, len(order), chunk):
            group = sorted(order[start : start + chunk], key=lambda i: len(examples[i].input_ids))
            batches += [group[j : j + batch_size] for j in range(0, len(group), batch_size)]
        rng.shuffle(batches)
        for b in batches:
            yield [examples[i] for i in b]


@torch.no_grad()
def evaluate(model: LlamaForCausalLM, examples: list[Example], pad_id: int, batch_size: int = 32) -> tuple[float, float]:
    """(mean target loss per token, next-token accuracy on the target) over `examples`."""
    model.eval()
    total_loss, correct, count = 0.0, 0, 0
    for start in range(0, len(examples), batch_size):
        batch = collate(examples[start : start + batch_size], pad_id, model.device)
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
        labels = batch["labels"][:, 1:]
        scored = labels != IGNORE
        total_loss += torch.nn.functional.cross_entropy(logits[scored], labels[scored], reduction="sum").item()
        correct += (logits.argmax(-1)[scored] == labels[scored]).sum().item()
        count += scored.sum().item()
    model.train()
    return total_loss / count, correct / count


def lr_at(step: int, cfg: TrainConfig, elapsed_s: float = 0.0) -> float:
    """Linear warm-up, then cosine decay to a tenth of the peak, driven by whichever of `steps` and the wall
    budget runs out first: a run cut short by a busy machine still ends annealed. A run that finishes its
    steps inside the budget never looks at the clock, so it is reproducible for a seed."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    by_steps = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    progress = min(1.0, max(by_steps, elapsed_s / (60 * cfg.max_minutes)))
    return cfg.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))


@torch.no_grad()
def sample_lengths(model: LlamaForCausalLM, meta: TTSMeta, rows: list[dict], n: int = 4, seed: int = 0) -> list[dict]:
    """Sanity check: sample a few held-out prompts; did each stop, and near the reference length?"""
    model.eval()
    out = []
    for row in rows[:n]:
        prompt = torch.tensor([encode_prompt(meta, row["text"], row["speaker"])], device=model.device)
        torch.manual_seed(seed)
        gen = model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=True, top_k=0, top_p=1.0, temperature=1.0,
                             max_new_tokens=4 * len(row["tokens"]) + 50)[0, prompt.shape[1] :].tolist()  # fmt: skip
        stopped = meta.stop_id in gen
        speech = gen[: gen.index(meta.stop_id)] if stopped else gen
        out.append({"reference_tokens": len(row["tokens"]), "generated_tokens": len(speech), "stopped": stopped,
                    "all_speech": all(meta.speech_offset <= t < meta.stop_id for t in speech)})  # fmt: skip
    return out


def training_device(name: str) -> torch.device:
    """`name` as a torch device that is here, or ValueError saying why not."""
    try:
        device = torch.device(name)
        torch.empty(1, device=device)
    except (RuntimeError, AssertionError) as e:
        raise ValueError(f"--device {name!r}: not usable here ({str(e).splitlines()[0]})") from None
    return device


def _save(model: LlamaForCausalLM, meta: TTSMeta, out_dir: Path, report: dict) -> None:
    """save_pretrained into a temporary sibling folder that is swapped in whole: a crash leaves no half checkpoint."""
    model = model.to("cpu")  # the checkpoint loads anywhere
    model.generation_config = GenerationConfig(bos_token_id=meta.bos_id, eos_token_id=meta.stop_id, pad_token_id=meta.pad_id)
    with atomic_dir(out_dir) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        meta.save(tmp)
        (tmp / "training_report.json").write_text(json.dumps(report, indent=2))
        for path in tmp.iterdir():
            path.chmod(SHARED_FILE_MODE)  # safetensors writes 0600; the checkpoint is shipped and shared


def train_model(corpus_dir: str | os.PathLike, out_dir: str | os.PathLike, cfg: TrainConfig = TrainConfig(), progress: bool = True) -> dict:
    """Train, evaluate on the held-out set, sanity-sample, save; returns the report (also saved beside the model)."""
    if cfg.steps < 1 or cfg.batch_size < 1 or cfg.hidden % cfg.heads or cfg.heads % cfg.kv_heads:
        raise ValueError(f"bad config: steps/batch_size >= 1, hidden divisible by heads, heads by kv_heads: {cfg}")
    device = training_device(cfg.device)
    train_rows, heldout_rows, speech_vocab, frame_rate = load_splits(corpus_dir, cfg)
    meta = build_meta(train_rows, speech_vocab, frame_rate, cfg.front_end)
    heldout_rows = [r for r in heldout_rows if r["speaker"] in meta.speaker_to_id
                    and set(text_symbols(r["text"], cfg.front_end)) <= set(meta.char_to_id)]
    train, heldout = to_examples(meta, train_rows), to_examples(meta, heldout_rows)
    if max(len(e.input_ids) for e in train + heldout) > cfg.max_positions:
        raise TrainingDataError(f"an example is longer than max_positions={cfg.max_positions}")

    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.threads)
    try:
        model = make_model(meta, cfg).to(device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.98), weight_decay=cfg.weight_decay)
        batches = length_bucketed_batches(train, cfg.batch_size, random.Random(cfg.seed))
        model.train()
        start, history, step = time.monotonic(), [], 0
        bar = tqdm(range(cfg.steps), desc="train", disable=not progress)
        for step in bar:
            elapsed = time.monotonic() - start
            if elapsed > 60 * cfg.max_minutes:
                break
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step, cfg, elapsed)
            loss = model(**collate(next(batches), meta.pad_id, device)).loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            bar.set_postfix(loss=f"{loss.item():.3f}")
            if heldout and (step + 1) % cfg.eval_every == 0:
                held_loss, held_acc = evaluate(model, heldout, meta.pad_id)
                history.append({"step": step + 1, "heldout_loss": round(held_loss, 4), "heldout_accuracy": round(held_acc, 4)})
                bar.write(f"step {step + 1}: held-out loss {held_loss:.3f}, next-token accuracy {held_acc:.3f}")
        else:
            step = cfg.steps
        train_seconds = time.monotonic() - start
        loss, accuracy = evaluate(model, heldout, meta.pad_id) if heldout else (float("nan"), float("nan"))
        report = {
            "parameters": sum(p.numel() for p in model.parameters()),
            "steps_done": step,
            "stopped_by_wall_budget": step < cfg.steps,
            "train_seconds": round(train_seconds, 1),
            "train_utterances": len(train),
            "train_target_tokens": sum(len(e.input_ids) - e.n_prompt for e in train),
            "heldout_utterances": len(heldout),
            "heldout_loss": round(loss, 4),
            "heldout_accuracy": round(accuracy, 4),
            "eval_history": history,
            "samples": sample_lengths(model, meta, heldout_rows, seed=cfg.seed),
            "config": asdict(cfg),
        }
        _save(model, meta, Path(out_dir), report)
    finally:
        torch.set_num_threads(threads)
    return report
