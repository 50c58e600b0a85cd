"""`moremoe bench <name> --plot-only FILE` draws only its own benchmark's rows: another
benchmark's rows, rows no benchmark wrote or an empty file are one-line errors naming the
file (and the benchmark the rows belong to), and a run never appends to another benchmark's
file. `moremoe bench --help` lists each benchmark with its whole one-line summary."""
import json
import re

import pytest

from moremoe.cli import main
from cli_checks import fails

BENCHES = ("router", "layer", "decode", "experts", "model", "peer", "ep")


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("name", BENCHES)
def test_rows_of_another_benchmark_are_refused(capsys, tmp_path, name):
    other = "layer" if name != "layer" else "peer"
    path = _write(tmp_path / f"{other}.jsonl",
                  [{"bench": other, "variant": "more_fused", "h": 512, "M": 64, "ms": 1.0}])
    err = fails(capsys, ["bench", name, "--plot-only", str(path)],
                rf"--plot-only \S*{other}.jsonl: not rows of `moremoe bench {name}`; "
                rf"they are rows of `moremoe bench {other}`")
    assert f"moremoe bench {name}: error" in err
    assert not list(tmp_path.glob("*.png"))


@pytest.mark.parametrize("name", BENCHES)
def test_an_empty_file_is_refused(capsys, tmp_path, name):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n")
    fails(capsys, ["bench", name, "--plot-only", str(path)],
          rf"empty.jsonl: the file holds no rows; expected rows of `moremoe bench {name}`")


def test_rows_no_benchmark_wrote_are_refused(capsys, tmp_path):
    path = _write(tmp_path / "probe.jsonl", [{"what": "psum", "ms": 1.3}, {"bench": "peer"}])
    fails(capsys, ["bench", "peer", "--plot-only", str(path)],
          r"probe.jsonl: not rows of `moremoe bench peer`; 1 of its 2 rows have no \"bench\"")


def test_mixed_rows_name_every_other_benchmark(capsys, tmp_path):
    path = _write(tmp_path / "mixed.jsonl", [{"bench": "peer"}, {"bench": "model"},
                                             {"bench": "layer"}])
    fails(capsys, ["bench", "peer", "--plot-only", str(path)],
          r"they are rows of `moremoe bench layer` and `moremoe bench model`$")


def test_experts_says_it_draws_no_plots(capsys, tmp_path):
    path = _write(tmp_path / "experts.jsonl", [{"bench": "experts", "ms": 1.0}])
    fails(capsys, ["bench", "experts", "--plot-only", str(path)],
          r"`moremoe bench experts` draws no plots")


def test_own_rows_with_nothing_to_draw_are_an_error(capsys, tmp_path):
    path = _write(tmp_path / "router.jsonl", [{"bench": "router", "sweep": "tune",
                                               "phase": "inference", "ms": 1.0}])
    fails(capsys, ["bench", "router", "--plot-only", str(path)],
          r"router.jsonl: nothing to plot in its 1 rows of `moremoe bench router`")


def test_a_run_never_appends_to_another_benchmarks_file(capsys, tmp_path):
    rows = [{"bench": "layer", "variant": "more_fused", "ms": 1.0}]
    path = _write(tmp_path / "layer.jsonl", rows)
    fails(capsys, ["bench", "peer", "--quick", "--out", str(path)],
          r"--out \S*layer.jsonl: not rows of `moremoe bench peer`; they are rows of "
          r"`moremoe bench layer`")
    assert [json.loads(line) for line in path.read_text().splitlines()] == rows


def test_bench_help_lists_each_benchmark_with_its_whole_summary(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    out = capsys.readouterr().out
    entries = dict(re.findall(r"^    (\w+) +(.+)$", out, flags=re.M))
    assert set(entries) == set(BENCHES)
    for name, summary in entries.items():
        with pytest.raises(SystemExit):
            main(["bench", name, "--help"])
        page = " ".join(capsys.readouterr().out.split())
        assert f"{summary}: " in page, (name, summary)       # the description, not a piece
        assert summary.count("{") == summary.count("}"), summary
        assert summary.count("(") == summary.count(")"), summary
    assert entries["decode"] == "one layer's decode step at B in {4, 16, 64, 256} over h x M"


def _decode_row(M, ms, commit):
    return {"bench": "decode", "variant": "more_fused", "h": 512, "M": M, "B": 4, "ms": ms,
            "commit": commit}


def _router_row(k, ms, commit):
    return {"bench": "router", "sweep": "k", "phase": "inference", "router": "lowrank",
            "impl": "triton", "h": 512, "M": 8192, "k": k, "ms": ms, "commit": commit}


@pytest.mark.parametrize("module,render,row", [("layer_plots", "render_decode", _decode_row),
                                               ("router_plots", "render", _router_row)])
def test_plots_draw_the_newest_row_of_each_point(monkeypatch, tmp_path, module, render, row):
    """A results file collects every run's rows: a line shows each point once, the newest."""
    import importlib
    mod = importlib.import_module(f"moremoe.bench.{module}")
    figs = []
    monkeypatch.setattr(mod, "save_figure", lambda fig, path: figs.append(fig))
    rows = [row(x, 1.0, "old") for x in (1, 2, 4)] + [row(x, 2.0, "new") for x in (1, 2, 4)]
    getattr(mod, render)(rows, tmp_path)
    (line,) = [ln for fig in figs for ax in fig.axes for ln in ax.get_lines()]
    assert list(line.get_xdata()) == [1, 2, 4]
    assert list(line.get_ydata()) == [2.0, 2.0, 2.0]


def test_the_router_figure_of_a_run_without_training_says_so(monkeypatch, tmp_path, recwarn):
    """`bench router --no-training`: the training panels hold no line; they say they were not
    measured, and no legend of nothing is asked for (matplotlib warned on every such run)."""
    from moremoe.bench import router_plots
    figs = []
    monkeypatch.setattr(router_plots, "save_figure", lambda fig, path: figs.append(fig))
    rows = [{**_router_row(1, 1.0, "c"), "sweep": "M", "M": m, "h": h}
            for m in (512, 1024) for h in (512, 2048)]
    router_plots.render(rows, tmp_path)
    (fig,) = figs
    texts = [t.get_text() for ax in fig.axes for t in ax.texts]
    assert texts.count("not measured in this run") == 4        # training time and memory
    assert not [w for w in recwarn if "No artists with labels" in str(w.message)]
