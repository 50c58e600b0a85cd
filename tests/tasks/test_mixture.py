"""`moremoe data mixture` as a library: the paper's recipe, each benchmark's formatter on its
Hub schema, budgets and repeats against an independent re-tokenisation, the validation draw,
determinism, resume, and the errors (a missing network, a bad local copy)."""
from dataclasses import replace

import numpy as np
import pytest

from mixture_fixtures import benchmark_rows, text_rows, write_sources
from moremoe.tasks.formats import FORMATS, render
from moremoe.tasks.mixture import MixtureConfig, build_mixture, draw_validation
from moremoe.tasks.recipe import PAPER, nominal_tokens, scale_for, scaled, select
from moremoe.tasks.text import open_tokens, read_meta, verify_tokens
from moremoe.tasks.tokenizer import EOT_ID, gpt2_encoding

pytest.importorskip("datasets")

T, VAL = 64, 20
BUDGETS = {"fineweb_edu": 30_000, "cosmopedia": 20_000, "wikipedia": 12_000}  # fineweb: 26K
BENCHMARKS = ("triviaqa", "nq_open", "hotpotqa", "webqs", "cwq", "arc_easy", "hellaswag",
              "openbookqa", "piqa", "sciq", "siqa", "winogrande")


def recipe():
    return tuple(replace(s, budget=BUDGETS.get(s.name, s.budget)) for s in PAPER)


def config(sources, out, **kw):
    kw = {"specs": recipe(), "sources": tuple((n, str(p)) for n, p in sources.items()),
          "seq_len": T, "val_sequences": VAL, "workers": 2, "chunk_tokens": 3000, **kw}
    return MixtureConfig(out=str(out), **kw)


def outputs(out):
    return {n: (out / n).read_bytes() for n in ("train.bin", "val.bin", "meta.json",
                                                "mixture.json")}


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    return write_sources(tmp_path_factory.mktemp("sources"))


@pytest.fixture(scope="module")
def reference(sources, tmp_path_factory):
    out = tmp_path_factory.mktemp("ref") / "out"
    return out, build_mixture(config(sources, out), progress=False)


# ---------------------------------------------------------------- the recipe and formats

def test_the_recipe_is_the_papers():
    by = {s.name: s for s in PAPER}
    assert [s.name for s in PAPER[:3]] == ["fineweb_edu", "cosmopedia", "wikipedia"]
    assert (by["fineweb_edu"].budget, by["cosmopedia"].budget, by["wikipedia"].budget) == \
        (37_000_000_000, 14_000_000_000, 4_000_000_000)
    assert [by[n].repeats for n in ("fineweb_edu", "cosmopedia", "wikipedia")] == [1, 1, 3]
    assert tuple(s.name for s in PAPER[3:]) == BENCHMARKS
    assert all(s.budget is None and s.repeats == 3 for s in PAPER[3:])
    assert {s.split for s in PAPER} == {"train"}
    assert nominal_tokens(PAPER) == 63_000_000_000
    small = {s.name: s for s in scaled(PAPER, scale_for(PAPER, 630_000_000))}
    assert small["fineweb_edu"].budget == 370_000_000 and small["wikipedia"].repeats == 3
    assert small["sciq"].fraction == pytest.approx(0.01) and small["sciq"].budget is None
    for bad, message in [(lambda: scaled(PAPER, 1.5), r"--scale must be in \(0, 1\], got 1.5"),
                         (lambda: scale_for(PAPER, 10 ** 11), r"--tokens must be in \[1, 63,"),
                         (lambda: select(PAPER, ["wiki"]), "--skip wiki: not a source"),
                         (lambda: select(PAPER, [s.name for s in PAPER]), "leaves no source")]:
        with pytest.raises(ValueError, match=message):
            bad()


HOTPOT = {"id": "5a7a06935542990198eaf050", "question": "Which magazine was started first, "
          "Arthur's Magazine or First for Women?", "answer": "Arthur's Magazine",
          "type": "comparison", "level": "medium",
          "supporting_facts": {"title": ["Arthur's Magazine", "First for Women"],
                               "sent_id": [0, 0]},
          "context": {"title": ["Radio City"], "sentences": [["Radio City is India's first."]]}}
CWQ_PARQUET = {"ID": "WebQTrn-0_x", "question": "What language is spoken where the film was "
               "made?", "answers": {"aliases": [["Jamaican Creole"]], "answer":
                                    ["Jamaican English"], "answer_id": ["m.01428y"]},
               "composition_answer": "jamaica", "compositionality_type": "composition",
               "created": "", "machine_question": "", "sparql": "", "webqsp_ID": "",
               "webqsp_question": ""}


@pytest.mark.parametrize("fmt, row, text", [
    ("triviaqa", benchmark_rows(1)["triviaqa"][0],
     "Question: Which planet is number 0 from the Sun??\nAnswer: Planet 0"),
    ("nq_open", {"question": "who wrote the declaration of independence",
                 "answer": ["Thomas Jefferson", "Jefferson"]},
     "Answer these questions:\n\nQ: who wrote the declaration of independence?\n"
     "A: Thomas Jefferson"),
    ("hotpotqa", HOTPOT, "Question: Which magazine was started first, Arthur's Magazine or "
                         "First for Women?\nAnswer: Arthur's Magazine"),
    ("webqs", {"url": "http://www.freebase.com/view/en/justin_bieber",
               "question": "what is the name of justin bieber brother?",
               "answers": ["Jazmyn Bieber", "Jaxon Bieber"]},
     "Question: what is the name of justin bieber brother?\nAnswer: Jazmyn Bieber"),
    ("cwq", CWQ_PARQUET, "Question: What language is spoken where the film was made?\n"
                         "Answer: Jamaican English"),
    ("cwq", {**CWQ_PARQUET, "answers": [{"answer": "Jamaican English", "answer_id": "m.01428y",
                                         "aliases": ["Jamaican Creole"]}]},
     "Question: What language is spoken where the film was made?\nAnswer: Jamaican English"),
    ("arc", {"id": "NYSEDREGENTS_2015_4_8", "question": "Which object is the best conductor of "
             "electricity?", "choices": {"text": ["a wax crayon", "a plastic spoon",
                                                  "a rubber eraser", "an iron nail"],
                                         "label": ["1", "2", "3", "4"]}, "answerKey": "4"},
     "Question: Which object is the best conductor of electricity?\nAnswer: an iron nail"),
    ("hellaswag", benchmark_rows(1)["hellaswag"][0],
     "Roof shingle removal: A man 0 is sitting on a roof. He starts pulling up roofing."),
    ("hellaswag", {**benchmark_rows(1)["hellaswag"][0], "label": "1"},
     "Roof shingle removal: A man 0 is sitting on a roof. He is ripping. tiles off."),
    ("openbookqa", {"id": "7-980", "question_stem": "The sun is responsible for",
                    "choices": {"text": ["puppies learning new tricks", "plants sprouting",
                                         "flowers wilting", "cold"],
                                "label": ["A", "B", "C", "D"]}, "answerKey": "B"},
     "The sun is responsible for plants sprouting"),
    ("piqa", {"goal": "How do I ready a guinea pig cage?", "sol1": "Put strips of paper.",
              "sol2": "Put jeans.", "label": 0},
     "Question: How do I ready a guinea pig cage?\nAnswer: Put strips of paper."),
    ("sciq", benchmark_rows(1)["sciq"][0], "Mesophiles 0 grow.\nQuestion: What type of organism"
                                           " 0 makes cheese?\nAnswer: mesophilic organisms"),
    ("siqa", {"context": "Tracy didn't go home that evening.", "question": "Why did Tracy do "
              "this?", "answerA": "a", "answerB": "b", "answerC": "find somewhere to go",
              "label": "3"},
     "Q: Tracy didn't go home that evening. Why did Tracy do this?\nA: find somewhere to go"),
    ("winogrande", {"sentence": "Sarah was a much better surgeon than Maria so _ always got the "
                                "harder cases.", "option1": "Sarah", "option2": "Maria",
                    "answer": "1"},
     "Sarah was a much better surgeon than Maria so Sarah always got the harder cases."),
    ("wikipedia", {"id": "12", "url": "https://en.wikipedia.org/wiki/Anarchism",
                   "title": "Anarchism", "text": "Anarchism is a political philosophy."},
     "Anarchism\n\nAnarchism is a political philosophy."),
    ("text", text_rows()["cosmopedia"][0], text_rows()["cosmopedia"][0]["text"]),
])
def test_each_formatter_on_its_hub_schema(fmt, row, text):
    assert set(FORMATS[fmt].columns) <= set(row)
    assert render(fmt, row, "here") == text


def test_examples_without_a_gold_answer_are_skipped_and_bad_rows_named():
    rows = benchmark_rows(1)
    assert render("hellaswag", {**rows["hellaswag"][0], "label": ""}, "x") == ""
    assert render("nq_open", {"question": "q", "answer": []}, "x") == ""
    assert render("winogrande", {**rows["winogrande"][0], "answer": ""}, "x") == ""
    with pytest.raises(ValueError, match=r"source arc_easy, row 7: cannot format the row as arc"
                                         r" \(ValueError: .*\); is it in the Hub schema"):
        render("arc", {**rows["arc_easy"][0], "answerKey": "E"}, "source arc_easy, row 7")


def test_validation_draw_is_uniform_over_the_pool_and_distinct():
    held = draw_validation([1000, 1000, 0], [1, 3, 3], 400, seed=0)
    assert len(held[2]) == 0 and sum(map(len, held)) == 400
    assert 0.68 < len(held[1]) / 400 < 0.82            # 3 copies: 3/4 of the pool
    assert all(len(np.unique(h)) == len(h) for h in held)
    # without repeats: `data prepare`'s rule, a draw of positions without replacement
    positions = np.sort(np.random.default_rng(4).choice(120, 30, replace=False))
    held = draw_validation([50, 70], [1, 1], 30, seed=4)
    assert np.array_equal(np.concatenate([held[0], held[1] + 50]), positions)
    # nearly every distinct row: redraws until v distinct rows
    assert sum(map(len, draw_validation([5, 3], [3, 3], 7, seed=1))) == 7


# ---------------------------------------------------------------- a build

def expected_rows():
    """Each source's rows, re-tokenised here from the fixture rows."""
    enc, rows = gpt2_encoding(), {**text_rows(), **benchmark_rows()}
    out = {}
    for spec in recipe():
        ids = []
        for row in rows[spec.name]:
            text = render(spec.format, row, spec.name)
            if text:
                ids += enc.encode_ordinary(text) + [EOT_ID]
        ids = ids[:spec.budget] if spec.budget is not None else ids
        n = len(ids) // T
        out[spec.name] = (len(ids), np.array(ids[:n * T], dtype=np.uint16).reshape(n, T))
    return out


def test_budgets_repeats_and_splits(reference, sources):
    out, summary = reference
    train, val = open_tokens(out, "train", verify=True), open_tokens(out, "val", verify=True)
    val_set = {r.tobytes() for r in val}
    assert len(val_set) == VAL == len(val)
    got = {r["name"]: r for r in summary["sources"]}
    want_train, want_val = [], []
    for spec in recipe():
        taken, rows = expected_rows()[spec.name]
        r = got[spec.name]
        assert r["tokens_taken"] == taken and r["sequences"] == len(rows)
        if spec.budget is not None and spec.name != "fineweb_edu":
            assert taken == spec.budget and not r["whole_source"]     # the budget, exactly
        held = np.array([row.tobytes() in val_set for row in rows], dtype=bool)
        assert r["val_sequences"] == held.sum()
        assert r["train_sequences"] == (len(rows) - held.sum()) * spec.repeats
        want_train += [rows[~held]] * spec.repeats                    # every copy, in order
        want_val.append(rows[held])
    assert np.array_equal(train, np.concatenate(want_train))
    assert np.array_equal(val, np.concatenate(want_val))
    assert not val_set & {r.tobytes() for r in train}                 # no copy of a val row
    assert got["fineweb_edu"]["tokens_taken"] < 30_000 and got["fineweb_edu"]["whole_source"]
    assert got["wikipedia"]["repeats"] == 3 and got["sciq"]["rows_read"] == 40
    assert summary["chunks"] > len(PAPER) and verify_tokens(out)["ok"]
    meta = read_meta(out)
    assert meta["train_sequences"] == len(train) and meta["recipe"] == "custom"
    assert meta["sources"][0] == f"fineweb_edu={sources['fineweb_edu']}"
    from moremoe.training.data import Batches        # `moremoe train` reads it as prepared data
    batch = Batches(train, batch_size=4, world=1, grad_accum=1, seed=0, vocab=50257)
    assert batch.micro_batch(0, 0).shape == (4, T)
    assert sorted(p.name for p in out.iterdir()) == ["meta.json", "mixture.json", "train.bin",
                                                    "val.bin"]


def test_manifest_names_hub_ids_budgets_and_what_was_written(reference):
    import json
    out, _ = reference
    m = json.loads((out / "mixture.json").read_text())
    by = {r["name"]: r for r in m["sources"]}
    assert (m["seed"], m["seq_len"], m["val_sequences"], m["scale"]) == (0, T, VAL, 1.0)
    assert by["triviaqa"]["hub"] == "mandarjoshi/trivia_qa" and \
        by["triviaqa"]["config"] == "rc.nocontext" and by["triviaqa"]["split"] == "train"
    assert by["cosmopedia"]["budget_tokens"] == 20_000 and by["sciq"]["budget_tokens"] is None
    assert by["hellaswag"]["origin"]["builder"] == "saved"
    assert sum(r["tokens_written"] for r in m["sources"]) == m["tokens_written"]
    assert by["wikipedia"]["tokens_written"] == \
        (by["wikipedia"]["train_sequences"] + by["wikipedia"]["val_sequences"]) * T


def test_same_bytes_for_a_seed_any_workers_and_chunk_size(sources, reference, tmp_path):
    ref = outputs(reference[0])
    build_mixture(config(sources, tmp_path / "a", workers=1, chunk_tokens=10 ** 6),
                  progress=False)
    assert outputs(tmp_path / "a") == ref
    build_mixture(config(sources, tmp_path / "b", seed=1), progress=False)
    assert outputs(tmp_path / "b")["val.bin"] != ref["val.bin"]


@pytest.mark.parametrize("source, index", [
    ("fineweb_edu", 1),     # parquet files: the next batch crosses into the second file
    ("cosmopedia", 2),      # jsonl
    ("wikipedia", 0),       # a save_to_disk folder
])
def test_interrupted_build_resumes_to_the_same_bytes(sources, reference, tmp_path, source,
                                                     index):
    out, seen = tmp_path / "out", []

    def stop(name, i):
        seen.append(name)
        if (name, i) == (source, index):
            raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        build_mixture(config(sources, out), progress=False, on_chunk=stop)
    assert sorted(p.name for p in out.iterdir()) == [".partial"]       # nothing final yet
    chunks = sorted((out / ".partial" / source).glob("*.json"))
    assert len(chunks) == index + 1 and seen.count(source) == index + 1
    next_bin = out / ".partial" / source / f"{index + 1:06d}.bin"
    next_bin.write_bytes(b"torn")                                      # a torn write
    summary = build_mixture(config(sources, out), progress=False)
    assert summary["chunks_reused"] == len(seen)
    assert outputs(out) == outputs(reference[0])
    assert not (out / ".partial").exists()


def test_output_needs_force_and_conflicting_work_needs_restart(sources, reference, tmp_path):
    with pytest.raises(ValueError, match="already holds prepared data .*pass --force"):
        build_mixture(config(sources, reference[0]), progress=False)
    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        build_mixture(config(sources, out), progress=False,
                      on_chunk=lambda name, i: (_ for _ in ()).throw(KeyboardInterrupt))
    other = tuple(replace(s, budget=9_000) if s.name == "fineweb_edu" else s for s in recipe())
    with pytest.raises(ValueError, match=r"\.partial holds unfinished work with other sources "
                                         r"fineweb_edu \(origin, budget or sampling\); .* pass "
                                         r"--restart to discard it"):
        build_mixture(config(sources, out, specs=other), progress=False)
    assert build_mixture(config(sources, out, specs=other, restart=True),
                         progress=False)["chunks_reused"] == 0
    build_mixture(config(sources, out, force=True), progress=False)
    assert outputs(out) == outputs(reference[0])


def test_too_few_sequences_names_fixes_that_work(sources, reference, tmp_path):
    """Refused when --val-sequences leaves no training sequence; each fix the message names
    (the most --val-sequences at this --seq-len, the longest --seq-len at these
    --val-sequences) then builds."""
    import re
    rows = sum(r["sequences"] for r in reference[1]["sources"])
    with pytest.raises(ValueError) as err:
        build_mixture(config(sources, tmp_path / "a", val_sequences=rows), progress=False)
    got = re.search(r"too few sequences: the mixture gives ([\d,]+) distinct sequences of "
                    r"--seq-len 64, and --val-sequences [\d,]+ leaves none for training; use "
                    r"a --seq-len of at most ([\d,]+) or --val-sequences of at most ([\d,]+), "
                    r"or a larger --scale / --tokens$", str(err.value))
    assert got, str(err.value)
    total, longest, most = (int(g.replace(",", "")) for g in got.groups())
    assert total == rows and most == rows - 1 and longest < T
    build_mixture(config(sources, tmp_path / "b", val_sequences=most), progress=False)
    build_mixture(config(sources, tmp_path / "c", val_sequences=rows, seq_len=longest),
                  progress=False)
    with pytest.raises(ValueError, match=r"--seq-len of at most"):
        build_mixture(config(sources, tmp_path / "d", val_sequences=rows,
                             seq_len=longest + 1), progress=False)


def test_skipping_a_source_keeps_the_work_done(sources, tmp_path):
    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        build_mixture(config(sources, out), progress=False, on_chunk=lambda name, i: (
            (_ for _ in ()).throw(KeyboardInterrupt) if name == "wikipedia" else None))
    s = build_mixture(config(sources, out, skip=("winogrande", "piqa")), progress=False)
    assert s["chunks_reused"] >= 5 and "piqa" not in {r["name"] for r in s["sources"]}


def test_a_smaller_mixture_scales_budgets_and_samples_benchmarks(sources, tmp_path):
    runs = {}
    for key, seed in (("a", 0), ("b", 0), ("c", 5)):
        s = build_mixture(config(sources, tmp_path / key, scale=0.5, seed=seed), progress=False)
        runs[key] = {r["name"]: r for r in s["sources"]}
    a = runs["a"]
    assert (a["cosmopedia"]["tokens_taken"], a["wikipedia"]["tokens_taken"]) == (10_000, 6_000)
    kept = sum(a[n]["documents"] for n in BENCHMARKS)
    assert 0.38 < kept / (40 * 12) < 0.62 and all(a[n]["rows_read"] == 40 for n in BENCHMARKS)
    assert all(a[n]["fraction"] == 0.5 for n in BENCHMARKS)
    assert outputs(tmp_path / "a") == outputs(tmp_path / "b")              # same seed
    assert [runs["c"][n]["documents"] for n in BENCHMARKS] != \
        [a[n]["documents"] for n in BENCHMARKS]                              # other examples
    cfg = config(sources, tmp_path / "d", tokens=nominal_tokens(recipe()) // 4)
    assert cfg.effective_scale == pytest.approx(0.25)
    assert {s.name: s.budget for s in cfg.plan()}["cosmopedia"] == 5_000


# ---------------------------------------------------------------- errors

def test_a_missing_network_names_the_sources_to_download(sources, tmp_path, monkeypatch):
    some = {n: p for n, p in sources.items() if n not in ("piqa", "siqa")}
    # tests run with HF_HUB_OFFLINE=1 (conftest)
    with pytest.raises(ValueError) as err:
        build_mixture(config(some, tmp_path / "o"), progress=False)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("the Hugging Face Hub is out of reach (HF_HUB_OFFLINE is set) "
                              "and 2 sources have no local copy: piqa=baber/piqa, "
                              "siqa=lighteval/siqa; download them where there is a network")
    assert "pass each with --source NAME=PATH" in message and "--skip NAME" in message
    import datasets
    import huggingface_hub.constants as hub
    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", False)
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):      # datasets < 2.21: the second
        monkeypatch.setattr(datasets.config, name, False, raising=False)
    monkeypatch.setattr(hub, "ENDPOINT", "http://127.0.0.1:9")   # nothing listens there
    with pytest.raises(ValueError, match=r"out of reach \(http://127\.0\.0\.1:9: .+\) and 15 "
                                         r"sources have no local copy: fineweb_edu=HuggingFaceTB"
                                         r"/smollm-corpus:fineweb-edu-dedup, cosmopedia="):
        build_mixture(config({}, tmp_path / "o2"), progress=False)
    assert not (tmp_path / "o" / "train.bin").exists()


def test_bad_local_copies_are_named(sources, tmp_path):
    import datasets
    (tmp_path / "notes.txt").write_text("x")
    (tmp_path / "cut.jsonl").write_bytes(sources["piqa"].read_bytes()[:-25])
    datasets.DatasetDict({"test": datasets.Dataset.from_dict({"text": ["a"]})}).save_to_disk(
        str(tmp_path / "dd"))
    for name, path, message in [
            ("piqa", tmp_path / "missing", r"--source piqa=.*missing: no such file or folder"),
            ("piqa", tmp_path / "notes.txt", r"--source piqa=.*notes.txt: expected a .jsonl"),
            ("cosmopedia", tmp_path / "dd", r"saved DatasetDict has splits \['test'\], not"),
            ("piqa", tmp_path / "cut.jsonl", r"source piqa \(.*cut.jsonl\): line 40 is not "
                                             r"JSON \(.*\): the line is cut short"),
            ("triviaqa", sources["cosmopedia"],
             r"source triviaqa \(.*cosmopedia.jsonl\): no column 'question', 'answer' \(has: "
             r"prompt, text, .*\); the triviaqa formatter expects the Hub schema"),
            ("pica", sources["piqa"], r"--source pica=.*: 'pica' is not in the recipe; "
                                      r"expected one of fineweb_edu,")]:
        with pytest.raises(ValueError, match=message):
            build_mixture(config({**sources, name: path}, tmp_path / "o"), progress=False)


def test_the_hub_path_reads_a_parquet_conversion_by_data_dir(tmp_path):
    """ComplexWebQuestions comes from the Hub's parquet conversion (CONFIG/SPLIT/0000.parquet
    under refs/convert/parquet): open_hub's data_dir picks the config, the folder the split.
    Here the "Hub" is a local folder in that layout (load_dataset takes either)."""
    import datasets
    from moremoe.tasks.streams import open_hub
    rows = benchmark_rows(3)["cwq"]
    struct = [{**r, "answers": {k: [a[k] for a in r["answers"]] for k in r["answers"][0]}}
              for r in rows]                          # Sequence(dict) in parquet: a struct
    for config_dir, split, part in [("complex_web_questions", "train", struct),
                                    ("complex_web_questions", "validation", struct[:1]),
                                    ("complexwebquestions_test", "test", struct[:1])]:
        (tmp_path / config_dir / split).mkdir(parents=True, exist_ok=True)
        datasets.Dataset.from_list(part).to_parquet(str(tmp_path / config_dir / split /
                                                        "0000.parquet"))
    spec = replace(next(s for s in PAPER if s.name == "cwq"), hub=str(tmp_path), revision=None)
    assert [render("cwq", r, "cwq") for r in open_hub(spec)] == \
        [render("cwq", r, "cwq") for r in rows] == \
        [f"Question: What is the film directed by D{i} about?\nAnswer: Topic {i}"
         for i in range(3)]
