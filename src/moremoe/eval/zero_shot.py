"""Zero-shot lm-evaluation-harness runs and their summary in the paper's form.

``run_harness`` evaluates an lm-eval LM (the ``moremoe`` adapter) on named tasks and returns,
per task, every metric lm-eval reports with its standard error. For tasks that generate
text (TriviaQA, NQ-Open) it adds the SQuAD token F1, the paper's column for those two, from
lm-eval's logged samples (lm-eval's own metric for them is exact match): per question the
best F1 over the gold answers, then the mean and its standard error over questions.
lm_eval is imported inside the functions (the ``eval`` extra).
"""
from __future__ import annotations

import contextlib
import importlib
import json
import math
import os
import re
import socket
import string
import subprocess
import sys
from collections import Counter
from pathlib import Path

from ..checks import UserError

PAPER_TASKS = ("triviaqa", "nq_open", "hellaswag", "arc_easy", "sciq", "winogrande")
# the metric each task has in the paper's table
PAPER_METRIC = {"triviaqa": "f1", "nq_open": "f1", "hellaswag": "acc_norm", "arc_easy": "acc",
                "sciq": "acc", "winogrande": "acc"}


def resolve_eval_model(path: str | Path) -> tuple[Path, dict | None, list]:
    """(path to load, checkpoint, passed over): a transformers directory as it is (checkpoint
    None); a moremoe checkpoint, or a run directory's newest checkpoint with complete model
    files, as {"path", "step"} (step None for a folder not named step_N), with the run's
    newer incomplete checkpoints that were passed over (model.checkpoint.choose)."""
    from ..model.checkpoint import choose, step_of
    path = Path(path)
    if not path.exists():
        raise ValueError(f"model path {str(path)!r} does not exist")
    if _transformers_dir(path):
        return path, None, []
    other = _model_type(path)
    if other is not None:
        raise ValueError(f"MODEL {path} is a transformers model of model_type {other!r}; "
                         f"eval reads moremoe models: a checkpoint, a run directory or a "
                         f"folder written by `moremoe hf export`")
    ckpt, passed = choose(path, weights_only=True)
    return ckpt, {"path": str(ckpt), "step": step_of(ckpt)}, passed


def load_eval_model(path: str | Path, device="cpu"):
    """The Transformer of a transformers directory (config.json with model_type "moremoe"), or
    of a moremoe checkpoint or run directory, in eval mode on device."""
    path = Path(path)
    if not path.exists():
        raise ValueError(f"model path {str(path)!r} does not exist")
    if _transformers_dir(path):
        model = _load_export(path).to(device).eval()
    else:
        from ..model.checkpoint import load_model
        model = load_model(path, device=device).eval()
    check_finite(model, path)
    return model


def check_finite(model, path) -> None:
    """ValueError naming the tensors of weights that hold NaN or infinity: such a model
    answers every prompt with the same token and scores no perplexity, silently."""
    import torch
    bad = [name for name, p in model.named_parameters() if not torch.isfinite(p).all()]
    if bad:
        total = sum(1 for _ in model.parameters())
        raise ValueError(f"MODEL {path}: its weights are not finite ({len(bad)} of {total} "
                         f"tensors hold NaN or infinity, {bad[0]} first): the run that wrote "
                         f"them diverged; use an earlier checkpoint")


def _load_export(path: Path):
    """The Transformer of a folder written by `moremoe hf export`; a damaged weights file is
    named before transformers reads it (it fails with an error of its own type)."""
    from ..hf import MoremoeForCausalLM
    from ..model.checkpoint import safetensors_problem
    for weights in sorted(path.glob("*.safetensors")):
        why = safetensors_problem(weights)
        if why:
            raise ValueError(f"MODEL {path}: {weights.name} {why}; the file is damaged: export "
                             f"or copy it again")
    return MoremoeForCausalLM.from_pretrained(path).to_transformer()


def _transformers_dir(path: Path) -> bool:
    """Whether path holds a transformers config.json of model_type "moremoe" (a moremoe
    checkpoint's config.json, or a damaged one, is not: load_model reports on those)."""
    return _model_type(path) == "moremoe"


def _model_type(path: Path) -> str | None:
    """The model_type of a transformers config.json in path, else None."""
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return config.get("model_type") if isinstance(config, dict) else None


def task_manager(tasks, *, include_path: str | None = None, include_defaults: bool = True):
    """lm-eval's TaskManager, after checking that it knows every task. Tasks are looked up
    in include_path, then (include_defaults) among lm-eval's installed tasks, whose index
    takes seconds to build."""
    try:
        from lm_eval.tasks import TaskManager
    except ImportError:
        raise ImportError("lm-eval is needed: pip install 'moremoe[eval]'") from None
    if include_path is not None and not Path(include_path).is_dir():
        raise ValueError(f"--include-path {include_path}: no such folder of task YAMLs")
    manager = TaskManager(include_path=include_path, include_defaults=include_defaults)
    unknown = [t for t in tasks if t not in manager.all_tasks and not Path(t).is_file()]
    if unknown:
        where = " or in --include-path" if include_path else ""
        raise ValueError(f"unknown task {', '.join(unknown)}: not among lm-eval's "
                         f"{len(manager.all_tasks):,} tasks{where} (list them with "
                         f"`lm_eval --tasks list`)")
    return manager


def run_harness(lm, tasks, *, num_fewshot: int = 0, limit: int | float | None = None,
                include_path: str | None = None, include_defaults: bool = True,
                seed: int = 1234, manager=None) -> dict:
    """{task: {"n": int, "metrics": {metric: {"value", "stderr", "filter"}}}}; manager: a
    task_manager of these tasks (built here when None)."""
    if manager is None:
        manager = task_manager(tasks, include_path=include_path,
                               include_defaults=include_defaults)
    import lm_eval
    try:
        results = lm_eval.simple_evaluate(
            model=lm, tasks=list(tasks), num_fewshot=num_fewshot, limit=limit,
            task_manager=manager, log_samples=True, random_seed=seed, numpy_random_seed=seed,
            torch_random_seed=seed, fewshot_random_seed=seed)
    except ConnectionError as err:       # datasets' "Couldn't reach ... on the Hub"
        raise UserError(f"{err}: the tasks' datasets must be downloaded first (run the "
                        f"evaluation once on a machine with network and copy "
                        f"~/.cache/huggingface, or set HF_HOME to a copy), or give local "
                        f"task YAMLs with --include-path") from err
    return summarize(results)


@contextlib.contextmanager
def quiet_libraries(progress: bool, *, lm_eval: bool = False):
    """While a command evaluates or loads a model: no per-load bar of transformers (the
    command reports itself), no git error line from lm-eval (it asks `git describe` for the
    results' git_hash, with stderr on the terminal: outside a repository that prints
    "fatal: not a git repository"; the hash asked quietly instead), and with progress off
    no bar of lm-eval (its modules' tqdm made a disabled one), datasets or the hub either
    (their switches)."""
    try:
        from transformers.utils import logging as hf_logging
        hf_logging.disable_progress_bar()
    except ImportError:
        pass
    saved = []                                     # (module, name, what it was)

    def swap(module, name, value):
        if module is not None and hasattr(module, name):
            saved.append((module, name, getattr(module, name)))
            setattr(module, name, value)
    if lm_eval:
        swap(_module("lm_eval.evaluator"), "get_git_commit_hash", _git_hash)
    if not progress:
        if lm_eval:
            from tqdm import tqdm
            for name in LM_EVAL_BARS:
                swap(_module(name), "tqdm", lambda *a, **kw: tqdm(*a, **{**kw, "disable": True}))
        for name in ("datasets", "huggingface_hub.utils"):
            switch = getattr(_module(name), "disable_progress_bars", None)
            if switch is not None:
                switch()
    try:
        yield
    finally:
        for module, name, value in reversed(saved):
            setattr(module, name, value)


# lm-eval's modules that draw tqdm bars of their own (building contexts, tokenizing, metrics)
LM_EVAL_BARS = ("lm_eval.api.task", "lm_eval.api.model", "lm_eval.api.metrics",
                "lm_eval.evaluator", "lm_eval.models.utils")


def _module(name: str):
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def _git_hash() -> str | None:
    """lm-eval's git_hash of the working folder, asked without writing to the terminal."""
    try:
        out = subprocess.run(["git", "describe", "--always"], capture_output=True, text=True)
    except OSError:
        return None
    return out.stdout.strip() or None


HUB = ("huggingface.co", 443)
OFFLINE_VARS = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")


def offline_unless_hub_reachable(timeout: float = 3.0) -> bool:
    """One attempt to reach the Hugging Face Hub; if it fails, switch the hub and datasets
    libraries to offline mode (the local cache only), so a missing dataset is one clear
    error instead of minutes of retries. Returns whether the hub is reachable (False, and
    no attempt, when offline mode is already set)."""
    if any(os.environ.get(v, "0") not in ("", "0") for v in OFFLINE_VARS):
        return False
    try:
        socket.create_connection(HUB, timeout=timeout).close()
        return True
    except OSError:
        pass
    for var in OFFLINE_VARS:
        os.environ[var] = "1"
    hub, ds = sys.modules.get("huggingface_hub.constants"), sys.modules.get("datasets.config")
    if hub is not None:
        hub.HF_HUB_OFFLINE = True
    if ds is not None:
        ds.HF_DATASETS_OFFLINE = True
    return False



def summarize(results: dict) -> dict:
    out = {}
    for task, row in results["results"].items():
        metrics = {}
        for key, value in row.items():
            if "," not in key or "_stderr," in key:
                continue
            name, filt = key.split(",", 1)
            stderr = row.get(f"{name}_stderr,{filt}")
            metrics[name] = {"value": _float(value), "stderr": _float(stderr), "filter": filt}
        samples = results.get("samples", {}).get(task, [])
        if samples and results["configs"][task].get("output_type") == "generate_until":
            metrics["f1"] = _f1_of_samples(samples)
        n = results.get("n-samples", {}).get(task, {}).get("effective", len(samples))
        out[task] = {"n": n, "metrics": metrics}
    return out


def _float(x):
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None


_PUNCT = frozenset(string.punctuation)


def _normalize(text: str) -> list[str]:
    """SQuAD's answer normalisation: lower case, no punctuation, no articles."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCT)
    return re.sub(r"\b(a|an|the)\b", " ", text).split()


def token_f1(prediction: str, gold: str) -> float:
    pred, ref = _normalize(prediction), _normalize(gold)
    if not pred or not ref:
        return float(pred == ref)
    same = sum((Counter(pred) & Counter(ref)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred), same / len(ref)
    return 2 * precision * recall / (precision + recall)


def _f1_of_samples(samples: list[dict]) -> dict:
    scores = []
    for s in samples:
        resp = s["filtered_resps"]
        pred = resp[0] if isinstance(resp, list) else resp
        golds = s["target"] if isinstance(s["target"], list) else [s["target"]]
        scores.append(max(token_f1(str(pred), str(g)) for g in golds))
    n = len(scores)
    mean = sum(scores) / n
    var = sum((x - mean) ** 2 for x in scores) / (n - 1) if n > 1 else float("nan")
    return {"value": mean, "stderr": math.sqrt(var / n), "filter": "token_f1"}
