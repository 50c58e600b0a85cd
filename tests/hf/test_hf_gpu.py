"""GPU: an exported model under transformers' static cache, which generate() compiles on a GPU
(torch.compile, CUDA graphs), gives moremoe's own greedy tokens (`pytest -m gpu`)."""
import pytest
import torch

transformers = pytest.importorskip("transformers")

from moremoe.hf import export, register  # noqa: E402
from moremoe.model import Transformer, TransformerConfig, generate  # noqa: E402
from moremoe.nn import MoEConfig  # noqa: E402

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_compiled_static_cache_generate_equals_ours(tmp_path):
    from torch._dynamo.utils import counters
    cfg = TransformerConfig(vocab=1000, layers=2, heads=4, kv_heads=2,
                            moe=MoEConfig.more(256, 4, 128, 32, 16), max_seq_len=128)
    model = Transformer(cfg).cuda().eval()
    register()
    export(model, tmp_path / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").cuda().eval()
    prompt = torch.randint(0, 1000, (4, 12), device="cuda")
    graphs = counters["stats"]["unique_graphs"]
    out = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=20,
                      do_sample=False, cache_implementation="static")
    assert counters["stats"]["unique_graphs"] > graphs          # transformers compiled it
    assert out[:, 12:].tolist() == generate(model, prompt, 20)
