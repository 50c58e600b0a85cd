"""`moremoe plot` and RUN/loss.png from synthetic logs: the panels' data, a cut line
skipped, and the one-line errors."""
import json

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
