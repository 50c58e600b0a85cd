"""The harness summary: lm-eval's metric keys parsed, and the SQuAD token F1 the paper reports
for TriviaQA and NQ-Open (best over gold answers, mean and standard error over questions)."""
import math

import pytest

from moremoe.eval.zero_shot import summarize, token_f1


def test_token_f1_normalises_like_squad():
    assert token_f1("The Pacific Ocean.", "pacific ocean") == 1.0
    assert token_f1("Pacific", "the Pacific Ocean") == pytest.approx(2 * 1 * 0.5 / 1.5)
    assert token_f1("Mars", "Venus") == 0.0
    assert token_f1("", "") == 1.0 and token_f1("a", "Mars") == 0.0


def test_summary_parses_metrics_and_adds_f1_for_generation_tasks():
    samples = [{"target": ["Paris", "Paris, France"], "filtered_resps": ["paris france"]},
               {"target": ["Au"], "filtered_resps": ["gold"]},
               {"target": "1969", "filtered_resps": ["in 1969"]}]
    results = {
        "results": {"nq": {"alias": "nq", "exact_match,remove_whitespace": 0.0,
                           "exact_match_stderr,remove_whitespace": 0.0},
                    "mc": {"acc,none": 0.5, "acc_stderr,none": "N/A", "sample_len": 2}},
        "configs": {"nq": {"output_type": "generate_until"},
                    "mc": {"output_type": "multiple_choice"}},
        "samples": {"nq": samples, "mc": [{}, {}]},
        "n-samples": {"nq": {"original": 10, "effective": 3}, "mc": {"effective": 2}}}
    out = summarize(results)
    assert out["mc"] == {"n": 2, "metrics": {"acc": {"value": 0.5, "stderr": None,
                                                     "filter": "none"}}}
    nq = out["nq"]["metrics"]
    assert nq["exact_match"]["filter"] == "remove_whitespace" and out["nq"]["n"] == 3
    scores = [1.0, 0.0, 2 / 3]                  # best alias; no overlap; "in 1969" vs "1969"
    mean = sum(scores) / 3
    sd = math.sqrt(sum((s - mean) ** 2 for s in scores) / 2)
    assert nq["f1"]["value"] == pytest.approx(mean)
    assert nq["f1"]["stderr"] == pytest.approx(sd / math.sqrt(3))
