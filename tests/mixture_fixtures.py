"""Local copies of the paper mixture's 15 sources, each in its Hub schema (the column names
and nesting `datasets` yields), written in the ways a user may pass them: jsonl, jsonl.gz,
a JSON array, parquet, a folder of files, save_to_disk folders. Text comes from Python's
pydoc topics, so nothing is downloaded."""
import datetime
import gzip
import json

_DATE = datetime.datetime(2024, 2, 21, 4, 10, 5)


def _prose():
    """792 paragraphs of Python's documentation (80K GPT-2 tokens)."""
    from pydoc_data.topics import topics
    return [p for k in sorted(topics) for p in topics[k].split("\n\n") if len(p) > 200]


def _jsonl(path, rows, *, gz=False):
    data = "".join(json.dumps(r) + "\n" for r in rows).encode()
    path.write_bytes(gzip.compress(data, mtime=0) if gz else data)
    return path


def text_rows():
    """{source: rows} for the three text sources."""
    prose = _prose()
    third = len(prose) // 3
    fineweb = [{"text": t, "id": f"<urn:uuid:{i:08x}>", "metadata": {
        "dump": "CC-MAIN-2024-10", "url": f"https://example.org/{i}", "date": _DATE,
        "file_path": "s3://commoncrawl/x.warc.gz", "language": "en", "language_score": 0.97,
        "token_count": len(t) // 4, "score": 3.1, "int_score": 3}}
        for i, t in enumerate(prose[:third])]
    cosmo = [{"prompt": f"Write a textbook section {i}.", "text": t, "token_length": len(t) // 4,
              "audience": "college_students", "format": "textbook", "seed_data": "stanford"}
             for i, t in enumerate(prose[third:2 * third])]
    wiki = [{"id": str(i), "url": f"https://en.wikipedia.org/wiki?curid={i}",
             "title": f"Topic {i}", "text": t} for i, t in enumerate(prose[2 * third:])]
    return {"fineweb_edu": fineweb, "cosmopedia": cosmo, "wikipedia": wiki}


def benchmark_rows(n=40):
    """{source: rows} for the 12 benchmarks, n rows each, in their Hub schemas."""
    r = range(n)
    return {
        "triviaqa": [{"question": f"Which planet is number {i} from the Sun?",
                      "question_id": f"tc_{i}", "question_source": "http://www.quiz.org/",
                      "entity_pages": {"doc_source": [], "filename": [], "title": [],
                                       "wiki_context": []},
                      "search_results": {"description": [], "filename": [], "rank": [],
                                         "title": [], "url": [], "search_context": []},
                      "answer": {"aliases": [f"Planet {i}", f"P{i}"],
                                 "normalized_aliases": [f"planet {i}", f"p{i}"],
                                 "matched_wiki_entity_name": "",
                                 "normalized_matched_wiki_entity_name": "",
                                 "normalized_value": f"planet {i}", "type": "WikipediaEntity",
                                 "value": f"Planet {i}"}} for i in r],
        "nq_open": [{"question": f"who wrote book number {i}", "answer": [f"Author {i}", "x"]}
                    for i in r],
        "hotpotqa": [{"id": f"5a8{i:05d}", "question": f"Which band formed first, A{i} or B{i}?",
                      "answer": f"A{i}", "type": "comparison", "level": "medium",
                      "supporting_facts": {"title": [f"A{i}", f"B{i}"], "sent_id": [0, 0]},
                      "context": {"title": [f"A{i}"], "sentences": [[f"A{i} formed in 1990."]]}}
                     for i in r],
        "webqs": [{"url": f"http://www.freebase.com/view/en/x{i}",
                   "question": f"what country is city {i} in?", "answers": [f"Country {i}"]}
                  for i in r],
        "cwq": [{"ID": f"WebQTrn-{i}_abc", "webqsp_ID": f"WebQTrn-{i}",
                 "webqsp_question": f"what is film {i} about", "machine_question": "x",
                 "question": f"What is the film directed by D{i} about?", "sparql": "SELECT",
                 "compositionality_type": "composition", "created": "2018-02-13T01:36:14",
                 "composition_answer": "", "answers": [
                     {"answer": f"Topic {i}", "answer_id": f"m.0{i}", "aliases": [f"T{i}"]}]}
                for i in r],
        "arc_easy": [{"id": f"Mercury_{i}", "question": f"Which object {i} conducts heat best?",
                      "choices": {"text": ["wax", "plastic", "rubber", f"iron {i}"],
                                  "label": ["A", "B", "C", "D"]}, "answerKey": "D"} for i in r],
        "hellaswag": [{"ind": i, "activity_label": "Roof shingle removal",
                       "ctx_a": f"A man {i} is sitting on a roof.", "ctx_b": "he",
                       "ctx": f"A man {i} is sitting on a roof. he",
                       "endings": ["is using wrap.", "is ripping [title] tiles off.",
                                   "is holding a cube.", "starts pulling up roofing."],
                       "source_id": f"activitynet~v_{i}", "split": "train",
                       "split_type": "indomain", "label": "3"} for i in r],
        "openbookqa": [{"id": f"7-{i}", "question_stem": f"The sun {i} is responsible for",
                        "choices": {"text": ["puppies", "plants growing", "rain", "cold"],
                                    "label": ["A", "B", "C", "D"]}, "answerKey": "B"}
                       for i in r],
        "piqa": [{"goal": f"How do I ready a guinea pig cage {i}?", "sol1": "Put paper strips.",
                  "sol2": "Put jeans.", "label": i % 2} for i in r],
        "sciq": [{"question": f"What type of organism {i} makes cheese?", "distractor3": "viruses",
                  "distractor1": "protozoa", "distractor2": "gymnosperms",
                  "correct_answer": "mesophilic organisms", "support": f" Mesophiles {i} grow."}
                 for i in r],
        "siqa": [{"context": f"Tracy {i} didn't go home that evening.",
                  "question": "What does Tracy need to do before this?",
                  "answerA": "make a new plan", "answerB": "go home",
                  "answerC": "find somewhere to go", "label": str(1 + i % 3)} for i in r],
        "winogrande": [{"sentence": f"Sarah {i} was a better surgeon than Maria so _ always got "
                                    f"the harder cases.", "option1": "Sarah", "option2": "Maria",
                        "answer": "1" if i % 2 else "2"} for i in r],
    }


def write_sources(root, n_benchmark=40) -> dict:
    """Write every source under root; {name: path} to pass as --source NAME=PATH."""
    import datasets
    root.mkdir(parents=True, exist_ok=True)
    text, bench = text_rows(), benchmark_rows(n_benchmark)
    paths = {}
    fw = root / "fineweb"                          # a folder of parquet files, as downloaded
    fw.mkdir()
    rows = text["fineweb_edu"]
    for k, part in enumerate((rows[:len(rows) // 2], rows[len(rows) // 2:])):
        datasets.Dataset.from_list(part).to_parquet(str(fw / f"train-{k:05d}-of-00002.parquet"))
    paths["fineweb_edu"] = fw
    paths["cosmopedia"] = _jsonl(root / "cosmopedia.jsonl", text["cosmopedia"])
    datasets.Dataset.from_list(text["wikipedia"]).save_to_disk(str(root / "wikipedia"))
    paths["wikipedia"] = root / "wikipedia"
    for name, rows in bench.items():
        paths[name] = _jsonl(root / f"{name}.jsonl", rows)
    paths["triviaqa"].unlink()
    paths["triviaqa"] = _jsonl(root / "triviaqa.jsonl.gz", bench["triviaqa"], gz=True)
    paths["cwq"].unlink()                          # the released ComplexWebQuestions_train.json
    paths["cwq"] = root / "ComplexWebQuestions_train.json"
    paths["cwq"].write_text(json.dumps(bench["cwq"]))
    paths["hellaswag"].unlink()                    # a saved DatasetDict: its train split is read
    datasets.DatasetDict({"train": datasets.Dataset.from_list(bench["hellaswag"])}).save_to_disk(
        str(root / "hellaswag"))
    paths["hellaswag"] = root / "hellaswag"
    return paths


def source_args(paths) -> list[str]:
    return [a for name, p in paths.items() for a in ("--source", f"{name}={p}")]
