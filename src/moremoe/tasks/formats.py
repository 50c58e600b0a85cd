"""Rows of the mixture's sources -> document text: one formatter per Hub schema.

Text sources keep their text (Wikipedia's title goes first). A benchmark's training example
is written the way lm-evaluation-harness shows the task zero-shot (its ``description`` and
``doc_to_text``), then its ``target_delimiter`` (a space) and the gold answer, so the model
meets the evaluation format in training (the reason the paper loops these splits 3 times).
The tasks lm-eval has (trivia_qa, nq_open, webqs, arc_easy, hellaswag, openbookqa, piqa,
sciq, social_iqa, winogrande) copy its templates, question marks included ("Question:
{question}?" even where the question ends in one, as lm-eval asks it); HotpotQA and
ComplexWebQuestions, which it lacks, take the closed-book "Question: ...\\nAnswer: ..." form.

A formatter takes a row as ``datasets`` yields it (nested features as dicts and lists) and
returns the document, or "" for an example without a gold answer (it is skipped). Each one
names the columns it reads, so a file in another schema fails before any work.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Format:
    render: Callable[[dict], str]
    columns: tuple[str, ...]     # the columns render reads
    template: str                # what a document looks like, for --list and the manifest


def _text(row: dict) -> str:
    return row["text"]


def _wikipedia(row: dict) -> str:
    return f"{row['title']}\n\n{row['text']}" if row["text"] else ""


def _triviaqa(row: dict) -> str:
    return f"Question: {row['question']}?\nAnswer: {row['answer']['value']}"


def _nq_open(row: dict) -> str:
    answers = row["answer"]
    return f"Answer these questions:\n\nQ: {row['question']}?\nA: {answers[0]}" if answers \
        else ""


def _question_answer(question: str, answer: str) -> str:
    return f"Question: {question}\nAnswer: {answer}" if answer else ""


def _hotpotqa(row: dict) -> str:
    return _question_answer(row["question"], row["answer"])


def _webqs(row: dict) -> str:
    return _question_answer(row["question"], row["answers"][0] if row["answers"] else "")


def _cwq(row: dict) -> str:
    # the Hub's parquet holds answers as a struct of lists; the released JSON as a list
    answers = row["answers"]
    if isinstance(answers, dict):
        first = answers["answer"][0] if answers.get("answer") else ""
    else:
        first = answers[0]["answer"] if answers else ""
    return _question_answer(row["question"], first or "")


def _choice(choices: dict, key: str) -> str:
    return choices["text"][choices["label"].index(key.strip())]


def _arc(row: dict) -> str:
    return _question_answer(row["question"], _choice(row["choices"], row["answerKey"]))


def _hellaswag_clean(text: str) -> str:
    # lm-eval's hellaswag preprocess: WikiHow's bracketed artifacts out
    text = text.strip().replace(" [title]", ". ")
    return re.sub(r"\[.*?\]", "", text).replace("  ", " ")


def _hellaswag(row: dict) -> str:
    if str(row["label"]).strip() == "":
        return ""
    ctx = row["ctx_a"] + " " + row["ctx_b"].capitalize()
    query = _hellaswag_clean(row["activity_label"] + ": " + ctx)
    return f"{query} {_hellaswag_clean(row['endings'][int(row['label'])])}"


def _openbookqa(row: dict) -> str:
    return f"{row['question_stem']} {_choice(row['choices'], row['answerKey'])}"


def _piqa(row: dict) -> str:
    if int(row["label"]) not in (0, 1):
        return ""
    return _question_answer(row["goal"], (row["sol1"], row["sol2"])[int(row["label"])])


def _sciq(row: dict) -> str:
    return f"{row['support'].lstrip()}\nQuestion: {row['question']}\nAnswer: " \
           f"{row['correct_answer']}"


def _siqa(row: dict) -> str:
    answer = (row["answerA"], row["answerB"], row["answerC"])[int(row["label"]) - 1]
    return f"Q: {row['context']} {row['question']}\nA: {answer}"


def _winogrande(row: dict) -> str:
    if str(row["answer"]).strip() not in ("1", "2"):
        return ""
    sentence = row["sentence"]
    idx = sentence.index("_")
    option = row["option1"] if str(row["answer"]).strip() == "1" else row["option2"]
    return f"{sentence[:idx]}{option} {sentence[idx + 1:].strip()}"


FORMATS: dict[str, Format] = {
    "text": Format(_text, ("text",), "{text}"),
    "wikipedia": Format(_wikipedia, ("title", "text"), "{title}\\n\\n{text}"),
    "triviaqa": Format(_triviaqa, ("question", "answer"),
                       "Question: {question}?\\nAnswer: {answer.value}"),
    "nq_open": Format(_nq_open, ("question", "answer"),
                      "Answer these questions:\\n\\nQ: {question}?\\nA: {answer[0]}"),
    "hotpotqa": Format(_hotpotqa, ("question", "answer"),
                       "Question: {question}\\nAnswer: {answer}"),
    "webqs": Format(_webqs, ("question", "answers"),
                    "Question: {question}\\nAnswer: {answers[0]}"),
    "cwq": Format(_cwq, ("question", "answers"),
                  "Question: {question}\\nAnswer: {answers[0].answer}"),
    "arc": Format(_arc, ("question", "choices", "answerKey"),
                  "Question: {question}\\nAnswer: {the answerKey choice}"),
    "hellaswag": Format(_hellaswag, ("activity_label", "ctx_a", "ctx_b", "endings", "label"),
                        "{activity_label}: {ctx_a} {ctx_b} {endings[label]} (lm-eval's "
                        "cleaning)"),
    "openbookqa": Format(_openbookqa, ("question_stem", "choices", "answerKey"),
                         "{question_stem} {the answerKey choice}"),
    "piqa": Format(_piqa, ("goal", "sol1", "sol2", "label"),
                   "Question: {goal}\\nAnswer: {sol1 or sol2, by label}"),
    "sciq": Format(_sciq, ("support", "question", "correct_answer"),
                   "{support}\\nQuestion: {question}\\nAnswer: {correct_answer}"),
    "siqa": Format(_siqa, ("context", "question", "answerA", "answerB", "answerC", "label"),
                   "Q: {context} {question}\\nA: {answer by label}"),
    "winogrande": Format(_winogrande, ("sentence", "option1", "option2", "answer"),
                         "{sentence with _ replaced by the answer's option}"),
}


def check_columns(fmt: str, columns, where: str) -> None:
    """ValueError naming the source when its rows lack a column the formatter reads."""
    missing = [c for c in FORMATS[fmt].columns if c not in columns]
    if missing:
        raise ValueError(f"{where}: no column {', '.join(map(repr, missing))} (has: "
                         f"{', '.join(columns)}); the {fmt} formatter expects the Hub schema "
                         f"of the source (moremoe data mixture --list)")


def render(fmt: str, row: dict, where: str) -> str:
    """The document of one row; ValueError naming the source and row when the row is not
    in the expected schema (a wrong type, an answer key that is not among the choices)."""
    try:
        text = FORMATS[fmt].render(row)
    except (KeyError, IndexError, ValueError, TypeError, AttributeError) as err:
        raise ValueError(f"{where}: cannot format the row as {fmt} ({type(err).__name__}: "
                         f"{err}); is it in the Hub schema of the source?") from None
    if not isinstance(text, str):
        raise ValueError(f"{where}: the {fmt} text is {type(text).__name__}, expected a string")
    return text
