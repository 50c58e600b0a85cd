"""Run configs: presets, YAML files, --set overrides, type checks and the errors' wording."""
import pytest
import torch
from cli_checks import fails

from moremoe.cli import main
from moremoe.training.compose import build_run_config, parse_override
from moremoe.training.config import RunConfig
from moremoe.training.presets import PAIRS, get_preset, preset_names, preset_rows


def test_paper_presets_match_the_paper_tables():
    rows = {r["name"]: r for r in preset_rows()}
    # Table fineweb_p3_results: total parameters and active inference FLOPs per layer
    paper = {"h1024-s32-moe128": (287.0e6, 1.57e6), "h1024-s32-more1536": (1.50e9, 1.57e6),
             "h512-s64-moe256": (362.9e6, 1.57e6), "h512-s64-more1792": (1.91e9, 1.57e6),
             "h512-s128-moe256": (664.9e6, 2.36e6), "h512-s128-more1792": (3.76e9, 2.26e6),
             "h512-s64-moe1024": (1.27e9, 3.93e6), "h512-s64-more8192": (7.92e9, 3.98e6)}
    for name, (params, flops) in paper.items():
        assert rows[name]["params_total"] == pytest.approx(params, rel=5e-3), name
        assert rows[name]["moe_flops_inference"] == pytest.approx(flops, rel=5e-3), name
    more = get_preset("h512-s64-more1792")
    assert (more.model.kind, more.model.rank, more.model.experts, more.model.width) == \
        ("more", 64, 1792, 56)
    assert more.optim.lr == 1e-3 and more.optim.betas == (0.9, 0.95)
    assert more.train.max_tokens == 40_000_000_000
    assert rows["tiny-moe"]["moe_flops_inference"] == rows["tiny-more"]["moe_flops_inference"]
    assert {"tiny-moe", "tiny-more"} <= set(preset_names())


def test_same_shape_preset_is_more1792_with_the_standard_router():
    """h512-s56-moe1792 = h512-s64-more1792 with model.kind=moe and no rank: its parameters
    differ only by the routers (12 layers of M h = 917,504 against r (M + h) = 147,456)."""
    moe, more = get_preset("h512-s56-moe1792"), get_preset("h512-s64-more1792")
    assert (moe.model.kind, moe.model.rank) == ("moe", None)
    assert {**moe.model.__dict__, "kind": "more", "rank": 64} == more.model.__dict__
    assert (moe.optim, moe.train) == (more.optim, more.train)
    rows = {r["name"]: r for r in preset_rows()}
    assert rows["h512-s56-moe1792"]["params_total"] - rows["h512-s64-more1792"]["params_total"] \
        == 12 * (1792 * 512 - 64 * (1792 + 512))
    assert PAIRS["h512-s56-same"] == ("h512-s56-moe1792", "h512-s64-more1792")
    assert "h512-s56-moe1792" in preset_names()


def test_layers_preset_file_set_and_flags(tmp_path):
    f = tmp_path / "run.yaml"
    f.write_text("preset: tiny-more\nmodel: {hidden: 32, heads: 2}\n"
                 "optim: {lr: 1e-3, betas: [0.8, 0.9]}\ntrain: {batch_size: 4}\n")
    cfg = build_run_config(config_file=str(f), overrides=["optim.lr=3e-4", "train.seed=7",
                                                          "optim.router_lr=null"],
                           data="d", max_steps=5, max_minutes=None)
    assert cfg.preset == "tiny-more" and cfg.model.kind == "more" and cfg.model.hidden == 32
    assert cfg.optim.lr == 3e-4 and cfg.optim.betas == (0.8, 0.9)   # "1e-3" / list coerced
    assert cfg.train.batch_size == 4 and cfg.train.seed == 7 and cfg.train.max_steps == 5
    assert cfg.train.data == "d" and cfg.optim.router_lr is None
    assert RunConfig.from_dict(cfg.to_dict()) == cfg
    assert build_run_config(overrides=["train.max_tokens=40e9"]).train.max_tokens == 40 * 10**9


@pytest.mark.parametrize("override, error, match", [
    ("train.batchsize=3", KeyError, r"'train\.batchsize'; did you mean 'train\.batch_size'"),
    ("trian.seed=3", KeyError, r"unknown config key 'trian'.*did you mean 'train'"),
    ("train.batch_size=abc", TypeError, r"train\.batch_size must be an integer, got 'abc'"),
    ("train.batch_size=2.5", TypeError, r"train\.batch_size must be an integer, got 2\.5"),
    ("optim.betas=[0.9]", TypeError, r"optim\.betas must be a list of 2 numbers"),
    ("train.autocast=maybe", TypeError, r"train\.autocast must be true/false"),
    ("train.batch_size=0", ValueError, r"train\.batch_size must be >= 1, got 0"),
    ("train.compile_mode=fast", ValueError,
     r"train\.compile_mode must be one of auto, default, max-autotune-no-cudagraphs, "
     r"reduce-overhead, max-autotune, got 'fast'"),
    ("train.compile_scope=layers", ValueError,
     r"train\.compile_scope must be one of blocks, model, got 'layers'"),
    ("model.kind=dense", ValueError, r"model\.kind must be one of \('moe', 'more', 'peer'\)"),
    ("model.rank=8", ValueError, r"model\.rank must be null when model\.kind='moe'"),
    ("model.top_k=99", ValueError, r"model\.top_k must be in \[1, 8\], got 99"),
    ("optim.lr=-1", ValueError, r"optim\.lr must be a finite number > 0, got -1"),
    ("optim.lr=.inf", ValueError, r"optim\.lr must be a finite number > 0, got inf"),
    ("optim.eps=.nan", ValueError, r"optim\.eps must be a finite number > 0, got nan"),
    ("optim.clip=.nan", ValueError, r"optim\.clip must be a finite number >= 0, got nan"),
    ("optim.weight_decay=.inf", ValueError, r"optim\.weight_decay must be a finite number"),
    ("optim.router_lr=.inf", ValueError, r"optim\.router_lr must be a finite number > 0"),
    ("train.max_minutes=.inf", ValueError, r"train\.max_minutes must be a finite number"),
    ("model.balance_coef=.nan", ValueError, r"model\.balance_coef must be a finite number"),
    ("train.nan_policy=ignore", ValueError, r"train\.nan_policy must be one of stop, skip"),
    ("train.nan_skip_limit=0", ValueError, r"train\.nan_skip_limit must be >= 1, got 0"),
    ("parallel.bucket_mb=0", ValueError, r"parallel\.bucket_mb must be a finite number > 0, "
                                         r"got 0\.0"),
    ("parallel.reduce_dtype=fp16", ValueError,
     r"parallel\.reduce_dtype must be one of fp32, bf16, got 'fp16'"),
    ("parallel.reduce_dtype=1", TypeError, r"parallel\.reduce_dtype must be one of fp32, bf16"),
    ("optim.lr=[1", ValueError, r"--set optim\.lr=\[1: the value '\[1' is not a YAML value "
                                r"\(expected ',' or '\]', .* at line 1, column 3\)"),
    ("batch_size=3", ValueError, r"--set expects section\.key=value"),
    ("model.router_init=xavier", ValueError,
     r"model\.router_init must be one of \('variance_matched', 'default'\), got 'xavier'"),
])
def test_errors_name_the_key_and_the_expectation(override, error, match):
    with pytest.raises(error, match=match):
        build_run_config(preset="tiny-moe", overrides=[override])


def test_file_and_preset_errors(tmp_path):
    with pytest.raises(KeyError, match="preset must be one of .*tiny-moe.*got 'nope'"):
        build_run_config(preset="nope")
    with pytest.raises(FileNotFoundError, match="missing.yaml"):
        build_run_config(config_file=str(tmp_path / "missing.yaml"))
    f = tmp_path / "bad.yaml"
    f.write_text("modle: {hidden: 32}\n")
    with pytest.raises(KeyError, match="did you mean 'model'"):
        build_run_config(config_file=str(f))
    f.write_text("model:\n  hidden: [32\ntrain: {}\n")
    with pytest.raises(ValueError, match=r"bad.yaml is not valid YAML: .* at line 3, column 6"):
        build_run_config(config_file=str(f))
    assert parse_override("train.out=runs/x=y") == (["train", "out"], "runs/x=y")


def test_resume_differences_ignore_budget_and_logging():
    a = get_preset("tiny-more")
    b = build_run_config(preset="tiny-more", overrides=[
        "train.max_steps=999", "train.log_every=1", "train.device=cpu", "train.out=x",
        "parallel.bucket_mb=100", "parallel.reduce_dtype=bf16"])   # how the ranks reduce
    assert a.differences(b) == []
    c = build_run_config(preset="tiny-more", overrides=["optim.lr=0.1", "model.rank=4"])
    assert a.differences(c) == ["model.rank: 8 -> 4", "optim.lr: 0.003 -> 0.1"]


def test_cli_errors_and_presets(capsys):
    fails(capsys, ["train", "--preset", "tiny-moe", "--set", "train.batchsize=3"],
          r"error: unknown config key 'train\.batchsize'")
    fails(capsys, ["train", "--preset", "tiny-moe", "--device", "cpu"],
          "train.data is not set: pass --data")
    assert main(["train", "--list-presets"]) == 0
    out = capsys.readouterr().out
    assert "h512-s64-more1792" in out and "1.91B" in out and "tiny-moe" in out


def test_router_init_ablation_reaches_the_routers():
    from moremoe.model import Transformer
    cfg = build_run_config(preset="tiny-more", overrides=["model.router_init=default"])
    model = Transformer(cfg.model.transformer_config(vocab=64))
    routers = [b.moe.router for b in model.blocks]
    assert all(r.init == "default" and r.factor_std == r.init_std for r in routers)
    assert build_run_config(preset="tiny-more").model.router_init == "variance_matched"


def test_peer_presets_and_their_checks(text_data, tmp_path):
    from moremoe.model import Transformer
    from moremoe.nn.peer import PEERLayer
    from moremoe.training.lm import train
    from moremoe.training.optim import param_groups
    paper = build_run_config(preset="h512-peer150544").model
    assert paper.name == "PEER-150544" and paper.moe_config().top_k == 448
    assert paper.moe_config().flops == 4_134_912                    # the paper's match
    assert paper.moe_config().impl == "auto"
    forced = build_run_config(preset="tiny-peer", overrides=["model.experts_impl=reference"])
    assert forced.model.moe_config().impl == "reference"           # experts_impl reaches PEER
    with pytest.raises(ValueError, match=r"model\.PEER needs a perfect-square number"):
        build_run_config(preset="tiny-peer", overrides=["model.experts=250"])
    cfg = build_run_config(preset="tiny-peer", data=str(text_data), out=str(tmp_path / "run"),
                           device="cpu", overrides=["train.max_steps=6", "train.eval_every=3"])
    model = Transformer(cfg.model.transformer_config(vocab=300))
    assert all(isinstance(b.moe, PEERLayer) for b in model.blocks)
    groups = {g["name"]: g["params"] for g in param_groups(model, lr=1e-3, weight_decay=0.1)}
    assert len(groups["router"]) == 2 * len(model.blocks)         # query and keys per layer
    summary = train(cfg, echo=lambda _t: None)
    assert summary["step"] == 6 and summary["val_loss"] is not None
    assert len(summary["expert_coverage"]) == 2


def test_a_compiled_ddp_bucket_under_torchs_first_is_named():
    """dynamo's DDPOptimizer asserts at the first forward on buckets under 1 MiB (seen on 2
    H100s with parallel.bucket_mb=0.05): the trainer names the bound before any work."""
    from moremoe.parallel.plan import check_bucket
    with pytest.raises(ValueError, match=r"parallel\.bucket_mb=0\.05 is under torch\.compile's "
                                         r"first DDP bucket \(1 MB.*>= 1 or train\.compile=false"):
        check_bucket(0.05, compiled=True, world=2)
    check_bucket(0.05, compiled=False, world=2)                 # eager DDP takes any size
    check_bucket(0.05, compiled=True, world=1)                  # one process: no DDP
    check_bucket(0.05, compiled=True, world=2, data="fsdp")     # FSDP2: no DDP buckets
    check_bucket(1.0, compiled=True, world=2)


def test_compile_mode_auto_takes_cuda_graphs_on_one_gpu():
    from moremoe.parallel.plan import compile_mode
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert compile_mode("auto", cuda, 1) == "reduce-overhead"
    assert compile_mode("auto", cuda, 2) == "default"   # DDP: graphs asked for by name
    assert compile_mode("reduce-overhead", cuda, 2) == "reduce-overhead"
    assert compile_mode("auto", cuda, 2, data="fsdp") == "default"     # FSDP2: no graphs
    assert compile_mode("auto", cuda, 1, data="fsdp") == "reduce-overhead"   # one process
    assert compile_mode("auto", cpu, 1) == "default"
    assert compile_mode("max-autotune", cpu, 4) == "max-autotune"   # an explicit mode stays
    with pytest.raises(ValueError, match=r"train\.compile_mode=reduce-overhead \(CUDA graphs\) "
                                         r"does not work with parallel\.data=fsdp"):
        compile_mode("reduce-overhead", cuda, 2, data="fsdp")
    with pytest.raises(ValueError, match=r"parallel\.reduce_dtype=bf16 is DDP's"):
        build_run_config(overrides=["parallel.data=fsdp", "parallel.reduce_dtype=bf16"])
    paper = build_run_config(preset="h512-s64-more1792").train
    assert (paper.compile, paper.compile_mode, paper.compile_scope) == (True, "auto", "model")


@pytest.mark.parametrize("value", [[1], {"a": 1}, True, None, "x", 1.5],
                         ids=["list", "mapping", "bool", "null", "text", "fraction"])
def test_a_value_of_the_wrong_yaml_type_names_its_key(tmp_path, value):
    """Every key of every section, and the preset, given a value of each YAML type: an error
    a user can act on that names the key (`preset: [1]` was "unhashable type: 'list'")."""
    import dataclasses
    import yaml
    from moremoe.cli.main import EXPECTED
    from moremoe.training.config import ModelSpec, OptimSpec, ParallelSpec, TrainSpec
    cases = [({"preset": value}, "preset")]
    for section, cls in (("model", ModelSpec), ("optim", OptimSpec), ("train", TrainSpec),
                         ("parallel", ParallelSpec)):
        cases += [({section: {f.name: value}}, f"{section}.{f.name}")
                  for f in dataclasses.fields(cls)]
    f = tmp_path / "run.yaml"
    for d, key in cases:
        f.write_text(yaml.safe_dump(d))
        try:
            build_run_config(config_file=str(f))
        except EXPECTED as err:
            assert key.split(".")[-1] in str(err), (key, err)
