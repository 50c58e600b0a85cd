"""The lm-eval adapter: log-likelihoods equal the model's log-softmax summed by hand, rolling
windows cover a short text exactly, generation stops at the stop string, and the six paper
tasks (local fixtures, the installed prompts) produce each metric with its standard error."""
import math

import pytest
import torch

lm_eval = pytest.importorskip("lm_eval")
pytest.importorskip("datasets")
pytest.importorskip("tiktoken")

from lm_eval.api.instance import Instance  # noqa: E402

from moremoe.eval.zero_shot import PAPER_TASKS, run_harness  # noqa: E402
from moremoe.eval.lm_eval_adapter import EOT_ID, MoremoeLM  # noqa: E402
from moremoe.model import Transformer, TransformerConfig  # noqa: E402
from moremoe.nn import MoEConfig  # noqa: E402



def tiny_gpt2_model(max_seq_len=64):
    cfg = TransformerConfig(vocab=50257, layers=1, heads=2, kv_heads=1, max_seq_len=max_seq_len,
                            moe=MoEConfig.more(8, 2, 32, 8, 4))
    return Transformer(cfg).eval()


@pytest.fixture(scope="module")
def lm():
    torch.manual_seed(0)
    return MoremoeLM(model=tiny_gpt2_model(), batch_size=3, max_gen_toks=12)


def req(kind, *args):
    return Instance(request_type=kind, doc={}, arguments=args, idx=0)


@torch.no_grad()
def logprob_by_hand(model, context, continuation):
    tokens = torch.tensor([(context + continuation)[:-1]])    # the last token is only a target
    logp = torch.log_softmax(model(tokens).logits[0].double(), -1)
    return sum(float(logp[len(context) - 1 + i, t]) for i, t in enumerate(continuation))


def test_loglikelihood_is_the_sum_of_log_softmax(lm):
    ctx, cont = "The capital of France is", " Paris, a city"
    c, x = lm.tok_encode(ctx), lm.tok_encode(cont)
    assert lm.tok_encode(ctx + cont) == c + x          # no merge across the boundary
    (logp, greedy), = lm.loglikelihood([req("loglikelihood", ctx, cont)])
    assert logp == pytest.approx(logprob_by_hand(lm.model, c, x), rel=1e-5)
    assert greedy is False and logp < 0


def test_batches_truncation_and_greedy_flag(lm):
    texts = [("Question: what is two plus two?\nAnswer:", " four"), ("A", " b c d e f"),
             ("x " * 80, " y"), ("One two three", " four five")]
    batched = lm.loglikelihood([req("loglikelihood", *t) for t in texts])
    one = MoremoeLM(model=lm.model, batch_size=1)
    singly = [one.loglikelihood([req("loglikelihood", *t)])[0] for t in texts]
    for (a, ga), (b, gb) in zip(batched, singly):
        assert a == pytest.approx(b, rel=1e-5, abs=1e-5) and ga == gb
    # ("x " * 80) is longer than max_seq_len=64: only the last 64 + 1 tokens are used
    c, x = lm._encode_pair(*texts[2])
    window = (c + x)[-65:]
    assert batched[2][0] == pytest.approx(
        logprob_by_hand(lm.model, window[:-len(x)], x), rel=1e-5)
    # a continuation that is the greedy token is flagged greedy
    c = lm.tok_encode("One two three")
    best = int(lm.model(torch.tensor([c])).logits[0, -1].argmax())
    (_, greedy), = lm._loglikelihood_tokens([(None, c, [best])])
    assert greedy is True


def test_rolling_loglikelihood_of_a_short_text_is_the_full_sum(lm):
    text = "Mixture of experts layers route each token to a few experts."
    tokens = lm.tok_encode(text)
    assert len(tokens) < lm.max_length
    got, = lm.loglikelihood_rolling([req("loglikelihood_rolling", text)])
    assert got == pytest.approx(logprob_by_hand(lm.model, [EOT_ID], tokens), rel=1e-5)
    # a text longer than max_seq_len: lm-eval's disjoint windows predict every token once,
    # and the total is the sum of each window's log-probability computed by hand
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
    long_tokens = lm.tok_encode(text * 8)
    assert len(long_tokens) > lm.max_length
    windows = [make_disjoint_window(w) for w in get_rolling_token_windows(
        token_list=long_tokens, prefix_token=EOT_ID, max_seq_len=lm.max_length, context_len=1)]
    assert sum(len(cont) for _, cont in windows) == len(long_tokens)
    long, = lm.loglikelihood_rolling([req("loglikelihood_rolling", text * 8)])
    want = sum(logprob_by_hand(lm.model, ctx, cont) for ctx, cont in windows)
    assert long == pytest.approx(want, rel=1e-5)


def test_generate_until_stops_at_the_stop_string(lm):
    ctx = "Question: Which planet is known as the Red Planet?\nAnswer:"
    free, = lm.generate_until([req("generate_until", ctx, {"until": [], "max_gen_toks": 12})])
    assert len(lm.tok_encode(free)) >= 6     # random weights: no early <|endoftext|>
    stop = free[len(free) // 2:len(free) // 2 + 2]
    cut, = lm.generate_until([req("generate_until", ctx, {"until": [stop], "max_gen_toks": 12})])
    assert cut == free.split(stop)[0] and len(cut) < len(free)
    two, = lm.generate_until([req("generate_until", ctx, {"until": stop, "max_gen_toks": 2})])
    assert len(lm.tok_encode(two)) <= 2 and free.startswith(two)


def test_generate_until_takes_the_static_path_with_the_eager_tokens(lm):
    """One StaticDecoder (one row, max_seq_len positions) serves every request, and its text
    is the eager loop's, for contexts on both sides of a prefill bucket's edge."""
    from moremoe.model import generate
    eot, decoders = lm.tok_decode([EOT_ID]), []
    for ctx in ("Question: Which planet is known as the Red Planet?\nAnswer:", "Hi", "x " * 20):
        ids = lm.tok_encode(ctx)
        want = lm.tok_decode(generate(lm.model, torch.tensor([ids]), 12, eos_id=EOT_ID)[0])
        got, = lm.generate_until([req("generate_until", ctx, {"until": [], "max_gen_toks": 12})])
        assert got == want.split(eot)[0], ctx
        decoders.append(lm.decoder)
    assert decoders[0] is decoders[1] is decoders[2] is not None
    assert (decoders[0].batch, decoders[0].max_len) == (1, lm.max_length)


EXPECTED = {"triviaqa": {"exact_match", "f1"}, "nq_open": {"exact_match", "f1"},
            "hellaswag": {"acc", "acc_norm"}, "arc_easy": {"acc", "acc_norm"},
            "sciq": {"acc", "acc_norm"}, "winogrande": {"acc"}}


def test_the_six_paper_tasks_give_metrics_with_standard_errors(lm, lm_eval_tasks):
    tasks = [f"{t}_fixture" for t in PAPER_TASKS]
    summary = run_harness(lm, tasks, include_path=str(lm_eval_tasks),
                          include_defaults=False)
    assert sorted(summary) == sorted(tasks)
    for task in PAPER_TASKS:
        got = summary[f"{task}_fixture"]
        assert got["n"] == 4
        assert set(got["metrics"]) == EXPECTED[task]
        for name, m in got["metrics"].items():
            assert 0 <= m["value"] <= 1 and math.isfinite(m["stderr"]), (task, name, m)
    # lm-eval's standard error of a mean over n = 4 rows: sqrt(p (1 - p) / (n - 1))
    wg = summary["winogrande_fixture"]["metrics"]["acc"]
    assert wg["stderr"] == pytest.approx(math.sqrt(wg["value"] * (1 - wg["value"]) / 3))


def test_registered_as_moremoe_and_loads_a_transformers_directory(lm, tmp_path):
    from lm_eval.api.registry import get_model

    from moremoe.hf import export
    assert get_model("moremoe") is MoremoeLM
    export(lm.model, tmp_path / "hf")
    loaded = MoremoeLM.create_from_arg_string(
        f"pretrained={tmp_path / 'hf'},max_gen_toks=5",
        {"batch_size": 2, "max_batch_size": None, "device": "cpu"})
    request = [req("loglikelihood", "Question: why?\nAnswer:", " because")]
    assert loaded.loglikelihood(request) == lm.loglikelihood(request)
    assert loaded.max_gen_toks == 5 and loaded.batch_size == 2
