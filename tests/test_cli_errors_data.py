"""Hostile inputs to the data, training, evaluation and conversion commands: each is one line
on stderr naming the argument or file and what to do (exit status 2), nothing a user made is
replaced without --force, and a size that does not fit says what to change."""
import gzip
import json
import shutil
from pathlib import Path

import pytest

from cli_checks import fails
from mixture_fixtures import _jsonl, benchmark_rows
from moremoe.cli import main
from moremoe.tasks.recipe import PAPER

# one source of the paper's recipe, piqa, from a local copy; the others left out
ONE = ["--skip", ",".join(s.name for s in PAPER if s.name != "piqa"), "--seq-len", "16",
       "--val-sequences", "2", "--workers", "1", "--no-progress"]


def _mixture(tmp_path, path, out=None):
    return ["data", "mixture", "--out", str(out or tmp_path / "mix"), "--source",
            f"piqa={path}", *ONE]


def _piqa_lines(n=40):
    return _jsonl_bytes(benchmark_rows(n)["piqa"]).splitlines(keepends=True)


def _jsonl_bytes(rows):
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


def _torn(lines, at):
    """The lines with line `at` (0-based) cut in the middle, as a copy cut short would be."""
    return b"".join(lines[:at]) + lines[at][:len(lines[at]) // 2] + b"\n" + b"".join(
        lines[at + 1:])


# ---------------------------------------------------------------- data mixture

def test_mixture_truncated_gzip_source_names_source_and_file(capfd, tmp_path):
    data = gzip.compress(b"".join(_piqa_lines()), mtime=0)
    path = tmp_path / "piqa.jsonl.gz"
    path.write_bytes(data[:len(data) // 2])
    fails(capfd, _mixture(tmp_path, path),
          rf"source piqa \({path}\): corrupt or truncated gzip file .*download it again, or "
          rf"leave the source out with --skip piqa")


def test_mixture_empty_source_is_named_as_empty(capfd, tmp_path):
    path = tmp_path / "piqa.jsonl"
    path.write_bytes(b"")
    fails(capfd, _mixture(tmp_path, path),
          rf"source piqa \({path}\): the file is empty; give a copy that holds its rows")


def test_mixture_corrupt_parquet_source_is_one_line_naming_source_and_file(capfd, tmp_path):
    datasets = pytest.importorskip("datasets")
    path = tmp_path / "piqa.parquet"
    datasets.Dataset.from_list(benchmark_rows()["piqa"]).to_parquet(str(path))
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2] + b"\0" * 100 + data[len(data) // 2 + 100:])
    fails(capfd, _mixture(tmp_path, path),
          rf"source piqa \({path}\): not a readable parquet file \(.*\): it is corrupt or "
          rf"truncated; download it again")


def test_mixture_torn_json_line_names_source_file_and_line(capfd, tmp_path):
    path = tmp_path / "piqa.jsonl"
    path.write_bytes(_torn(_piqa_lines(), 10))
    fails(capfd, _mixture(tmp_path, path),
          rf"source piqa \({path}\): line 11 is not JSON \(.*\): the line is cut short")


@pytest.mark.parametrize("line, why", [
    (b'["a list", "not a row"]\n', r"line 4 holds a JSON list, not an object .*; give one "
                                    r"JSON object per row"),
    (b'{"goal": "caf\xe9", "sol1": "a", "sol2": "b", "label": 0}\n',
     r"line 4 is not UTF-8 \(byte 13 of the line\): the file is corrupt; download it again")])
def test_mixture_line_that_is_no_row_is_named(capfd, tmp_path, line, why):
    path = tmp_path / "piqa.jsonl"
    path.write_bytes(b"".join(_piqa_lines(3)) + line + b"".join(_piqa_lines(3)))
    fails(capfd, _mixture(tmp_path, path), rf"source piqa \({path}\): {why}")


def test_mixture_torn_line_in_a_later_file_is_found_while_tokenising(capfd, tmp_path):
    """The first file reads well (the sources are checked on it); the second is torn and
    fails only once tokenising reaches it."""
    folder = tmp_path / "piqa"
    folder.mkdir()
    lines = _piqa_lines(80)
    (folder / "train-0.jsonl").write_bytes(b"".join(lines[:40]))
    (folder / "train-1.jsonl").write_bytes(_torn(lines[40:], 5))
    fails(capfd, _mixture(tmp_path, folder),
          rf"source piqa \({folder / 'train-1.jsonl'}\): line 6 is not JSON .*the finished "
          rf"chunks are kept for a rerun")


def test_mixture_damaged_saved_dataset_names_source_and_folder(capfd, tmp_path):
    datasets = pytest.importorskip("datasets")
    folder = tmp_path / "piqa"
    datasets.Dataset.from_list(benchmark_rows()["piqa"]).save_to_disk(str(folder))
    for arrow in folder.glob("*.arrow"):
        arrow.write_bytes(arrow.read_bytes()[:200])
    fails(capfd, _mixture(tmp_path, folder),
          rf"source piqa \({folder}\): cannot read it \(.*\); give a complete copy")


# ---------------------------------------------------------------- data prepare

def _prepare(tmp_path, *inputs, text_field="goal"):
    return ["data", "prepare", *map(str, inputs), "--out", str(tmp_path / "prep"),
            "--text-field", text_field, "--seq-len", "8", "--val-sequences", "1",
            "--workers", "1", "--no-progress"]


def test_prepare_torn_json_line_names_the_line(capsys, tmp_path):
    path = tmp_path / "piqa.jsonl"
    path.write_bytes(_torn(_piqa_lines(), 10))
    fails(capsys, _prepare(tmp_path, path),
          rf"{path}, line 11 \(byte [\d,]+\): not a JSON line .*the line is cut short")


def test_prepare_empty_input_says_it_is_empty(capsys, tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_bytes(b"")
    fails(capsys, _prepare(tmp_path, path), rf"the input {path} is empty; give a file with text")
    other = _jsonl(tmp_path / "blank.jsonl", [{"goal": ""}] * 3)
    fails(capsys, _prepare(tmp_path, path, other) + ["--restart"],
          rf"the 2 input files \(1 empty, e.g. {path}\) hold no text")


def test_prepare_damaged_saved_dataset_names_the_folder(capsys, tmp_path):
    datasets = pytest.importorskip("datasets")
    folder = tmp_path / "ds"
    datasets.Dataset.from_dict({"text": [f"row {i}" for i in range(500)]}).save_to_disk(
        str(folder))
    for arrow in folder.glob("*.arrow"):
        arrow.write_bytes(arrow.read_bytes()[:300])
    fails(capsys, _prepare(tmp_path, folder, text_field="text"),
          rf"dataset {folder}: cannot read it \(.*\); the folder is corrupt or truncated")


# ---------------------------------------------------------------- convert-router

def _moe_model(tmp_path, arch="MixtralConfig"):
    """A tiny random transformers MoE saved to a folder (no tokenizer files)."""
    transformers = pytest.importorskip("transformers")
    import torch
    torch.manual_seed(0)
    experts = {"MixtralConfig": dict(num_local_experts=4),
               "OlmoeConfig": dict(num_experts=4)}[arch]
    cfg = getattr(transformers, arch)(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1,
                                      vocab_size=64, num_experts_per_tok=2, **experts)
    cfg.eos_token_id = cfg.bos_token_id = cfg.pad_token_id = None
    path = tmp_path / arch
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    return path


def _convert(model, out, *extra):
    return ["convert-router", str(model), "--rank", "2", "--out", str(out), "--random-tokens",
            "64", "--seq-len", "32", *extra]


@pytest.mark.parametrize("damage", ["truncate", "garble"])
def test_convert_router_damaged_safetensors_names_the_file(capsys, tmp_path, damage):
    model = _moe_model(tmp_path)
    weights = model / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[:len(data) // 2] if damage == "truncate" else
                        data[:8] + b"\xff" * 64 + data[72:])
    fails(capsys, _convert(model, tmp_path / "o"),
          rf"MODEL {model}: model.safetensors (has [\d,]+ bytes, its header describes [\d,]+ "
          rf"\(truncated\)|cannot be read .*); the file is damaged: download or copy it again")
    assert not (tmp_path / "o").exists()


def test_convert_router_out_on_a_file_names_out(capsys, tmp_path):
    model = _moe_model(tmp_path)
    afile = tmp_path / "afile"
    afile.write_text("mine")
    fails(capsys, _convert(model, afile), rf"--out {afile} is a file; give a folder")
    fails(capsys, _convert(model, afile, "--force"), rf"--out {afile} is a file")
    assert afile.read_text() == "mine"


def test_convert_router_text_without_a_tokenizer_says_so(capsys, tmp_path):
    """transformers 5 builds an empty tokenizer for this folder (every text -> no ids)."""
    model = _moe_model(tmp_path, "OlmoeConfig")
    text = tmp_path / "text.txt"
    text.write_text("hello world " * 200)
    fails(capsys, _convert(model, tmp_path / "o", "--text", str(text)),
          rf"MODEL {model} has no tokenizer to read --text with \(none of tokenizer.json, .*\);"
          rf" copy the model's tokenizer files into it, or give --random-tokens N instead")
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast
    empty = Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))    # as transformers 5
    PreTrainedTokenizerFast(tokenizer_object=empty, unk_token="[UNK]").save_pretrained(model)
    fails(capsys, _convert(model, tmp_path / "o", "--text", str(text)),
          rf"MODEL {model}: its tokenizer is empty \(only the special tokens .*\), so --text "
          rf"would give no tokens")
    text.write_bytes(b"caf\xe9")
    fails(capsys, _convert(model, tmp_path / "o", "--text", str(text)),
          rf"--text {text}: not UTF-8 text \(byte 3\)")


# ---------------------------------------------------------------- train and eval

TRAIN = ["--preset", "tiny-moe", "--device", "cpu", "--set", "model.seq_len=64",
         "--set", "train.batch_size=4", "--set", "train.log_every=1",
         "--set", "train.eval_batches=1", "--set", "train.ckpt_every=2"]


@pytest.fixture(scope="module")
def run4(text_data, tmp_path_factory):
    """A tiny run (vocabulary from its byte-level data: 256) with checkpoints at steps 2, 4."""
    out = tmp_path_factory.mktemp("run4") / "run"
    assert main(["train", "--data", str(text_data), "--out", str(out), *TRAIN,
                 "--set", "train.max_steps=4", "--json"]) == 0
    return out


def _copy(run, tmp_path):
    return Path(shutil.copytree(run, tmp_path / "run"))


def test_resume_with_data_of_another_vocabulary_names_both(capsys, run4, text_data, tmp_path):
    run = _copy(run4, tmp_path)
    other = tmp_path / "other"
    shutil.copytree(text_data, other)
    meta = json.loads((other / "meta.json").read_text())
    (other / "meta.json").write_text(json.dumps({**meta, "vocab_size": 300}))
    fails(capsys, ["train", "--data", str(other), "--out", str(run), *TRAIN,
                   "--set", "train.max_steps=6", "--resume"],
          rf"cannot resume .*step_00000004: the run's model has a vocabulary of 256 \(from its "
          rf"data, {text_data}\), the data --data {other} has vocab_size 300; resume with data "
          rf"of the run's vocabulary, or start a new run with another --out")


def test_eval_of_a_run_with_a_damaged_latest_checkpoint_says_which_it_uses(
        capsys, run4, text_data, tmp_path):
    run = _copy(run4, tmp_path)
    weights = run / "checkpoints" / "step_00000004" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-10])
    report = tmp_path / "report.json"
    capsys.readouterr()
    assert main(["eval", str(run), "--tasks", "none", "--data", str(text_data), "--device",
                 "cpu", "--out", str(report), "--json"]) == 0
    captured = capsys.readouterr()
    warning = [line for line in captured.err.splitlines() if "warning" in line]
    older = run / "checkpoints" / "step_00000002"
    assert len(warning) == 1 and warning[0].startswith("moremoe eval: warning: the newest "
                                                       "checkpoint of ")
    assert "step_00000004 (model.safetensors has" in warning[0]
    assert f"evaluating {older} (step 2), the newest complete one" in warning[0]
    assert json.loads(captured.out)["checkpoint"] == {"path": str(older), "step": 2}
    assert json.loads(report.read_text())["checkpoint"] == {"path": str(older), "step": 2}


def test_eval_of_an_intact_run_records_its_latest_checkpoint(capsys, run4, text_data):
    capsys.readouterr()
    assert main(["eval", str(run4), "--tasks", "none", "--data", str(text_data), "--device",
                 "cpu"]) == 0
    captured = capsys.readouterr()
    assert "warning" not in captured.err
    assert f"checkpoint {run4 / 'checkpoints' / 'step_00000004'} (step 4)" in captured.out


def test_eval_out_onto_a_report_needs_force_and_is_checked_first(capsys, run4, text_data,
                                                                 tmp_path):
    report = tmp_path / "report.json"
    report.write_text('{"tasks": {"sciq": {"n": 1000}}}')
    fails(capsys, ["eval", str(tmp_path / "nowhere"), "--tasks", "none", "--data",
                   str(text_data), "--out", str(report)],
          rf"--out {report} exists; give another name or --force to replace it")
    assert report.read_text() == '{"tasks": {"sciq": {"n": 1000}}}'
    assert main(["eval", str(run4), "--tasks", "none", "--data", str(text_data), "--device",
                 "cpu", "--out", str(report), "--force"]) == 0
    assert json.loads(report.read_text())["perplexity"]["tokens"] > 0


def test_train_never_writes_into_an_hf_export(capsys, text_data, tmp_path):
    pytest.importorskip("transformers")
    from test_cli_eval import hf_dir, tiny_gpt2_model
    export = hf_dir(tmp_path, tiny_gpt2_model())
    before = {p.name: p.read_bytes() for p in export.iterdir()}
    for extra in ([], ["--force"], ["--resume"]):
        fails(capsys, ["train", "--data", str(text_data), "--out", str(export), *TRAIN,
                       "--set", "train.max_steps=2", *extra],
              rf"--out {export} holds a transformers model's config.json \(model_type "
              rf"'moremoe', .*\), which a run would replace: it is never written into \(not "
              rf"even with --force\)")
    assert {p.name: p.read_bytes() for p in export.iterdir()} == before


def test_train_into_a_folder_of_other_files_needs_force_and_keeps_them(capsys, text_data,
                                                                      tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    argv = ["train", "--data", str(text_data), "--out", str(out), *TRAIN,
            "--set", "train.max_steps=2"]
    fails(capsys, argv, rf"--out {out} is not empty \(it holds notes.txt, ...\) and holds no "
                        rf"moremoe run; give a new or empty folder, or --force")
    fails(capsys, argv + ["--lr-grid", "1e-3", "--grid-steps", "1"], "holds no moremoe run")
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]
    assert main(argv + ["--force", "--json"]) == 0
    assert (out / "notes.txt").read_text() == "mine" and (out / "checkpoints").is_dir()


# ---------------------------------------------------------------- out of memory

GPU_OOM = ("CUDA out of memory. Tried to allocate 20.00 GiB. GPU 0 has a total capacity of "
           "79.10 GiB of which 1.03 GiB is free. Including non-PyTorch memory, this process has "
           "78.06 GiB memory in use.")


def _raise_oom(*args, **kw):
    import torch
    raise torch.OutOfMemoryError(GPU_OOM)


def test_train_out_of_memory_says_what_to_change(capsys, text_data, tmp_path, monkeypatch):
    from moremoe.training.lm import LMTrainer
    monkeypatch.setattr(LMTrainer, "_train_step", _raise_oom)
    fails(capsys, ["train", "--data", str(text_data), "--out", str(tmp_path / "run"), *TRAIN,
                   "--set", "train.max_steps=2"],
          r"GPU 0 ran out of memory \(20.00 GiB more asked for, 1.03 GiB free of 79.10 GiB\): "
          r"MoE-\d+ \(model.hidden=\d+, model.layers=\d+\) at train.batch_size=4 sequences of "
          r"model.seq_len=64 per device and micro-step does not fit; lower the micro-batch "
          r"\(--set train.batch_size=2 --set train.grad_accum=2 keeps the global batch\), the "
          r"sequence length \(--set model.seq_len\) .* more GPUs \(torchrun --nproc_per_node N\)"
          r" and shard the model over them \(--set parallel.data=fsdp\) and split its experts "
          r"over them \(--set parallel.expert=E, a divisor of model.experts=8\), or keep less "
          r"per GPU \(--set train.activation_checkpointing=true, --set optim.moments=bf16, "
          r"--set train.fused_loss=true\)$")


def test_under_torchrun_only_rank_0_reports_running_out_of_memory(capsys, text_data, tmp_path,
                                                                   monkeypatch):
    import moremoe.training.lm as lm
    monkeypatch.setattr(lm, "train", _raise_oom)
    argv = ["train", "--data", str(text_data), "--out", str(tmp_path / "run"), *TRAIN,
            "--set", "parallel.data=fsdp", "--set", "parallel.expert=2",
            "--set", "train.activation_checkpointing=true", "--set", "optim.moments=bf16",
            "--set", "train.fused_loss=true"]
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    capsys.readouterr()
    assert main(argv) == 2
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("RANK", "0")
    line = fails(capsys, argv, r"GPU 0 ran out of memory .* more GPUs \(torchrun "
                               r"--nproc_per_node N\)$")
    for already_set in ("parallel.", "activation_checkpointing", "optim.moments", "fused_loss"):
        assert already_set not in line


def test_eval_and_convert_router_out_of_memory_name_their_options(capsys, run4, text_data,
                                                                  tmp_path, monkeypatch):
    import moremoe.eval.perplexity as perplexity
    import moremoe.hf.convert_router as convert_router
    monkeypatch.setattr(perplexity, "evaluate_perplexity", _raise_oom)
    fails(capsys, ["eval", str(run4), "--tasks", "none", "--data", str(text_data), "--device",
                   "cpu", "--batch-size", "16"],
          rf"GPU 0 ran out of memory .*: {run4} at --batch-size 16 does not fit; lower "
          rf"--batch-size")
    monkeypatch.setattr(convert_router, "capture_router_inputs", _raise_oom)
    fails(capsys, _convert(_moe_model(tmp_path), tmp_path / "o"),
          r"GPU 0 ran out of memory .*: MODEL .* with the hidden states of its routers does not "
          r"fit; lower --random-tokens or --max-tokens")


def test_any_command_out_of_memory_is_one_line_not_a_bug_report(capsys, monkeypatch):
    import moremoe.cli.plan as plan

    def cpu_oom(args):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: "
                           "can't allocate memory: you tried to allocate 1152921504606846976 "
                           "bytes. Error code 12 (Cannot allocate memory)")
    monkeypatch.setattr(plan, "cmd_flops", cpu_oom)
    fails(capsys, ["flops", "--experts", "4", "--top-k", "2", "--hidden", "8", "--width", "4"],
          r"the machine ran out of memory \(1,073,741,824.0 GiB more asked for\): what was "
          r"asked for does not fit; use smaller sizes")


# ---------------------------------------------------------------- the other commands

def test_prepare_sizes_that_cannot_work_say_what_to_change(capsys, tmp_path):
    text = tmp_path / "a.txt"
    text.write_text("hello world " * 100)
    fails(capsys, ["data", "prepare", str(text), "--out", str(tmp_path / "p"), "--shard-mb",
                   "1e-300"], r"--shard-mb must be at least 0.01 \(10 KB\), got 1e-300")
    fails(capsys, ["data", "prepare", str(text), "--out", str(tmp_path / "p"), "--seq-len",
                   "100000", "--no-progress", "--workers", "1"],
          r"the inputs hold 1,200 bytes of text, at most 1,201 tokens = 0 sequences of "
          r"--seq-len 100000, .* use --val-sequences 1 with a --seq-len of at most 600 "
          r"\(upper limits: a token is usually several bytes\), or more text")
    assert not (tmp_path / "p").exists()


def test_data_corpus_never_replaces_other_text_without_force(capsys, tmp_path):
    out = tmp_path / "corpus"
    assert main(["data", "corpus", str(out)]) == 0
    assert main(["data", "corpus", str(out)]) == 0                  # the same corpus again
    (out / "assert.txt").write_text("my notes")
    fails(capsys, ["data", "corpus", str(out)],
          rf"{out / 'assert.txt'} exists and holds other text; pass --force to replace it")
    assert (out / "assert.txt").read_text() == "my notes"
    assert main(["data", "corpus", str(out), "--force"]) == 0
    assert (out / "assert.txt").read_text().startswith('The "assert" statement')


def test_train_seed_and_a_model_that_cannot_fit_are_refused_up_front(capsys, text_data,
                                                                     tmp_path):
    argv = ["train", "--data", str(text_data), "--out", str(tmp_path / "run"), *TRAIN]
    fails(capsys, argv + ["--set", "train.seed=-1"], r"train.seed must be >= 0, got -1")
    fails(capsys, argv + ["--set", "model.experts=1e15"],
          r"the model has [\d,]+ parameters: their fp32 weights, gradients and AdamW states "
          r"alone need [\d,.]+ GiB on cpu, which has [\d,.]+ GiB; make it smaller")
    assert not (tmp_path / "run").exists()


def test_footprint_counts_16_bytes_a_parameter_shared_by_fsdp_ranks():
    import torch
    from moremoe.training.compose import build_run_config
    from moremoe.training.footprint import check_fits, memory_plan, shrink_options
    gpu = torch.device("cuda", 0)

    def check(sets, world):
        cfg = build_run_config(preset="h512-s64-moe256", overrides=sets)
        mc = cfg.model.transformer_config()
        have = 16 * mc.total_params() // 2 + 16
        plan = memory_plan(cfg, mc, gpu, world=world, have=have)
        check_fits(plan, mc.total_params(), gpu, world, options=shrink_options(cfg, gpu, world))
    with pytest.raises(ValueError, match=r"need 5.4 GiB on cuda:0, which has 2.7 GiB; .*"
                                         r"--set parallel.data=fsdp"):
        check([], 1)
    check(["parallel.data=fsdp"], 2)                                # fits on 2 ranks
    with pytest.raises(ValueError, match="on each of the 2 ranks"):
        check([], 2)


def test_eval_of_another_kind_of_transformers_model_names_it(capsys, tmp_path, text_data):
    model = _moe_model(tmp_path)
    fails(capsys, ["eval", str(model), "--tasks", "none", "--data", str(text_data)],
          rf"MODEL {model} is a transformers model of model_type 'mixtral'; eval reads moremoe "
          rf"models")


def test_plot_of_a_corrupt_or_empty_log_is_an_error(capsys, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "log.jsonl").write_text("garbage\n")
    fails(capsys, ["plot", str(run), "--out", str(tmp_path / "a.png")],
          rf"{run / 'log.jsonl'} holds no events of a run yet")
    (run / "log.jsonl").write_text('{"event": "start", "step": 0}\n{"eve\n'
                                   '{"event": "train", "step": 1, "loss": 2.0}\n')
    fails(capsys, ["plot", str(run), "--out", str(tmp_path / "a.png")],
          rf"{run / 'log.jsonl'}, line 2: not JSON; the log is corrupt")
    assert not (tmp_path / "a.png").exists()


def test_prepare_and_mixture_never_replace_token_files_without_meta(capsys, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "train.bin").write_bytes(b"mine")
    text = tmp_path / "a.txt"
    text.write_text("hello world " * 100)
    argv = ["data", "prepare", str(text), "--out", str(out), "--seq-len", "8",
            "--val-sequences", "1", "--workers", "1", "--no-progress"]
    fails(capsys, argv, rf"{out} holds train.bin but no meta.json \(not a finished prepared "
                        rf"folder\); pass --force to replace what is there")
    fails(capsys, _mixture(tmp_path, text, out), rf"{out} holds train.bin but no meta")
    assert (out / "train.bin").read_bytes() == b"mine"
    assert main(argv + ["--force"]) == 0 and (out / "meta.json").is_file()


def test_eval_of_an_export_with_damaged_weights_names_the_file(capsys, tmp_path, text_data):
    pytest.importorskip("transformers")
    from test_cli_eval import hf_dir, tiny_gpt2_model
    export = hf_dir(tmp_path, tiny_gpt2_model())
    weights = export / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:weights.stat().st_size // 2])
    fails(capsys, ["eval", str(export), "--tasks", "none", "--data", str(text_data),
                   "--device", "cpu"],
          rf"MODEL {export}: model.safetensors has [\d,]+ bytes, its header describes [\d,]+ "
          rf"\(truncated\); the file is damaged: export or copy it again")
