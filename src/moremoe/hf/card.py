"""The model card (README.md) of an export: the architecture, the training configuration, the
data (its meta.json, when the run's data folder is still there) and the last metrics of the
run (summary.json, log.jsonl) up to the exported checkpoint, with how to load and run it."""
from __future__ import annotations

import json
from pathlib import Path

from ..model.transformer import TransformerConfig
from ..nn.peer import PEERConfig
from ..tasks.tokenizer import VOCAB_SIZE

DATA_KEYS = ("tokenizer", "vocab_size", "seq_len", "tokens", "train_sequences",
             "val_sequences", "documents", "sources")
METRIC_KEYS = ("loss", "lm_loss", "val_loss", "val_ppl", "tokens", "lr", "hnorm")


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def run_info(checkpoint: Path) -> dict:
    """What a checkpoint's folders tell of its run: {"step", "train" (the run's config),
    "data" (its meta.json), "metrics" (the last train and eval events up to the step),
    "summary" (summary.json)}; missing parts are None."""
    from ..model.checkpoint import CKPT_DIR, CONFIG_FILE, step_of
    config = _read_json(checkpoint / CONFIG_FILE) or {}
    train = config.get("train")
    step = step_of(checkpoint)
    run = checkpoint.parent.parent if checkpoint.parent.name == CKPT_DIR else None
    data = None
    if isinstance(train, dict) and isinstance(train.get("train"), dict):
        folder = train["train"].get("data")
        data = _read_json(Path(folder) / "meta.json") if folder else None
    metrics = {}
    if run is not None and (run / "log.jsonl").is_file():
        for line in (run / "log.jsonl").read_text().splitlines():
            event = _read_json_line(line)
            if (event and event.get("event") in ("train", "eval")
                    and (step is None or event.get("step", 0) <= step)):
                metrics[event["event"]] = event
    summary = _read_json(run / "summary.json") if run is not None else None
    return {"step": step, "train": train, "data": data, "metrics": metrics or None,
            "summary": summary}


def _read_json_line(line: str):
    try:
        return json.loads(line)
    except ValueError:
        return None


def _architecture(cfg: TransformerConfig) -> list[str]:
    m = cfg.moe
    ffn = (m.label if isinstance(m, PEERConfig) else
           f"{m.label}: {m.experts} SwiGLU experts of width {m.width}, top-{m.top_k}, "
           + (f"low-rank router R1 ({m.experts} x {m.rank}) R2 ({m.rank} x {m.hidden})"
              if m.is_lowrank else f"linear router ({m.experts} x {m.hidden})"))
    return [f"- decoder-only transformer, {cfg.layers} layers, hidden {cfg.hidden}, "
            f"{cfg.heads} query heads and {cfg.n_kv_heads} key/value heads of "
            f"{cfg.dim_per_head}, rotary positions (theta {cfg.rope_theta:g}), RMSNorm, "
            f"untied embeddings",
            f"- feed-forward in every layer: {ffn}",
            f"- vocabulary {cfg.vocab:,}, context {cfg.max_seq_len:,} tokens, "
            f"{cfg.total_params():,} parameters"]


def _section(title: str, obj, keys=None) -> list[str]:
    if not obj:
        return [f"## {title}", "", "Not known (the run's files were not found beside the "
                "checkpoint).", ""]
    shown = {k: obj[k] for k in keys if k in obj} if keys else obj
    return [f"## {title}", "", "```json", json.dumps(shown, indent=2, default=str), "```", ""]


def model_card(cfg: TransformerConfig, info: dict, *, name: str) -> str:
    """README.md of an export (transformers' model card: YAML front matter, then Markdown)."""
    gpt2 = cfg.vocab == VOCAB_SIZE
    lines = ["---", "library_name: transformers", "pipeline_tag: text-generation",
             "tags: [moremoe, mixture-of-experts, more]", "---", "", f"# {name}", "",
             "A moremoe model (MoRE: Mixture of Rank-reduced-routed Experts) exported by "
             "`moremoe hf export`" + (f" from step {info['step']:,}." if info.get("step")
                                       is not None else "."), "", "## Architecture", "",
             *_architecture(cfg), "", "## Tokenizer", ""]
    if gpt2:
        lines += ["GPT-2's byte-level BPE (50,257 ids, `<|endoftext|>` = 50256), in "
                  "`tokenizer.json`.", ""]
    else:
        lines += [f"None written: the vocabulary has {cfg.vocab:,} ids, not GPT-2's "
                  f"{VOCAB_SIZE:,}; tokenize as the training data was.", ""]
    lines += ["## Use", "", "```python", "import moremoe.hf", "from transformers import "
              "AutoModelForCausalLM" + (", AutoTokenizer" if gpt2 else ""), "",
              "moremoe.hf.register()", 'model = AutoModelForCausalLM.from_pretrained("PATH")']
    if gpt2:
        new = min(32, cfg.max_seq_len - 1)        # "The" is one token; the context holds
        lines += ['tokenizer = AutoTokenizer.from_pretrained("PATH")',
                  'ids = tokenizer("The", return_tensors="pt").input_ids',
                  f"print(tokenizer.decode(model.generate(ids, max_new_tokens={new})[0]))"]
    lines += ["```", ""] + (["or `moremoe generate PATH --prompt TEXT`.", ""] if gpt2 else [])
    lines += _section("Training configuration", info.get("train"))
    lines += _section("Data", info.get("data"), DATA_KEYS)
    metrics = {k: {m: e[m] for m in ("step", *METRIC_KEYS) if m in e}
               for k, e in (info.get("metrics") or {}).items()}
    lines += _section("Last metrics up to this checkpoint", metrics)
    lines += _section("Run summary", info.get("summary"))
    return "\n".join(lines)
