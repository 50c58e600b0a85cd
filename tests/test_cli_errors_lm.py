"""The language-model commands (train, eval, data, hf export, convert-router, bench model):
no output lands on an input or on files the user made, empty names are refused, and what a
command says agrees with what it does."""
import json
import shutil
from pathlib import Path

import pytest

from cli_checks import fails
from moremoe.cli import main
from test_cli_errors_data import TRAIN, run4  # noqa: F401 (run4: the shared tiny run)


def _tree(folder: Path) -> dict:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file()}


# ---------------------------------------------------------------- eval --out


def test_eval_never_writes_its_report_into_the_model_or_the_data(capsys, run4, text_data,
                                                                tmp_path):
    run, data = Path(shutil.copytree(run4, tmp_path / "run")), Path(
        shutil.copytree(text_data, tmp_path / "data"))
    step = run / "checkpoints" / "step_00000004"
    before = _tree(run), _tree(data)
    base = ["eval", "--device", "cpu", "--tasks", "none", "--val-batches", "1", "--data",
            str(data), "--force"]
    for model, out, where in [
            (run, step / "model.safetensors", f"inside MODEL {run}"),
            (run, run / "summary.json", f"inside MODEL {run}"),
            (step, run / "summary.json", f"inside the run of MODEL {run}"),
            (step, step, "MODEL"),
            (run, data / "meta.json", f"inside --data {data}"),
            (run, tmp_path / "." / "data" / "report.json", f"inside --data {data}")]:
        fails(capsys, base + [str(model), "--out", str(out)],
              rf"--out {out} is {where}: eval never writes into what it reads \(not even with "
              rf"--force\); give a report path outside MODEL and --data")
    assert (_tree(run), _tree(data)) == before


# ---------------------------------------------------------------- hf export


def test_hf_export_force_lists_only_the_files_it_wrote(capsys, run4, tmp_path):
    out = tmp_path / "ex"
    out.mkdir()
    (out / "mine.txt").write_text("mine")
    capsys.readouterr()
    assert main(["hf", "export", str(run4), str(out), "--force"]) == 0
    line = capsys.readouterr().out
    assert "mine.txt" not in line and "config.json" in line, line
    assert main(["hf", "export", str(run4), str(out), "--force", "--json"]) == 0
    files = json.loads(capsys.readouterr().out)["files"]
    assert "mine.txt" not in files and "model.safetensors" in files
    assert (out / "mine.txt").read_text() == "mine"


# ---------------------------------------------------------------- train --force


def test_train_force_into_a_folder_without_a_run_deletes_nothing_of_it(capsys, text_data,
                                                                     tmp_path):
    """--force writes a run beside the files of a folder that holds no run ("its files are
    kept"): it never removes them, and refuses, --force or not, a folder holding a file the
    run would write over (loss.png; profile.txt and tb/ when the run writes them)."""
    out = tmp_path / "mine"
    (out / "tb").mkdir(parents=True)
    (out / "tb" / "events.mine").write_text("my events")
    (out / "profile.txt").write_text("my profile")
    (out / "loss.png").write_bytes(b"my plot")
    before = _tree(out)
    argv = ["train", "--data", str(text_data), "--out", str(out), *TRAIN,
            "--set", "train.max_steps=2", "--set", "train.eval_every=2"]
    for extra in ([], ["--force"]):
        fails(capsys, argv + extra, rf"--out {out} holds no moremoe run but holds loss.png, "
                                    rf"which the run would write over: it is never written "
                                    rf"into \(not even with --force\); give another --out, or "
                                    rf"move it away")
    (out / "loss.png").unlink()
    del before["loss.png"]
    fails(capsys, argv + ["--force", "--set", "train.tensorboard=true", "--set",
                          "train.profile_steps=1"], r"holds profile.txt, tb, which the run")
    assert _tree(out) == before
    assert main(argv + ["--force", "--json"]) == 0
    after = _tree(out)
    assert {k: after[k] for k in before} == before          # the folder's own files, intact
    assert "loss.png" in after and "summary.json" in after


# ---------------------------------------------------------------- no validation sequences


def test_eval_of_data_without_validation_sequences_is_an_error(capsys, run4, tmp_path):
    from prepared import write_token_dir
    data = write_token_dir(tmp_path / "noval", val_sequences=0)
    fails(capsys, ["eval", str(run4), "--tasks", "none", "--device", "cpu", "--data",
                   str(data)],
          rf"--data {data} holds no validation sequences \(prepared with --val-sequences 0\): "
          rf"there is no perplexity to measure; prepare the text again with --val-sequences 1 "
          rf"or more")


def test_prepare_without_validation_sequences_says_what_it_cannot_do(capsys, tmp_path):
    text = tmp_path / "a.txt"
    text.write_text("hello world " * 100)
    out = tmp_path / "p"
    capsys.readouterr()
    assert main(["data", "prepare", str(text), "--out", str(out), "--seq-len", "16",
                 "--val-sequences", "0", "--workers", "1", "--no-progress", "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["val_sequences"] == 0
    assert captured.err.strip() == (
        f"moremoe data prepare: note: {out} holds no validation sequences (--val-sequences 0): "
        f"`moremoe train` on it reports no validation loss and `moremoe eval --data` refuses it")


# ---------------------------------------------------------------- convert-router


def test_convert_router_never_prompts_for_a_models_own_code(capsys, tmp_path, monkeypatch):
    """A moremoe export (and any model needing its folder's code) is refused in one line:
    transformers' "Do you wish to run the custom code? [y/N]" would wait at a terminal."""
    from test_cli_eval import hf_dir, tiny_gpt2_model

    def prompted(*args):
        raise AssertionError(f"prompted: {args}")
    monkeypatch.setattr("builtins.input", prompted)
    export = hf_dir(tmp_path, tiny_gpt2_model())
    argv = ["convert-router", "--rank", "4", "--random-tokens", "64", "--seq-len", "32",
            "--no-progress"]
    fails(capsys, argv + [str(export), "--out", str(tmp_path / "o1")],
          rf"MODEL {export} is a moremoe model \(config.json model_type 'moremoe', from "
          rf"`moremoe hf export`\); convert-router reads transformers MoE models whose routers "
          rf"are '\*.mlp.gate' weights")
    custom = Path(shutil.copytree(export, tmp_path / "custom"))
    config = json.loads((custom / "config.json").read_text())
    (custom / "config.json").write_text(json.dumps({**config, "model_type": "mything"}))
    fails(capsys, argv + [str(custom), "--out", str(tmp_path / "o2")],
          rf"MODEL {custom}: its model_type 'mything' needs the folder's own code \(config.json "
          rf"auto_map\), which convert-router does not run")
    assert not (tmp_path / "o1").exists() and not (tmp_path / "o2").exists()


# ---------------------------------------------------------------- bench model --help


def test_bench_model_takes_what_its_help_lists(capsys):
    """--phases both (the help's words) is prefill,decode; every pair --pairs takes is in the
    help, and the tiny pair, --quick's, is not a --pairs choice (its vocabulary is the
    data's, so it has no model without --quick)."""
    from moremoe.cli.bench import _pair_names
    from moremoe.cli.main import build_parser
    parser = build_parser()
    assert parser.parse_args(["bench", "model", "--phases", "both"]).phases == ["prefill",
                                                                                "decode"]
    assert parser.parse_args(["bench", "model"]).phases == ["prefill", "decode"]
    fails(capsys, ["bench", "model", "--pairs", "tiny"],
          r"--pairs got 'tiny', expected a comma-separated subset of h512-s64, ")
    fails(capsys, ["bench", "model", "--quick", "--pairs", "h1024-s32"],     # not ignored
          r"--pairs h1024-s32 would not be measured: --quick measures the tiny pair only; "
          r"drop one of them$")
    from moremoe.cli.bench import MODEL_PAIRS
    assert set(MODEL_PAIRS) <= set(_pair_names())
    with pytest.raises(SystemExit):
        parser.parse_args(["bench", "model", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "prefill, decode, or both" in text
    assert all(name in text for name in _pair_names()) and "tiny" in text   # --quick's


# ---------------------------------------------------------------- data prepare


def test_prepare_too_few_sequences_hints_at_settings_that_work(capsys, tmp_path):
    """The hint counts --val-sequences: its --seq-len works and one more does not. Sizes no
    tokenisation can fill are refused before any work, leaving nothing; refused after
    tokenising, the shards stay for the next run, which says so."""
    text = tmp_path / "a.txt"
    text.write_text("hello world " * 100)                  # 1,200 bytes, 202 tokens
    out = tmp_path / "p"
    argv = ["data", "prepare", str(text), "--out", str(out), "--val-sequences", "5",
            "--workers", "1", "--no-progress", "--json", "--seq-len"]
    fails(capsys, argv + ["10000000"],
          r"the inputs hold 1,200 bytes of text, at most 1,201 tokens = 0 sequences of "
          r"--seq-len 10000000, and --val-sequences 5 leaves none for training; use a "
          r"--seq-len of at most 200 \(upper limits: a token is usually several bytes\), or "
          r"more text")
    assert not out.exists()
    fails(capsys, argv + ["100"],
          rf"the inputs give 202 tokens = 2 sequences of --seq-len 100, and --val-sequences 5 "
          rf"leaves none for training; use a --seq-len of at most 33 or --val-sequences of at "
          rf"most 1, or more text \(the tokenised text stays in {out / '.partial'}: the next "
          rf"run reuses it\)")
    fails(capsys, argv + ["34"], "use a --seq-len of at most 33")
    assert main(argv + ["33"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert (summary["train_sequences"], summary["shards_reused"]) == (1, 1)
    assert not (out / ".partial").exists()


# ---------------------------------------------------------------- empty names


@pytest.mark.parametrize("argv, match", [
    (["data", "corpus", ""], "argument OUT: expected a non-empty path, got ''"),
    (["data", "prepare", "", "--out", "p"], "argument INPUT: expected a non-empty path"),
    (["data", "prepare", "a.txt", "--out", ""], "argument --out: expected a non-empty path"),
    (["hf", "export", "run", ""], "argument OUT_DIR: expected a non-empty path, got ''"),
    (["hf", "export", "", "ex"], "argument CHECKPOINT: expected a non-empty path"),
    (["eval", "", "--tasks", "none", "--data", "d"], "argument MODEL: expected a non-empty"),
    (["eval", "run", "--data", "d", "--tasks", "none", "--out", ""],
     "argument --out: expected a non-empty path"),
    (["train", "--preset", "tiny-moe", "--data", ""], "argument --data: expected a non-empty"),
    (["train", "--preset", "tiny-moe", "--data", "d", "--out", " "],
     "argument --out: expected a non-empty path, got ' '"),
    (["train", "--preset", "", "--data", "d"], "preset must be one of .*tiny-moe.*; got ''"),
    (["train", "--preset", "tiny-moe", "--data", "d", "--set", "train.out=''"],
     r"train.out must be a non-empty path \(or leave it out for runs/train/<preset>\), got ''"),
    (["convert-router", "", "--rank", "2", "--out", "o"], "argument MODEL: expected a non-empty"),
    (["generate", "", "--prompt", "a"], "argument RUN_OR_CHECKPOINT: expected a non-empty"),
])
def test_an_empty_name_or_path_is_refused_naming_the_argument(capsys, tmp_path, monkeypatch,
                                                             argv, match):
    """"" is the current folder to pathlib: `data corpus ""` wrote its 79 files there and
    `--preset ""` ran the built-in defaults, both with exit status 0."""
    monkeypatch.chdir(tmp_path)
    fails(capsys, argv, match)
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("yaml, match", [
    ('train:\n  out: ""\n', r"train.out must be a non-empty path \(or leave it out"),
    ('train:\n  data: ""\n', r"train.data must be a non-empty path \(a folder from `moremoe "
                             r"data prepare`\), got ''"),
    ('preset: ""\n', "preset must be one of .*; got ''"),
])
def test_an_empty_path_or_preset_in_a_config_file_is_named(capsys, tmp_path, monkeypatch,
                                                          yaml, match):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "run.yaml").write_text(yaml)
    fails(capsys, ["train", "--config", "run.yaml", "--device", "cpu"], match)
    assert [p.name for p in tmp_path.iterdir()] == ["run.yaml"]


# ---------------------------------------------------------------- model config


@pytest.mark.parametrize("setting, match", [
    ("model.layers=0", r"model.layers must be >= 1, got 0"),
    ("model.heads=0", r"model.heads must be >= 1, got 0"),
    ("model.kv_heads=0", r"model.kv_heads must be in \[1, 4\], got 0"),
    ("model.kv_heads=3", r"model.kv_heads must divide model.heads=4, got 3"),
    ("model.heads=5", r"model.heads must divide model.hidden=64, got 5"),
    ("model.heads=64", r"model.hidden / model.heads = 1 \(the head dim\) must be even"),
    ("model.router_impl=foo", r"model.router_impl must be one of .*'triton'.*, got 'foo'"),
    ("model.experts_impl=bogus", r"model.experts_impl must be one of .*, got 'bogus'"),
    ("model.vocab=0", r"model.vocab must be >= 1, got 0"),
])
def test_model_config_errors_name_the_key_before_the_data_is_read(capsys, tmp_path, setting,
                                                                 match):
    """--data names a folder that does not exist: the model's error comes first."""
    fails(capsys, ["train", "--preset", "tiny-more", "--device", "cpu", "--data",
                   str(tmp_path / "nowhere"), "--out", str(tmp_path / "run"), "--set",
                   setting], match)
    assert not any(tmp_path.iterdir())
