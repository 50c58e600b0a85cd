"""convert-router on small random models of each architecture (offline): every router is
found, full rank reproduces the top-k sets, the factors multiply back to the weights, and
the command writes its factors, report and plot without overwriting a folder."""
import json
import math

import pytest
import torch

transformers = pytest.importorskip("transformers")
from cli_checks import fails  # noqa: E402
from moremoe.cli import main  # noqa: E402

COMMON = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=100)
ARCHS = {
    "Qwen3MoeConfig": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16),
    "OlmoeConfig": dict(num_experts=8, num_experts_per_tok=2),
    "MixtralConfig": dict(num_local_experts=8, num_experts_per_tok=2),
    "DeepseekV3Config": dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                             n_group=1, topk_group=1, first_k_dense_replace=0, q_lora_rank=16,
                             kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
                             v_head_dim=8, num_key_value_heads=4),   # MLA: kv heads = heads
}


def _save(tmp_path, arch):
    if not hasattr(transformers, arch):
        pytest.skip(f"transformers {transformers.__version__} has no {arch}")
    torch.manual_seed(0)
    cfg = getattr(transformers, arch)(**{**COMMON, **ARCHS[arch]})
    cfg.eos_token_id = cfg.bos_token_id = cfg.pad_token_id = None
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    path = tmp_path / arch
    model.save_pretrained(path)
    return path


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_convert_router_each_architecture(capsys, tmp_path, arch):
    model = _save(tmp_path, arch)
    out = tmp_path / "out"
    assert main(["convert-router", str(model), "--rank", "2,8", "--out", str(out),
                 "--random-tokens", "512", "--seq-len", "64", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["top_k"] == 2 and len(report["layers"]) == 2
    for layer in report["layers"]:
        assert layer["tokens"] == 512 and [r["rank"] for r in layer["ranks"]] == [2, 8]
        full = layer["ranks"][1]                     # r = 8 = E: the factors are exact
        assert full["set_agreement"] == 1.0 and full["rel_error"] < 1e-5
    from safetensors.torch import load_file
    factors = load_file(str(out / "routers_r2.safetensors"))
    first, last = report["layers"][0]["layer"], report["layers"][1]["layer"]
    assert first.startswith("model.layers.0.") and last.startswith("model.layers.1.")
    assert factors[f"{first}.R1"].shape == (8, 2) and factors[f"{last}.R2"].shape == (2, 32)
    assert (out / "agreement.png").stat().st_size > 10_000
    assert json.loads((out / "report.json").read_text())["layers"] == report["layers"]
    fails(capsys, ["convert-router", str(model), "--rank", "2", "--out", str(out)],
          r"--out .* is not empty; give a new folder or --force")


def test_convert_router_errors(capsys, tmp_path):
    fails(capsys, ["convert-router", str(tmp_path / "nope"), "--rank", "2", "--out",
                   str(tmp_path / "o")], r"not a transformers model folder \(no config.json\)")
    model = _save(tmp_path, "MixtralConfig")
    fails(capsys, ["convert-router", str(model), "--rank", "40", "--out", str(tmp_path / "o2"),
                   "--random-tokens", "64", "--seq-len", "32"],
          r"--rank 40 exceeds min\(experts, hidden\) = 8 of the model")
    fails(capsys, ["convert-router", str(model), "--rank", "2", "--out", str(tmp_path / "o3"),
                   "--text", str(tmp_path / "missing.txt")], r"--text .*missing.txt: no such file")
    fails(capsys, ["convert-router", str(model), "--rank", "2", "--out", str(tmp_path / "o4"),
                   "--text", str(tmp_path)], r"--text \S+: is a folder, not a file; give a text "
                                             r"file")


def test_low_rank_router_from_a_trained_weight():
    from moremoe.nn import LowRankRouter
    W = torch.randn(16, 12)
    router = LowRankRouter.from_weight(W, 2, 12, impl="reference")
    torch.testing.assert_close(router.R1 @ router.R2, W, rtol=1e-5, atol=1e-5)
    assert router.rank == 12 and router.experts == 16 and router.hidden == 12


def test_convert_router_reads_text_through_the_models_tokenizer(capsys, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    model = _save(tmp_path, "OlmoeConfig")
    vocab = {"[UNK]": 0, **{f"w{i}": i for i in range(1, 100)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(
        model)
    text = tmp_path / "text.txt"
    text.write_text(" ".join(f"w{(7 * i) % 99 + 1}" for i in range(300)))
    assert main(["convert-router", str(model), "--rank", "4", "--out", str(tmp_path / "o"),
                 "--text", str(text), "--seq-len", "50", "--write-model",
                 str(tmp_path / "w"), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["tokens"] == 300 and report["layers"][0]["tokens"] == 300
    # the converted model carries the source's tokenizer: it reads the same text alike
    written = transformers.AutoTokenizer.from_pretrained(tmp_path / "w")
    assert written(text.read_text()).input_ids == transformers.AutoTokenizer.from_pretrained(
        model)(text.read_text()).input_ids


@pytest.mark.parametrize("arch", ["Qwen3MoeConfig", "OlmoeConfig", "MixtralConfig"])
def test_write_model_routes_with_the_factors_and_reports_the_loss(capsys, tmp_path, arch):
    """--write-model: the source architecture, loadable by AutoModelForCausalLM, whose gates
    are R1 R2 of the factors written beside the report; the loss before and after is the
    loss of the source and of the written model on the same tokens."""
    from safetensors.torch import load_file

    from moremoe.hf.convert_router import find_routers, lm_loss
    model = _save(tmp_path, arch)
    out, written = tmp_path / "out", tmp_path / "converted"
    assert main(["convert-router", str(model), "--rank", "2", "--out", str(out),
                 "--write-model", str(written), "--random-tokens", "256", "--seq-len", "32",
                 "--json"]) == 0
    report = json.loads(capsys.readouterr().out)["model_written"]
    assert report["rank"] == 2 and report["routers"] == 2
    source = transformers.AutoModelForCausalLM.from_pretrained(model)
    converted = transformers.AutoModelForCausalLM.from_pretrained(written)
    assert type(converted) is type(source)
    assert converted.config.moremoe_router_factors["rank"] == 2
    factors = load_file(str(out / "routers_r2.safetensors"))
    for name, weight in find_routers(converted):
        torch.testing.assert_close(weight, factors[f"{name}.R1"] @ factors[f"{name}.R2"],
                                   rtol=1e-5, atol=1e-6)
        assert torch.linalg.matrix_rank(weight.double(), rtol=1e-5) == 2   # fp32 rounding
    g = torch.Generator().manual_seed(0)                 # the command's random tokens
    ids = torch.randint(0, source.config.vocab_size, (8, 32), generator=g)
    assert report["loss"] == pytest.approx(lm_loss(source, ids), rel=1e-5)
    assert report["loss_converted"] == pytest.approx(lm_loss(converted, ids), rel=1e-5)
    assert report["loss_converted"] != report["loss"]
    assert report["perplexity_converted"] == pytest.approx(math.exp(report["loss_converted"]))


def test_write_model_mistakes(capsys, tmp_path):
    model = _save(tmp_path, "MixtralConfig")
    base = ["convert-router", str(model), "--out", str(tmp_path / "o"), "--random-tokens", "64",
            "--seq-len", "32"]
    fails(capsys, base + ["--rank", "2,4", "--write-model", str(tmp_path / "w")],
          r"--write-model writes one converted model: give one --rank, got 2,4")
    fails(capsys, base + ["--rank", "2", "--write-model", str(model), "--force"],
          r"--write-model .* is MODEL: write the converted model to a folder of its own")
    (tmp_path / "w").mkdir()
    (tmp_path / "w" / "mine.txt").write_text("mine")
    fails(capsys, base + ["--rank", "2", "--write-model", str(tmp_path / "w")],
          r"--write-model .* is not empty")
