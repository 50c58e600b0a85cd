"""Pretraining mixtures as data: which Hub datasets, how many tokens of each, how many times.

The paper's recipe (Appendix "Real-world Pretraining", after Jelassi et al. 2025, App. B.2):
FineWeb-Edu deduplicated 37B tokens, Cosmopedia 14B, Wikipedia 4B unique tokens looped 3
times, and the training splits of 12 knowledge and commonsense benchmarks, each looped 3
times; only ``train`` splits. Token budgets count GPT-2 tokens of a source's document stream
(end-of-text included) and take the first ones in the published order; a benchmark's budget
is its whole split. ``scale`` f shrinks every source in proportion: text budgets become
f x budget, and a benchmark keeps each example with probability f (a seeded hash of its
index, so the subset is uniform over the split and the same for the same seed).

37 + 14 + 3 x 4 = 63B tokens before the benchmarks (about 0.1% more); the paper states the
total as about 60.4B. ``tokens`` targets are converted with the 63B.

Hub choices: FineWeb-Edu deduplicated and Cosmopedia come from SmolLM's corpus (its
``fineweb-edu-dedup`` and ``cosmopedia-v2``, one corpus for both); the benchmarks from the
repositories lm-evaluation-harness reads (PIQA and SocialIQA from the parquet copies it
uses), HotpotQA from hotpotqa/hotpot_qa, and ComplexWebQuestions, a loading script upstream
(which ``datasets`` no longer runs), from the Hub's parquet conversion of it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from .formats import FORMATS


@dataclass(frozen=True)
class SourceSpec:
    name: str                   # the source's name on the command line (--source NAME=PATH)
    title: str
    hub: str                    # Hugging Face dataset id
    config: str | None          # its configuration (the "name" argument of load_dataset)
    format: str                 # a key of formats.FORMATS
    budget: int | None          # GPT-2 tokens at scale 1; None = the whole split
    repeats: int = 1            # times each sequence is written
    split: str = "train"
    revision: str | None = None
    data_dir: str | None = None
    fraction: float = 1.0       # of a whole-split source's examples (set by scaled())

    def __post_init__(self):
        if self.format not in FORMATS:
            raise ValueError(f"source {self.name}: format must be one of {sorted(FORMATS)}, "
                             f"got {self.format!r}")
        if self.repeats < 1 or (self.budget is not None and self.budget < 0):
            raise ValueError(f"source {self.name}: repeats must be >= 1 and budget >= 0, got "
                             f"{self.repeats} and {self.budget}")

    @property
    def hub_ref(self) -> str:
        """id[:config][@revision][ data_dir=DIR], as the error messages and --list show it."""
        return (self.hub + (f":{self.config}" if self.config else "")
                + (f"@{self.revision}" if self.revision else "")
                + (f" data_dir={self.data_dir}" if self.data_dir else ""))


def _benchmark(name, title, hub, config=None, fmt=None, **kw) -> SourceSpec:
    return SourceSpec(name, title, hub, config, fmt or name, None, 3, **kw)


_PARQUET = "refs/convert/parquet"

PAPER: tuple[SourceSpec, ...] = (
    SourceSpec("fineweb_edu", "FineWeb-Edu, deduplicated", "HuggingFaceTB/smollm-corpus",
               "fineweb-edu-dedup", "text", 37_000_000_000),
    SourceSpec("cosmopedia", "Cosmopedia (v2)", "HuggingFaceTB/smollm-corpus",
               "cosmopedia-v2", "text", 14_000_000_000),
    SourceSpec("wikipedia", "Wikipedia (English)", "wikimedia/wikipedia", "20231101.en",
               "wikipedia", 4_000_000_000, 3),
    _benchmark("triviaqa", "TriviaQA", "mandarjoshi/trivia_qa", "rc.nocontext"),
    _benchmark("nq_open", "Natural Questions (open)", "google-research-datasets/nq_open"),
    _benchmark("hotpotqa", "HotpotQA", "hotpotqa/hotpot_qa", "distractor"),
    _benchmark("webqs", "WebQuestions", "stanfordnlp/web_questions"),
    _benchmark("cwq", "ComplexWebQuestions", "drt/complex_web_questions", revision=_PARQUET,
               data_dir="complex_web_questions"),
    _benchmark("arc_easy", "ARC-Easy", "allenai/ai2_arc", "ARC-Easy", "arc"),
    _benchmark("hellaswag", "HellaSwag", "Rowan/hellaswag"),
    _benchmark("openbookqa", "OpenBookQA", "allenai/openbookqa", "main"),
    _benchmark("piqa", "PIQA", "baber/piqa"),
    _benchmark("sciq", "SciQ", "allenai/sciq"),
    _benchmark("siqa", "SocialIQA", "lighteval/siqa"),
    _benchmark("winogrande", "Winogrande (XL)", "allenai/winogrande", "winogrande_xl"),
)
RECIPES = {"paper": PAPER}


def nominal_tokens(recipe) -> int:
    """Tokens written at scale 1 by the sources with a budget (budget x repeats)."""
    return sum(s.budget * s.repeats for s in recipe if s.budget is not None)


def scale_for(recipe, tokens: int) -> float:
    """The scale whose budgeted sources write ``tokens`` tokens in all."""
    full = nominal_tokens(recipe)
    if not 0 < tokens <= full:
        raise ValueError(f"--tokens must be in [1, {full:,}] (the whole recipe), got "
                         f"{tokens:,}")
    return tokens / full


def scaled(recipe, scale: float) -> tuple[SourceSpec, ...]:
    """The recipe at ``scale`` in (0, 1]: budgets rounded to whole tokens, whole-split
    sources given ``fraction = scale``."""
    if not 0 < scale <= 1 or not math.isfinite(scale):
        raise ValueError(f"--scale must be in (0, 1], got {scale}")
    return tuple(replace(s, budget=round(s.budget * scale)) if s.budget is not None
                 else replace(s, fraction=s.fraction * scale) for s in recipe)


def select(recipe, skip) -> tuple[SourceSpec, ...]:
    """The recipe without the sources named in ``skip`` (each must be in it)."""
    names = [s.name for s in recipe]
    unknown = [n for n in skip if n not in names]
    if unknown:
        raise ValueError(f"--skip {','.join(unknown)}: not a source of the recipe; expected "
                         f"some of {','.join(names)}")
    kept = tuple(s for s in recipe if s.name not in skip)
    if not kept:
        raise ValueError("--skip leaves no source; keep at least one")
    return kept


def describe(spec: SourceSpec) -> dict:
    """The recipe entry of a source, as the manifest and --list --json give it."""
    return {"name": spec.name, "title": spec.title, "hub": spec.hub, "config": spec.config,
            "revision": spec.revision, "data_dir": spec.data_dir, "split": spec.split,
            "budget_tokens": spec.budget, "fraction": spec.fraction, "repeats": spec.repeats,
            "format": spec.format, "template": FORMATS[spec.format].template}
