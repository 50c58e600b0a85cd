"""Accounting and the planner against the paper's tables."""
import math

import pytest

from moremoe import accounting as acc

# Table fineweb_flops_train_inf: (label, M, s, r) at h, k=4 -> (training, inference) in M FLOPs
FLOPS_TABLE = [
    ("MoE-128", 128, 32, None, 1024, 4.19, 1.57),
    ("MoRE-1536", 1536, 24, 64, 1024, 4.06, 1.57),
    ("MoE-256", 256, 64, None, 512, 4.19, 1.57),
    ("MoRE-1792", 1792, 56, 64, 512, 4.13, 1.57),
    ("MoE-256", 256, 128, None, 512, 6.55, 2.36),
    ("MoRE-1792", 1792, 112, 64, 512, 6.19, 2.26),
    ("MoE-1024", 1024, 64, None, 512, 9.70, 3.93),
    ("MoRE-8192", 8192, 52, 64, 512, 9.72, 3.98),
]


@pytest.mark.parametrize("label,M,s,r,h,train,inf", FLOPS_TABLE)
def test_flops_table_exact_at_printed_precision(label, M, s, r, h, train, inf):
    assert round(acc.active_flops(M, 4, h, s, r, training=True) / 1e6, 2) == train
    assert round(acc.active_flops(M, 4, h, s, r) / 1e6, 2) == inf


def test_flops_formulas():
    assert acc.active_flops(10, 2, 8, 3) == 6 * 2 * 8 * 3 + 6 * 10 * 8
    assert acc.active_flops(10, 2, 8, 3, 4, training=True) == 18 * 2 * 8 * 3 + 14 * (10 + 8) * 4
    assert acc.router_params(10, 8) == 80 and acc.router_params(10, 8, 4) == 72
    assert acc.expert_params(10, 8, 3) == 720


# Table fineweb_p3_results total parameters, as printed: h = 1024 uses 16 heads / 4 kv heads,
# h = 512 8 heads / 2 kv heads (the presets and `moremoe flops --paper-model`).
TOTALS = [
    (128, 32, None, 1024, 16, 4, "287.0e6"),
    (1536, 24, 64, 1024, 16, 4, "1.50e9"),
    (256, 64, None, 512, 8, 2, "362.9e6"),
    (1792, 56, 64, 512, 8, 2, "1.91e9"),
    (256, 128, None, 512, 8, 2, "664.9e6"),
    (1792, 112, 64, 512, 8, 2, "3.76e9"),
    (1024, 64, None, 512, 8, 2, "1.27e9"),
    (8192, 52, 64, 512, 8, 2, "7.92e9"),
]


@pytest.mark.parametrize("M,s,r,h,heads,kv,paper", TOTALS)
def test_total_params_equal_the_paper_to_its_printed_digits(M, s, r, h, heads, kv, paper):
    got = acc.total_params(vocab=50257, hidden=h, layers=12, experts=M, width=s, heads=heads,
                           kv_heads=kv, rank=r)
    digits = len(paper.split("e")[0].replace(".", "").lstrip("0"))
    assert float(f"{got:.{digits}g}") == float(paper)


def test_total_params_formula_terms():
    got = acc.total_params(vocab=40, hidden=16, layers=2, experts=4, width=3, heads=2,
                           kv_heads=1, rank=5)
    per_layer = (4 + 16) * 5 + 3 * 4 * 16 * 3 + (2 * 16 * 16 + 2 * 16 * 1 * 8) + 2 * 16
    assert got == 2 * 40 * 16 + 16 + 2 * per_layer


# Tables phonebook_configs_h and phonebook_configs_s: MoE M = 4 s, MoRE M' = h (s-2) / 4.
PHONEBOOK = [(64, 8, 32, 96), (128, 8, 32, 192), (256, 8, 32, 384), (512, 8, 32, 768),
             (64, 16, 64, 224), (64, 32, 128, 480), (64, 64, 256, 992)]


@pytest.mark.parametrize("h,s,M,M_more", PHONEBOOK)
def test_planner_reproduces_phonebook_configs(h, s, M, M_more):
    # The paper rounds s' = s - 2 up to s (a multiple of 8) and keeps M' unchanged.
    plan = acc.plan_matched(hidden=h, width=s, top_k=4, rank=16, round_width=8, refit=False)
    assert (plan.moe.experts, plan.moe.width) == (M, s)
    assert (plan.more.experts, plan.more.width) == (M_more, s)
    assert plan.more_optimum == (h * (s - 2) / 4, s - 2)
    # Unrounded, the optimum is integral and re-fitting it changes nothing.
    exact = acc.plan_matched(hidden=h, width=s, top_k=4, rank=16)
    assert (exact.more.experts, exact.more.width) == (M_more, s - 2)
    assert exact.more.flops == exact.moe.flops == exact.budget


@pytest.mark.parametrize("h,s,M_more,s_more", [(1024, 32, 1536, 24), (512, 64, 1792, 56)])
def test_planner_reproduces_pretraining_configs(h, s, M_more, s_more):
    plan = acc.plan_matched(hidden=h, width=s, top_k=4, rank=64)
    assert (plan.moe.experts, plan.more.experts, plan.more.width) == (4 * s, M_more, s_more)


def test_planner_optimum_and_limit():
    tau, h, k, r = 1e9, 2048, 4, 16
    M, s = acc.optimum(tau, h, k, ce=6, cr=6)
    M2, s2 = acc.optimum(tau, h, k, r, ce=6, cr=6)
    assert math.isclose(M, tau / (12 * h)) and math.isclose(s, tau / (12 * k * h))
    assert math.isclose(M2, (tau - 6 * h * r) / (12 * r))
    assert M2 / M == pytest.approx(h / r * (1 - 6 * h * r / tau))
    # the optimum splits the variable budget equally between router and experts
    assert 6 * M2 * r == pytest.approx(6 * k * h * s2)


def test_planner_refit_stays_within_budget():
    plan = acc.plan_matched(hidden=512, width=64, top_k=4, rank=64, round_width=16)
    assert plan.more.width % 16 == 0
    assert plan.more.flops <= plan.budget
    bigger = acc.active_flops(plan.more.experts + 1, 4, 512, plan.more.width, 64)
    assert bigger > plan.budget


def test_planner_fit_width_reproduces_more_8192():
    # The M=1024 / M'=8192 pair fixes M' = (h/r) M and fits s' to the training budget.
    tau = acc.active_flops(1024, 4, 512, 64, training=True)
    assert round(acc.fit_width(tau, 512, 4, 8192, 64, ce=18, cr=14)) == 52


@pytest.mark.parametrize("rank", [None, 16])
def test_widest_width_is_the_last_width_fit_experts_accepts(rank):
    tau, h, k = 24_576.0, 64, 4
    widest = acc.widest_width(tau, h, k, rank)
    assert widest == (11 if rank else 15)
    assert acc.fit_experts(tau, h, k, widest, rank) >= k
    with pytest.raises(ValueError, match="leaves room for only"):
        acc.fit_experts(tau, h, k, widest + 1, rank)
    assert acc.round_to(6.0, 1000) == 1000 and acc.round_to(7.77, 8) == 8


def test_planner_errors_name_the_argument():
    with pytest.raises(ValueError, match="budget"):
        acc.plan_matched(hidden=512, top_k=4, rank=64, budget=100.0)
    with pytest.raises(ValueError, match="exactly one"):
        acc.plan_matched(hidden=512, top_k=4, rank=64)
    with pytest.raises(ValueError, match="top_k"):
        acc.active_flops(4, 5, 8, 8)
    with pytest.raises(ValueError, match="rank"):
        acc.active_flops(4, 2, 8, 8, 0)


def test_peer_accounting_matches_appendix_b():
    # M = 388^2, H = 8, d_q = 32, kappa = 56 -> k = 448 (Appendix B.1)
    experts, router = acc.peer_params(388 ** 2, 512, 8, 32)
    assert experts == 2 * 388 ** 2 * 512 and router == 8 * 512 * 32 + 388 * 32
    flops = acc.peer_active_flops(388 ** 2, 512, 8, 32, 56)
    assert flops == 12 * 448 * 512 + 6 * 8 * 32 * (512 + 388)
    # matched to the MoRE-1792 (s'=56) layer's training FLOPs within 1 %
    assert abs(flops - acc.active_flops(1792, 4, 512, 56, 64, training=True)) / flops < 0.01
    with pytest.raises(ValueError, match="perfect-square"):
        acc.peer_params(1000, 512, 8, 32)
