"""`moremoe plot` and RUN/loss.png from synthetic logs: the panels' data, a cut line
skipped, and the one-line errors."""
import json

import pytest

from cli_checks import fails
from moremoe.cli import main
from moremoe.training.run_plot import read_events, refresh


def _run(path, scale):
    path.mkdir()
    rows = [{"event": "train", "step": s, "loss": scale * 5 / s, "lr": 1e-3, "router_lr": 3e-3,
             "aux_loss": 0.01} for s in range(1, 40)]
    rows += [{"event": "eval", "step": s, "val_loss": scale * 6 / s, "hnorm": [0.9, 0.8]}
             for s in (10, 20, 30)]
    (path / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"event": "tr')
    return path


def test_plot_overlays_runs_and_skips_a_cut_line(capsys, tmp_path):
    a, b = _run(tmp_path / "moe", 1.0), _run(tmp_path / "more", 0.8)
    assert len(read_events(a)) == 42                       # the torn last line is skipped
    assert refresh(a) is None and (a / "loss.png").stat().st_size > 20_000
    out = tmp_path / "pair.png"
    assert main(["plot", str(a), str(b), "--out", str(out), "--names", "MoE,MoRE",
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["last_step"] == {"MoE": 39, "MoRE": 39}
    assert out.stat().st_size > 20_000
    fails(capsys, ["plot", str(a), "--out", str(out)], r"--out .*pair.png exists; .*--force")
    fails(capsys, ["plot", str(a), str(b), "--out", str(tmp_path / "x.png"), "--names", "one"],
          r"--names gives 1 names for 2 runs")
    fails(capsys, ["plot", str(tmp_path), "--out", str(tmp_path / "y.png")],
          r"no log.jsonl \(not a `moremoe train` run directory\)")


def test_refresh_reports_instead_of_raising(tmp_path):
    assert "no log.jsonl" in refresh(tmp_path / "missing")


@pytest.mark.parametrize("line, match", [
    ("null", r"line 2: expected a JSON object \(one event\), got null"),
    ('[1, 2]', r"line 2: expected a JSON object \(one event\), got \[1, 2\]"),
    ('{"event": "eval", "step": 1, "val_loss": 2.1, "hnorm": 0.5}',
     r"line 2: hnorm must be a list of numbers \(H_norm per layer\) or null, got 0.5$"),
    ('{"event": "eval", "step": 1, "hnorm": [0.5, "x"]}', r"line 2: hnorm must be a list"),
    ('{"event": "eval", "step": 1, "hnorm": [0.5]}',
     r"line 2: hnorm has 1 layers where line 1 has 2; one log holds one model"),
    ('{"event": "train", "step": "x", "loss": 1}',
     r"line 2: step must be an integer >= 0, got \"x\"$"),
    ('{"event": "train", "step": 2.5}', r"line 2: step must be an integer >= 0, got 2.5$"),
    ('{"event": "train", "step": true}', r"line 2: step must be an integer >= 0, got true$"),
    ('{"event": "train", "step": 2, "lr": "fast"}',
     r"line 2: lr must be a number or null, got \"fast\"$"),
])
def test_plot_names_the_line_and_field_and_writes_nothing(capsys, tmp_path, line, match):
    run = tmp_path / "run"
    run.mkdir()
    first = {"event": "eval", "step": 1, "val_loss": 2.0, "hnorm": [0.9, 0.8]}
    later = {"event": "train", "step": 3, "loss": 1.0}
    (run / "log.jsonl").write_text("\n".join([json.dumps(first), line, json.dumps(later)]))
    out = tmp_path / "plot.png"
    fails(capsys, ["plot", str(run), "--out", str(out)], rf"{run / 'log.jsonl'}, {match}")
    assert not out.exists()
    assert "line 2" in refresh(run) and not (run / "loss.png").exists()   # training goes on


def test_plot_skips_only_a_cut_last_line_and_draws_nulls(capsys, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    rows = [{"event": "train", "step": 1, "loss": None, "router_lr": None},
            {"event": "eval", "step": 2, "val_loss": None, "hnorm": None},
            {"event": "end", "step": 2, "stopped": "max_steps", "hnorm": []}]
    (run / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 3')
    out = tmp_path / "plot.png"
    assert main(["plot", str(run), "--out", str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["last_step"] == {"run": 2} and out.exists()
