"""`moremoe data corpus --packages`: the packages it reads, what it drops, the split by whole
package, the fingerprint; and `data prepare --val-input`, which holds validation out by
input."""
import hashlib
import json
import random

import numpy as np
import pytest

from cli_checks import fails
from moremoe.cli import main
from moremoe.tasks import near_dup
from moremoe.tasks.corpus import CorpusConfig, build_corpus, installed_roots, package_of
from moremoe.tasks.prepare import PrepareConfig, prepare
from moremoe.tasks.text import open_tokens, read_meta
from moremoe.tasks.tokenizer import EOT_ID, gpt2_encoding

WORDS = [f"w{i}" for i in range(5000)]


def prose(seed: int, n: int = 400) -> str:
    rng = random.Random(seed)
    lines = [" ".join(rng.choice(WORDS) for _ in range(8)) for _ in range(n // 8)]
    return "\n".join(f"x = {line!r}" for line in lines) + "\n"


def edited(text: str) -> str:
    """text with one line in forty changed: a near duplicate (Jaccard about 0.9)."""
    lines = text.splitlines()
    return "\n".join(ln + " changed" if i % 40 == 0 else ln for i, ln in enumerate(lines)) + "\n"


@pytest.fixture
def packages(tmp_path):
    """A folder of packages: 24 small ones, a vendored copy, a near copy, a module, a
    dist-info, and files that must not be read (bytes, whitespace, caches, hidden)."""
    root = tmp_path / "site"
    files = {f"pkg{i:02d}/__init__.py": prose(i) for i in range(24)}
    files |= {"alpha/core.py": prose(100, 2000), "beta/util.py": edited(prose(100, 2000)),
              "rich/console.py": prose(101), "pipx/_vendor/rich/console.py": prose(101),
              "gamma.py": prose(102), "gamma-1.0.dist-info/LICENSE.md": prose(103),
              "docs/guide.rst": prose(104), "notes.txt": prose(105),
              "delta/empty.py": "  \n\n", "__pycache__/cached.py": prose(106),
              ".hidden/secret.py": prose(107)}
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    (root / "delta" / "latin.py").write_bytes("caf\xe9 = 1\n".encode("latin-1"))
    return root


def build(root, out, **kw):
    kw = {"installed": False, "extra_roots": (str(root),), "val_fraction": 0.2, **kw}
    return build_corpus(CorpusConfig(out=str(out), **kw), progress=False)


def lines(path):
    return [json.loads(ln) for ln in path.read_text().splitlines()]


@pytest.mark.parametrize("parts, package", [
    (("torch", "nn", "functional.py"), "torch"),
    (("six.py",), "six"),
    (("pip", "_vendor", "rich", "console.py"), "rich"),
    (("pip", "_vendor", "six.py"), "six"),
    (("setuptools", "_vendor", "packaging", "version.py"), "packaging"),
    (("Jinja2-3.1.dist-info", "LICENSE.md"), "jinja2"),
    (("zope.interface-6.0.egg-info", "README.rst"), "zope_interface"),
    (("typing-extensions.py",), "typing_extensions"),
])
def test_a_file_belongs_to_its_top_package_or_the_vendored_one(parts, package):
    assert package_of(parts) == package


def test_the_corpus_drops_copies_and_splits_by_whole_package(packages, tmp_path):
    s = build(packages, tmp_path / "c")
    train, val = lines(tmp_path / "c" / "train.jsonl"), lines(tmp_path / "c" / "val.jsonl")
    paths = {d["path"] for d in train + val}
    # read: .py/.md/.rst files outside caches and hidden folders; not .txt
    assert "root/notes.txt" not in paths and not any("cached" in p or "secret" in p
                                                      for p in paths)
    assert s["removed"]["not_utf8"]["files"] == 1 and s["removed"]["empty"]["files"] == 1
    # the vendored copy equals its original: one is kept, under the package "rich"
    assert s["removed"]["exact_duplicate"]["files"] == 1
    assert [d["package"] for d in train + val if d["path"].endswith("console.py")] == ["rich"]
    # the near copy (one line in forty changed) goes; the first in the order, alpha, stays
    assert s["removed"]["near_duplicate"]["files"] == 1
    assert "root/alpha/core.py" in paths and "root/beta/util.py" not in paths
    assert s["kept"]["files"] == len(train) + len(val) == 24 + 5
    # whole packages: none in both splits, validation within its share of the bytes
    assert not {d["package"] for d in train} & {d["package"] for d in val}
    assert sorted({d["package"] for d in val}) == s["val_packages"] != []
    val_bytes = sum(len(d["text"].encode()) for d in val)
    assert val_bytes == s["splits"]["val"]["bytes"] <= 0.2 * s["kept"]["bytes"]
    assert {d["package"] for d in train + val} >= {"gamma", "docs", "alpha"}


def test_the_fingerprint_is_the_two_files_and_the_seed_moves_the_split(packages, tmp_path):
    a = build(packages, tmp_path / "a")
    digest = hashlib.sha256((tmp_path / "a" / "train.jsonl").read_bytes()
                            + (tmp_path / "a" / "val.jsonl").read_bytes()).hexdigest()
    assert a["fingerprint"] == digest
    assert build(packages, tmp_path / "a", force=True)["fingerprint"] == digest   # again
    b = build(packages, tmp_path / "b", seed=1)
    assert b["val_packages"] != a["val_packages"] and b["fingerprint"] != digest
    (packages / "pkg00" / "__init__.py").write_text(prose(999))
    assert build(packages, tmp_path / "c")["fingerprint"] != digest


def test_a_corpus_is_replaced_only_with_force(packages, tmp_path):
    build(packages, tmp_path / "c")
    before = (tmp_path / "c" / "train.jsonl").read_bytes()
    with pytest.raises(ValueError, match="--force"):
        build(packages, tmp_path / "c", seed=3)
    assert (tmp_path / "c" / "train.jsonl").read_bytes() == before


def test_near_duplicates_are_estimated_jaccard():
    a, b = prose(1, 4000).encode(), edited(prose(1, 4000)).encode()
    sa, sb, sc = near_dup.signature(a), near_dup.signature(b), near_dup.signature(
        prose(2, 4000).encode())
    assert near_dup.similarity(sa, sa) == 1.0
    sh_a, sh_b = set(near_dup.shingles(a).tolist()), set(near_dup.shingles(b).tolist())
    exact = len(sh_a & sh_b) / len(sh_a | sh_b)
    assert abs(near_dup.similarity(sa, sb) - exact) < 4 * (exact * (1 - exact) / 128) ** 0.5
    assert near_dup.similarity(sa, sc) < 0.1
    # the same signature in a fresh process: no salted hash
    assert near_dup.groups(np.stack([sc, sa, sb, sa]), 0.8) == [0, 1, 1, 1]
    with pytest.raises(ValueError, match="threshold"):
        near_dup.groups(np.stack([sa]), 0)


def test_this_pythons_packages_are_found():
    roots = installed_roots()
    assert roots[0].kind == "stdlib" and (roots[0].path / "json").is_dir()
    assert any((r.path / "pytest").is_dir() for r in roots if r.kind == "site-packages")


def stream(enc, docs, T):
    ids = np.concatenate([np.append(enc.encode_ordinary(d["text"]), EOT_ID) for d in docs])
    return ids[:len(ids) // T * T].reshape(-1, T).astype(np.uint16)


def test_prepare_holds_validation_out_by_input(packages, tmp_path):
    build(packages, tmp_path / "c")
    out, T = tmp_path / "data", 32
    s = prepare(PrepareConfig(inputs=(str(tmp_path / "c" / "train.jsonl"),),
                              val_inputs=(str(tmp_path / "c" / "val.jsonl"),),
                              val_sequences=None, seq_len=T, out=str(out), workers=1),
                progress=False)
    enc = gpt2_encoding()
    train_rows = stream(enc, lines(tmp_path / "c" / "train.jsonl"), T)
    val_rows = stream(enc, lines(tmp_path / "c" / "val.jsonl"), T)
    assert np.array_equal(open_tokens(out, "train", verify=True), train_rows)
    val = open_tokens(out, "val", verify=True)          # all of them, in a seeded order
    order = np.random.default_rng(0)
    order.choice(len(val_rows), size=len(val_rows), replace=False)
    assert np.array_equal(val, val_rows[order.permutation(len(val_rows))])
    meta = read_meta(out)
    corpus = json.loads((tmp_path / "c" / "corpus.json").read_text())
    assert meta["corpus"]["fingerprint"] == s["corpus"]["fingerprint"] == corpus["fingerprint"]
    assert meta["val_sequences"] == len(val_rows) and "held out by input" in meta["val_split"]
    few = prepare(PrepareConfig(inputs=(str(tmp_path / "c" / "train.jsonl"),),
                                val_inputs=(str(tmp_path / "c" / "val.jsonl"),),
                                val_sequences=3, seq_len=T, out=str(tmp_path / "few"),
                                workers=1), progress=False)
    assert few["val_sequences"] == 3


def test_prepare_refuses_a_validation_input_it_trains_on(packages, tmp_path):
    build(packages, tmp_path / "c")
    train = str(tmp_path / "c" / "train.jsonl")
    with pytest.raises(ValueError, match="both an INPUT and a --val-input"):
        prepare(PrepareConfig(inputs=(train,), val_inputs=(train,), val_sequences=None,
                              out=str(tmp_path / "d"), workers=1), progress=False)
    with pytest.raises(ValueError, match="--val-sequences 0 with --val-input"):
        prepare(PrepareConfig(inputs=(train,), val_sequences=0, out=str(tmp_path / "d"),
                              val_inputs=(str(tmp_path / "c" / "val.jsonl"),), workers=1),
                progress=False)
    assert not (tmp_path / "d").exists()
    for many in (10 ** 6, 400):     # more than the bytes can hold; than the tokens give
        with pytest.raises(ValueError, match="too few validation sequences"):
            prepare(PrepareConfig(inputs=(train,), val_sequences=many, seq_len=32,
                                  val_inputs=(str(tmp_path / "c" / "val.jsonl"),),
                                  out=str(tmp_path / "d"), workers=1), progress=False)


def test_the_corpus_command(packages, tmp_path, capsys):
    assert main(["data", "corpus", str(tmp_path / "c"), "--packages", "--no-installed",
                 "--root", str(packages), "--val-fraction", "0.2", "--json",
                 "--no-progress"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["kept"]["files"] == 29 and report["roots"][0]["kind"] == "root"
    assert main(["data", "prepare", str(tmp_path / "c" / "train.jsonl"), "--val-input",
                 str(tmp_path / "c" / "val.jsonl"), "--out", str(tmp_path / "d"), "--seq-len",
                 "32", "--json", "--no-progress"]) == 0
    assert json.loads(capsys.readouterr().out)["corpus"]["fingerprint"] == report["fingerprint"]
    for argv, says in ((["--packages", "--python-source"], "--python-source"),
                       (["--root", str(packages)], "add --packages"),
                       (["--seed", "0"], "--seed is an option of the packages' corpus"),
                       (["--near-dup", "0"], "--near-dup is an option"),
                       (["--workers", "2"], "--workers is an option"),
                       (["--packages", "--val-fraction", "1"], r"in \(0, 1\)"),
                       (["--packages", "--near-dup", "1.5"], r"in \[0, 1\]")):
        fails(capsys, ["data", "corpus", str(tmp_path / "e"), *argv], says)


def test_a_fraction_no_package_fits_is_refused_before_any_file(packages, tmp_path):
    with pytest.raises(ValueError, match=r"--val-fraction 1e-06: no whole package fits"):
        build(packages, tmp_path / "c", val_fraction=1e-6)
    assert not (tmp_path / "c").exists() or not any((tmp_path / "c").iterdir())
