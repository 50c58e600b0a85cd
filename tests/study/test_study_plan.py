"""The language-model study's plan: the paper's matched pair at the study's scale, the
experiments' runs (shared where they are the same run), the learning-rate selection, the
epoch limit, and the settings a study continues with; the report's verdicts."""
import pytest

from moremoe.study.plan import (EXPERIMENTS, StudySettings, changed_frozen, plan_runs,
                                tokens_tag)
from moremoe.study.report import compare, stats, verdict


def test_the_default_plan_is_the_planners_pair_with_a_selection_per_configuration():
    runs = plan_runs(StudySettings())
    lr = [r for r in runs if r.kind == "lr"]
    main = [r for r in runs if r.kind == "main"]
    # the measured pair: MoE-256 at s = 64 against MoRE-1920 at s = 60, r = 32
    assert {(r.model["experts"], r.model["width"], r.model["rank"]) for r in main} == \
        {(256, 64, None), (1920, 60, 32)}
    assert len(main) == 2 * 2 * 3                       # two models, two budgets, three seeds
    assert {r.tokens for r in main} == {60_000_000, 120_000_000}
    assert all(r.lr is None and r.lr_config == r.config for r in main)
    assert sorted((r.uses[0][1], r.lr) for r in lr) == sorted(
        (c, x) for c in ("moe256-s64", "more1920-s60-r32") for x in (5e-4, 1e-3, 3e-3, 5e-3))
    assert all(r.tokens == 20_000_000 and r.seed == 0 for r in lr)
    assert runs[:len(lr)] == lr                         # the selections come first
    assert len({r.name for r in runs}) == len(runs)


def test_experiments_share_the_runs_they_have_in_common():
    s = StudySettings(experiments=EXPERIMENTS)
    runs = plan_runs(s)
    shared = next(r for r in runs if r.name == "more1920-s60-r32-120M-s0")
    assert {e for e, _ in shared.uses} == {"pair", "experts", "rank", "init", "router-lr"}
    experts = sorted({r.model["experts"] for r in runs if ("experts", r.uses[0][1]) in r.uses
                      or any(e == "experts" for e, _ in r.uses)})
    assert experts == [120, 240, 480, 960, 1920]
    ranks = {r.model["rank"]: r.model["experts"] for r in runs
             if any(e == "rank" for e, _ in r.uses)}
    assert ranks == {16: 4096, 32: 1920, 64: 832, 128: 288}     # M fitted to each rank
    init = {(r.model["rank"], r.model["router_init"]) for r in runs
            if any(e == "init" for e, _ in r.uses)}
    assert init == {(r, i) for r in (16, 32, 64) for i in ("variance_matched", "default")}
    # the ablations take the pair MoRE's chosen rate, as the paper ran them at its one rate
    assert {r.lr_config for r in runs if any(e in ("init", "router-lr") for e, _ in r.uses)} \
        == {"more1920-s60-r32"}
    factors = {r.router_lr_factor for r in runs if any(e == "router-lr" for e, _ in r.uses)}
    assert factors == {0.3, 1.0, 3.0}
    paper = [r for r in runs if any(e == "paper" for e, _ in r.uses)]
    assert [(r.model["experts"], r.lr, r.seed) for r in paper] == [(256, 1e-3, 0),
                                                                    (1792, 1e-3, 0)]
    assert not any(r.kind == "lr" and r.uses[0][1].endswith("L12") for r in runs)


def test_a_fixed_rate_plans_no_selection_and_the_epoch_limit_is_kept():
    runs = plan_runs(StudySettings(lr=3e-3))
    assert all(r.kind == "main" and r.lr == 3e-3 for r in runs)
    with pytest.raises(ValueError, match=r"moe256-s64-120M-s0 would train 120,000,000 tokens, "
                                         r"4.80 epochs"):
        plan_runs(StudySettings(lr=3e-3), train_tokens=25_000_000)


def test_a_study_continues_only_with_the_settings_of_its_runs():
    old = StudySettings().to_dict()
    assert changed_frozen(old, StudySettings(seeds=(0, 1, 2, 3), budgets=(30_000_000,),
                                             experiments=("pair", "init"))) == []
    assert changed_frozen(old, StudySettings(hidden=512, overrides=("optim.clip=0",))) == [
        "hidden: 256 -> 512", "overrides: () -> ('optim.clip=0',)"]
    with pytest.raises(ValueError, match="--experiments"):
        StudySettings(experiments=("pair", "nope"))


def test_tokens_tags():
    assert [tokens_tag(t) for t in (120_000_000, 2560, 1_500_000_000, 7)] == \
        ["120M", "2.56K", "1.5B", "7"]


def test_the_verdict_needs_seeds_and_ranges_apart():
    assert stats([1.0, 2.0, 3.0]) == {"n": 3, "mean": 2.0, "std": 1.0, "min": 1.0, "max": 3.0}
    assert verdict([3.0, 3.1], [2.0, 2.1], 0.95, paper_sign=+1) == \
        "same direction, outside the noise"
    assert verdict([3.0, 3.1], [3.05, 2.9], 0.075, paper_sign=+1) == \
        "same direction, within the noise"
    assert verdict([2.0, 2.1], [3.0, 3.1], -1.0, paper_sign=+1) == \
        "opposite, outside the noise"
    assert verdict([3.0], [2.0], 1.0, paper_sign=+1) == "same direction, one seed, no spread"
    row = lambda loss: {"val_loss": loss, "val_ppl": 2.718281828 ** loss}  # noqa: E731
    c = compare({0: row(3.0), 1: row(3.2)}, {0: row(2.9), 2: row(2.0)}, paper_sign=+1)
    assert c["seeds"] == [0] and c["gap"]["n"] == 1           # paired by seed only
    assert c["paper_sign_seeds"] == 1
    both = compare({0: row(3.0), 1: row(2.0)}, {0: row(2.9), 1: row(2.2)}, paper_sign=+1)
    assert both["paper_sign_seeds"] == 1 and both["gap"]["n"] == 2      # +0.1 and -0.2
    assert c["gap"]["mean"] == pytest.approx(0.1) and c["a"]["n"] == c["b"]["n"] == 2


def test_the_gap_curve_follows_the_longest_budget_measured_so_far():
    from moremoe.study.report import pair_report
    s = StudySettings(budgets=(60_000_000, 120_000_000), seeds=(0, 1))
    runs = plan_runs(s)

    def row(loss):
        evals = [{"tokens": t, "val_loss": loss + 1e-8 * (60_000_000 - t)}
                 for t in (20_000_000, 40_000_000, 60_000_000)]
        return {"val_loss": loss, "val_ppl": 2.718281828 ** loss, "evals": evals,
                "tokens_per_param": 1.0, "epochs": 0.3, "wall_s": 1.0, "params": 1}
    short = [r for r in runs if r.kind == "main" and r.tokens == 60_000_000]
    rows = {r.name: row(2.1 if r.model["kind"] == "moe" else 2.0) for r in short}
    rep = pair_report(s, runs, rows)
    assert rep["curve_tokens"] == 60_000_000           # 120M has no row yet
    assert [c["tokens"] for c in rep["curve"]] == [20_000_000, 40_000_000, 60_000_000]
    assert all(c["gap"]["n"] == 2 and c["gap"]["mean"] == pytest.approx(0.1)
               for c in rep["curve"])
    assert pair_report(s, runs, {})["curve"] == []     # nothing measured: nothing drawn


@pytest.mark.parametrize("bad", [{"heads": "4"}, {"seeds": [0, 1]}, {"seeds": (0, "1")},
                                 {"lr": True}, {"hidden": 2.0}, {"experts": (1.5,)},
                                 {"overrides": (1,)}])
def test_a_setting_of_another_type_is_named(bad):
    (name, value), = bad.items()
    with pytest.raises(TypeError, match=rf"setting {name} = "):
        StudySettings(**bad)
    # the optional and the tuple settings take their own types, and None where optional
    StudySettings(heads=4, lr=1, seeds=(0, 1), experts=(32, 64), overrides=("a.b=1",),
                  val_sequences=None)
