"""`moremoe train --lr-grid`: a short run per rate, the lowest validation loss chosen, the
choice recorded, and finished candidates read back instead of trained again."""
import json

from cli_checks import fails
from moremoe.cli import main
from runs import SMALL

GRID = ["--preset", "tiny-moe", "--device", "cpu", "--max-steps", "12",
        *[a for s in SMALL if not s.startswith("train.max_steps") for a in ("--set", s)]]


def test_lr_grid_picks_the_lowest_validation_loss(capsys, text_data, tmp_path):
    out = tmp_path / "run"
    argv = ["train", *GRID, "--data", str(text_data), "--out", str(out),
            "--lr-grid", "1e-5,3e-3", "--grid-steps", "6", "--json"]
    assert main(argv) == 0
    summary = json.loads(capsys.readouterr().out)
    grid = json.loads((out / "lr_grid.json").read_text())
    losses = {c["lr"]: c["val_loss"] for c in grid["candidates"]}
    assert grid["lr"] == min(losses, key=losses.get) == 3e-3     # 1e-5 barely moves
    assert json.loads((out / "config.json").read_text())["optim"]["lr"] == 3e-3
    assert summary["step"] == 12
    for c in grid["candidates"]:
        assert json.loads((tmp_path / "run" / "lr-grid" / f"lr_{c['lr']:g}" /
                           "summary.json").read_text())["step"] == 6
    # a second job reads the finished candidates back: their logs are not rewritten
    log = out / "lr-grid" / "lr_0.003" / "log.jsonl"
    before = log.stat().st_mtime_ns
    assert main(argv[:-1] + ["--force"]) == 0
    capsys.readouterr()
    assert log.stat().st_mtime_ns == before


def test_lr_grid_needs_grid_steps(capsys, text_data, tmp_path):
    fails(capsys, ["train", *GRID, "--data", str(text_data), "--out", str(tmp_path / "r"),
                   "--lr-grid", "1e-3"], r"--lr-grid needs --grid-steps N")
