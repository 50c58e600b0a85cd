"""benchmarks/pack_out.sh: a device call returns 8 files of its $OUT at most, so a folder of
more is packed into one results.tgz (train_pair.sh's text, data and checkpoints left out
and deleted); a folder of 8 or fewer stays as it is; bad arguments are named."""
import subprocess
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "pack_out.sh"


def _run(*args):
    return subprocess.run(["bash", str(SCRIPT), *map(str, args)], capture_output=True,
                          text=True, timeout=60)


def _tree(root: Path, files):
    for name in files:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(name)


def test_more_than_eight_files_become_one_tar_without_the_prepared_text(tmp_path):
    kept = [f"f{i}.txt" for i in range(7)] + ["router/table.md", "pair/a.json"]
    _tree(tmp_path, kept + ["pair/corpus/c.txt", "pair/data/train.bin",
                            "pair/run_x/ckpt/model.pt"])
    got = _run(tmp_path)
    assert got.returncode == 0, got.stderr
    assert "9 files packed" in got.stdout
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")) == \
        ["results.tgz"]
    with tarfile.open(tmp_path / "results.tgz") as tar:
        names = sorted(n.removeprefix("./") for n in tar.getnames())
        assert names == sorted(kept)
        assert tar.extractfile("./router/table.md").read() == b"router/table.md"


def test_eight_files_or_fewer_stay(tmp_path):
    files = [f"f{i}.txt" for i in range(8)]
    _tree(tmp_path, files + ["pair/corpus/c.txt"])
    got = _run(tmp_path)
    assert got.returncode == 0 and got.stdout == ""
    assert not (tmp_path / "results.tgz").exists()
    assert all((tmp_path / f).is_file() for f in files + ["pair/corpus/c.txt"])
    assert _run(tmp_path, 3).returncode == 0 and (tmp_path / "results.tgz").is_file()


def test_bad_arguments_are_named(tmp_path):
    missing = _run(tmp_path / "nope")
    assert missing.returncode == 2 and "is not a folder" in missing.stderr
    bad = _run(tmp_path, "x")
    assert bad.returncode == 2 and "MAX must be a whole number; got 'x'" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1
