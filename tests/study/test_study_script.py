"""benchmarks/study_lm_gpu.sh on the CPU (the corpus and data already on the machine's
disk, as in a window's second call): a relative OUT, a results folder with a study.json
and no rows yet, and the tar the device call brings back."""
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TINY = ("--hidden 32 --layers 1 --heads 2 --top-k 2 --width 8 --rank 4 --seq-len 64 "
        "--batch 4 --budgets 1024 --seeds 0 --lr 1e-3 --eval-tokens 512")


def test_the_device_script_continues_a_study_and_brings_back_its_tar(text_data, tmp_path):
    work, results = tmp_path / "work", tmp_path / "results"
    (work / "corpus").mkdir(parents=True)
    (work / "corpus" / "corpus.json").write_text("{}")
    shutil.copytree(text_data, work / "data")
    env = dict(os.environ, DEVICE="cpu", WORK=str(work), RESULTS=str(results),
               OUT=os.path.relpath(tmp_path / "out", ROOT), STUDY_ARGS=TINY,
               PYTHON=sys.executable, CALL_MINUTES="5", PARALLEL="1")
    first = subprocess.run(["bash", "benchmarks/study_lm_gpu.sh"], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    with tarfile.open(tmp_path / "out" / "study_lm.tar.gz") as tar:
        names = set(tar.getnames())
    assert {"./study.json", "./rows.jsonl", "./report.json", "./corpus.json",
            "./data_meta.json"} <= names and not any("runs/" in n for n in names)
    # a fresh machine: the committed study.json alone (no run finished yet)
    results.mkdir()
    shutil.copy(work / "study" / "study.json", results / "study.json")
    shutil.rmtree(work / "study")
    again = subprocess.run(["bash", "benchmarks/study_lm_gpu.sh"], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-2000:]
    assert len((work / "study" / "rows.jsonl").read_text().splitlines()) == 2
