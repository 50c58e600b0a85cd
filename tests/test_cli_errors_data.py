"""Hostile inputs to the data, training, evaluation and conversion commands: each is one line
on stderr naming the argument or file and what to do (exit status 2), nothing a user made is
replaced without --force, and a size that does not fit says what to change."""
import gzip
import json

import pytest

from cli_checks import fails
from mixture_fixtures import _jsonl, benchmark_rows
from moremoe.cli import main
from moremoe.tasks.recipe import PAPER

# one source of the paper's recipe, piqa, from a local copy; the others left out
ONE = ["--skip", ",".join(s.name for s in PAPER if s.name != "piqa"), "--seq-len", "16",
       "--val-sequences", "2", "--workers", "1", "--no-progress"]


def _mixture(tmp_path, path):
    return ["data", "mixture", "--out", str(tmp_path / "mix"), "--source", f"piqa={path}", *ONE]


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
          rf"source piqa \({folder}\): cannot read it \(.*\); is it a complete copy")


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
