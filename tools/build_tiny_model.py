"""Build `seedance-tiny`, the embedded default model, from nothing but the Python standard library.

`make serve` must serve a real model without a download, so this script makes one from text that
every machine running Seedance already has: the `.py` sources of the Python standard library.
It is deterministic: fixed seeds, sorted file lists, one seeded generator for the data order and a
fixed thread count, so the same command on the same software stack reproduces the same weights.

    .venv/bin/python tools/build_tiny_model.py                # writes seedance/assets/seedance-tiny
    .venv/bin/python tools/build_tiny_model.py --out /tmp/t --steps 5   # a quick smoke run

Stages (times measured on a 2-core AMD EPYC with bfloat16 units, shared with other work; the
TRAINING_LOG.md the script writes holds the real figures of the committed run):

1. Corpus (~4 s). Every `*.py` under `sysconfig.get_paths()["stdlib"]`, in sorted order, minus the
   test suites, `site-packages`, the generated `encodings` tables and `pydoc_data`. Each file is one
   document. From each file's small top-level functions that have a docstring we also make one
   ChatML conversation (user: the docstring's first line, assistant: the function's source, then
   `<|im_end|>`), so the model learns the chat format and to end an answer with `<|im_end|>`.
2. Tokenizer (~2 s). A byte-level BPE (`tokenizers`) trained on the corpus, with the special
   tokens `<s>`, `</s>`, `<pad>`, `<|im_start|>`, `<|im_end|>`, wrapped as a transformers fast
   tokenizer with a ChatML chat template (`add_generation_prompt` supported). Words keep their
   trailing space (`PRE_TOKEN_PATTERN`), so prompts like "def " end on a trained boundary.
3. Tokenize (~2 s). Documents are encoded and joined, each as `<s> … </s>` (Llama's
   convention: the tokenizer prepends `<s>` to every prompt and the chat template starts with
   it, so a bare prompt such as "def " begins like a file did in training); the last 1% of
   tokens are held out to measure a validation loss.
4. Train (~1.1 s a step with the default single thread on the busy machine: ~15 min for the
   default 2000 steps took 17 min at ~0.5 s a step, inside the 30-minute budget). A small Llama (grouped-query
   attention, head_dim 64 so the Triton kernels' head dims apply, tied embeddings) trained from
   a seeded init with AdamW, linear warm-up then cosine decay, on random windows of
   `--seq-len` tokens drawn by a seeded generator, under bfloat16 autocast (`--fp32` turns it off;
   weights and optimizer state stay float32). Loss is logged every `--log-every` steps.
5. Save and check (~5 s). Weights are cast to bfloat16 (the directory must stay under 12 MiB) and
   saved with the tokenizer in Hugging Face format; the directory is reloaded with
   `AutoModelForCausalLM` / `AutoTokenizer`, greedy samples are generated from Python-looking
   prompts and a chat prompt, and everything is written to `TRAINING_LOG.md` in the output dir.
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import os
import platform
import shlex
import sys
import sysconfig
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import transformers
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "seedance" / "assets" / "seedance-tiny"
SIZE_BUDGET_BYTES = 12 * 1024 * 1024

BOS, EOS, PAD, IM_START, IM_END = "<s>", "</s>", "<pad>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [BOS, EOS, PAD, IM_START, IM_END]

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Words and punctuation runs carry their *trailing* space ("def " + "name" + "(", "import " + "os"),
# unlike GPT-2's leading space. A completion prompt that ends in a space ("def ", "import ") then
# ends on the same token boundary the model saw in training instead of on a lone space token.
# Other whitespace (newline plus indentation) is a piece of its own.
PRE_TOKEN_PATTERN = r"[\p{L}\p{N}_]+ ?|[^\s\p{L}\p{N}_]+ ?|\s+"

SKIPPED_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "encodings", "pydoc_data"})
SAMPLE_PROMPTS = ["def ", "import ", "class ", "    for ", "if __name__"]
CHAT_SAMPLE = "Return the absolute value of a number."


@dataclass(frozen=True)
class BuildSettings:
    """Everything that decides the output; written verbatim into the training log."""

    seed: int
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    steps: int
    batch_size: int
    seq_len: int
    lr: float
    min_lr_ratio: float
    warmup_steps: int
    weight_decay: float
    grad_clip: float
    threads: int
    autocast_bf16: bool
    log_every: int
    max_chat_function_chars: int


def parse_args(argv: list[str] | None = None) -> tuple[Path, BuildSettings]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output directory")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--vocab-size", type=int, default=6144)
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--intermediate-size", type=int, default=768)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--max-position-embeddings", type=int, default=2048)
    p.add_argument("--steps", type=int, default=2000, help="optimizer steps (fixed budget)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--warmup-steps", type=int, default=40)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads, fixed for determinism; 1 is fastest on a busy machine",
    )
    p.add_argument(
        "--fp32",
        action="store_true",
        help="train in float32 (default: bfloat16 autocast, ~2x faster on CPUs with bf16 units)",
    )
    p.add_argument("--log-every", type=int, default=25)
    p.add_argument("--max-chat-function-chars", type=int, default=700)
    a = p.parse_args(argv)
    settings = BuildSettings(
        seed=a.seed,
        vocab_size=a.vocab_size,
        hidden_size=a.hidden_size,
        intermediate_size=a.intermediate_size,
        num_hidden_layers=a.layers,
        num_attention_heads=a.heads,
        num_key_value_heads=a.kv_heads,
        head_dim=a.head_dim,
        max_position_embeddings=a.max_position_embeddings,
        steps=a.steps,
        batch_size=a.batch_size,
        seq_len=a.seq_len,
        lr=a.lr,
        min_lr_ratio=a.min_lr_ratio,
        warmup_steps=min(a.warmup_steps, max(a.steps // 10, 1)),
        weight_decay=a.weight_decay,
        grad_clip=a.grad_clip,
        threads=a.threads,
        autocast_bf16=not a.fp32,
        log_every=a.log_every,
        max_chat_function_chars=a.max_chat_function_chars,
    )
    if settings.hidden_size != settings.num_attention_heads * settings.head_dim:
        p.error("--hidden-size must equal --heads * --head-dim")
    if settings.num_attention_heads % settings.num_key_value_heads:
        p.error("--heads must be a multiple of --kv-heads")
    return a.out, settings


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---------------------------------------------------------------- stage 1: corpus


def stdlib_sources() -> list[Path]:
    """The standard library's `*.py` files in sorted order, without tests and generated tables."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [
        path
        for path in root.rglob("*.py")
        if not SKIPPED_DIRS.intersection(path.relative_to(root).parts[:-1])
        and not path.name.startswith("test_")
    ]
    return sorted(files, key=lambda path: path.relative_to(root).as_posix())


def chat_examples(source: str, max_chars: int) -> Iterator[str]:
    """ChatML conversations made from a module's small, documented top-level functions."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return
    lines = source.splitlines()
    for node in tree.body:
        if not isinstance(node, ast.FunctionDef) or node.end_lineno is None:
            continue
        doc = ast.get_docstring(node)
        if not doc or not doc.strip():
            continue
        request = doc.strip().splitlines()[0].strip()
        code = "\n".join(lines[node.lineno - 1 : node.end_lineno])
        if len(request) < 12 or len(code) > max_chars:
            continue
        yield (
            f"{IM_START}user\n{request}{IM_END}\n"
            f"{IM_START}assistant\n```python\n{code}\n```{IM_END}\n"
        )


def build_corpus(max_chat_chars: int) -> tuple[list[str], dict[str, int]]:
    files = stdlib_sources()
    documents: list[str] = []
    chats = 0
    for path in files:
        text = path.read_text(encoding="utf-8", errors="replace")
        documents.append(text)
        for chat in chat_examples(text, max_chat_chars):
            documents.append(chat)
            chats += 1
    stats = {
        "files": len(files),
        "chat_documents": chats,
        "characters": sum(len(d) for d in documents),
    }
    return documents, stats


# ---------------------------------------------------------------- stage 2: tokenizer


def train_tokenizer(documents: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRE_TOKEN_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(documents, trainer=trainer, length=len(documents))
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=[IM_START, IM_END],
        model_max_length=0,  # replaced in main() by max_position_embeddings
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


# ---------------------------------------------------------------- stage 3: tokenize


def tokenize(tokenizer: PreTrainedTokenizerFast, documents: list[str]) -> torch.Tensor:
    bos = tokenizer.convert_tokens_to_ids(BOS)
    eos = tokenizer.convert_tokens_to_ids(EOS)
    ids: list[int] = []
    batch = 256
    for start in range(0, len(documents), batch):
        encoded = tokenizer(documents[start : start + batch], add_special_tokens=False)
        for doc_ids in encoded["input_ids"]:
            ids.append(bos)
            ids.extend(doc_ids)
            ids.append(eos)
    return torch.tensor(ids, dtype=torch.int32)


# ---------------------------------------------------------------- stage 4: train


def model_config(s: BuildSettings, tokenizer: PreTrainedTokenizerFast) -> LlamaConfig:
    ids = tokenizer.convert_tokens_to_ids
    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=s.hidden_size,
        intermediate_size=s.intermediate_size,
        num_hidden_layers=s.num_hidden_layers,
        num_attention_heads=s.num_attention_heads,
        num_key_value_heads=s.num_key_value_heads,
        head_dim=s.head_dim,
        max_position_embeddings=s.max_position_embeddings,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        hidden_act="silu",
        initializer_range=0.02,
        tie_word_embeddings=True,
        bos_token_id=ids(BOS),
        eos_token_id=ids(EOS),
        pad_token_id=ids(PAD),
        attention_bias=False,
        mlp_bias=False,
    )


def lr_at(step: int, s: BuildSettings) -> float:
    if step < s.warmup_steps:
        return s.lr * (step + 1) / s.warmup_steps
    progress = (step - s.warmup_steps) / max(s.steps - s.warmup_steps, 1)
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))
    return s.lr * (s.min_lr_ratio + (1.0 - s.min_lr_ratio) * cosine)


def windows(tokens: torch.Tensor, starts: torch.Tensor, seq_len: int) -> torch.Tensor:
    offsets = torch.arange(seq_len + 1)
    return tokens[starts[:, None] + offsets[None, :]].long()


@torch.no_grad()
def mean_loss(model: LlamaForCausalLM, batches: list[torch.Tensor]) -> float:
    model.eval()
    losses = [float(next_token_loss(model, b)) for b in batches]
    model.train()
    return sum(losses) / len(losses)


def next_token_loss(model: LlamaForCausalLM, batch: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of predicting batch[:, 1:] from batch[:, :-1] (each row is seq_len + 1)."""
    logits = model(input_ids=batch[:, :-1]).logits
    return torch.nn.functional.cross_entropy(  # logits upcast: the softmax stays float32
        logits.reshape(-1, logits.shape[-1]).float(), batch[:, 1:].reshape(-1)
    )


def train(
    model: LlamaForCausalLM, train_tokens: torch.Tensor, val_tokens: torch.Tensor, s: BuildSettings
) -> tuple[list[tuple[int, float, float]], float, float]:
    """Train in place; return the loss curve [(step, lr, mean loss since the previous entry)],
    the held-out loss at the end, and the training wall time in seconds."""
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": s.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=s.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    data_gen = torch.Generator().manual_seed(s.seed + 1)
    high = train_tokens.numel() - s.seq_len - 1
    val_gen = torch.Generator().manual_seed(s.seed + 2)
    val_high = val_tokens.numel() - s.seq_len - 1
    val_batches = [
        windows(
            val_tokens, torch.randint(0, val_high, (s.batch_size,), generator=val_gen), s.seq_len
        )
        for _ in range(4)
    ]
    curve: list[tuple[int, float, float]] = []
    running, count = 0.0, 0
    model.train()
    t0 = time.monotonic()
    for step in range(s.steps):
        lr = lr_at(step, s)
        for group in optimizer.param_groups:
            group["lr"] = lr
        batch = windows(
            train_tokens, torch.randint(0, high, (s.batch_size,), generator=data_gen), s.seq_len
        )
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=s.autocast_bf16):
            loss = next_token_loss(model, batch)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), s.grad_clip)
        optimizer.step()
        running += loss.item()
        count += 1
        if (step + 1) % s.log_every == 0 or step + 1 == s.steps:
            elapsed = time.monotonic() - t0
            curve.append((step + 1, lr, running / count))
            log(
                f"step {step + 1}/{s.steps} lr {lr:.2e} loss {running / count:.4f} "
                f"({elapsed:.0f} s, {elapsed / (step + 1):.2f} s/step)"
            )
            running, count = 0.0, 0
    seconds = time.monotonic() - t0
    return curve, mean_loss(model, val_batches), seconds


# ---------------------------------------------------------------- stage 5: save and check


def write_portable_tokenizer_files(out: Path) -> None:
    """Make the saved tokenizer loadable by transformers 4.x and by plain-JSON readers too.

    transformers 5 keeps the chat template in `chat_template.jinja` and names the class
    `TokenizersBackend`; older releases (and tools that only read `tokenizer_config.json`) want the
    template inline, `PreTrainedTokenizerFast`, `additional_special_tokens` and a
    `special_tokens_map.json`. Both spellings load to the same tokenizer under transformers 5.
    """
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config["additional_special_tokens"] = [IM_START, IM_END]
    config["chat_template"] = CHAT_TEMPLATE
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    special = {
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "additional_special_tokens": [IM_START, IM_END],
    }
    (out / "special_tokens_map.json").write_text(
        json.dumps(special, indent=2, sort_keys=True) + "\n", encoding="utf-8"
    )


def directory_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.iterdir() if f.is_file())


def greedy_samples(out: Path, max_new_tokens: int = 48) -> list[tuple[str, str]]:
    tokenizer = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    model.eval()
    prompts = list(SAMPLE_PROMPTS)
    prompts.append(
        tokenizer.apply_chat_template(
            [{"role": "user", "content": CHAT_SAMPLE}], tokenize=False, add_generation_prompt=True
        )
    )
    samples = []
    for prompt in prompts:
        # bare prompts get `<s>` from the tokenizer; the rendered chat text already starts with it
        ids = tokenizer(
            prompt, return_tensors="pt", add_special_tokens=not prompt.startswith(BOS)
        )
        with torch.no_grad():
            generated = model.generate(
                **ids,
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=tokenizer.pad_token_id,
            )
        text = tokenizer.decode(
            generated[0, ids["input_ids"].shape[1] :], skip_special_tokens=False
        )
        samples.append((prompt, text))
    return samples


def write_log(
    out: Path,
    s: BuildSettings,
    corpus_stats: dict[str, int],
    token_counts: tuple[int, int],
    n_params: int,
    curve: list[tuple[int, float, float]],
    val_loss: float,
    train_seconds: float,
    total_seconds: float,
    samples: list[tuple[str, str]],
) -> None:
    command = ".venv/bin/python tools/build_tiny_model.py " + shlex.join(sys.argv[1:])
    tokens_seen = s.steps * s.batch_size * s.seq_len
    lines = [
        "# seedance-tiny training log",
        "",
        "Written by `tools/build_tiny_model.py` at the end of the run that produced these weights.",
        "",
        "## Command",
        "",
        f"    {command.strip()}",
        "",
        "## Environment",
        "",
        f"- Python {platform.python_version()}, torch {torch.__version__}, "
        f"transformers {transformers.__version__}, {platform.machine()}, "
        f"{os.cpu_count()} CPUs visible, torch threads {s.threads}",
        "",
        "## Settings",
        "",
        *[f"- {k}: {v}" for k, v in asdict(s).items()],
        "",
        "## Data",
        "",
        f"- stdlib files: {corpus_stats['files']}, "
        f"ChatML documents: {corpus_stats['chat_documents']}, "
        f"characters: {corpus_stats['characters']:,}",
        f"- tokens: {token_counts[0]:,} train, {token_counts[1]:,} held out; "
        f"tokens seen in training: {tokens_seen:,} "
        f"({tokens_seen / max(token_counts[0], 1):.2f} epochs)",
        f"- parameters: {n_params:,} (stored as bfloat16)",
        "",
        "## Result",
        "",
        f"- steps: {s.steps}",
        f"- training wall time: {train_seconds:.0f} s ({train_seconds / 60:.1f} min); "
        f"whole build: {total_seconds:.0f} s ({total_seconds / 60:.1f} min)",
        f"- FINAL LOSS (train, mean of the last {s.log_every} steps): {curve[-1][2]:.4f}",
        f"- final held-out loss (fp32 weights, 4 x {s.batch_size} windows): {val_loss:.4f}",
        f"- output directory size: {directory_bytes(out):,} bytes (budget {SIZE_BUDGET_BYTES:,})",
        "",
        "## Loss curve (mean train loss over each logging interval)",
        "",
        "| step | lr | loss |",
        "|---:|---:|---:|",
        *[f"| {step} | {lr:.2e} | {loss:.4f} |" for step, lr, loss in curve],
        "",
        "## Greedy samples (bfloat16 weights reloaded in float32, 48 new tokens)",
        "",
    ]
    for prompt, text in samples:
        lines += [f"Prompt: `{prompt!r}`", "", "```", prompt + text, "```", ""]
    (out / "TRAINING_LOG.md").write_text("\n".join(lines), encoding="utf-8")


def main(argv: list[str] | None = None) -> None:
    out, s = parse_args(argv)
    t_start = time.monotonic()
    torch.manual_seed(s.seed)
    torch.set_num_threads(s.threads)
    torch.use_deterministic_algorithms(True)

    log("stage 1: corpus")
    documents, corpus_stats = build_corpus(s.max_chat_function_chars)
    log(f"  {corpus_stats}")

    log("stage 2: tokenizer")
    tokenizer = train_tokenizer(documents, s.vocab_size)
    log(f"  vocab {len(tokenizer)}")

    log("stage 3: tokenize")
    tokens = tokenize(tokenizer, documents)
    tokenizer.model_max_length = s.max_position_embeddings
    split = int(tokens.numel() * 0.99)
    train_tokens, val_tokens = tokens[:split], tokens[split:]
    log(f"  {train_tokens.numel():,} train tokens, {val_tokens.numel():,} held out")

    log("stage 4: train")
    config = model_config(s, tokenizer)
    torch.manual_seed(s.seed)
    model = LlamaForCausalLM(config)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"  {n_params:,} parameters")
    curve, val_loss, train_seconds = train(model, train_tokens, val_tokens, s)

    log("stage 5: save and check")
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.iterdir():
        if stale.is_file():
            stale.unlink()
    model = model.to(torch.bfloat16)
    model.config.dtype = torch.bfloat16
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=[config.eos_token_id, tokenizer.convert_tokens_to_ids(IM_END)],
        pad_token_id=config.pad_token_id,
        do_sample=False,
    )
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    write_portable_tokenizer_files(out)
    for saved in out.iterdir():
        saved.chmod(0o644)  # safetensors writes 0600; the files are meant to be shared
    samples = greedy_samples(out)
    for prompt, text in samples:
        log(f"  {prompt!r} -> {text!r}")
    total_seconds = time.monotonic() - t_start
    write_log(
        out,
        s,
        corpus_stats,
        (train_tokens.numel(), val_tokens.numel()),
        n_params,
        curve,
        val_loss,
        train_seconds,
        total_seconds,
        samples,
    )
    size = directory_bytes(out)
    log(f"done: {out} is {size:,} bytes; final loss {curve[-1][2]:.4f}, held-out {val_loss:.4f}")
    if size > SIZE_BUDGET_BYTES:
        sys.exit(f"{out} is {size:,} bytes, over the {SIZE_BUDGET_BYTES:,}-byte budget")


if __name__ == "__main__":
    main()
