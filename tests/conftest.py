import os

import torch

# Without a GPU the Triton kernels are tested in Triton's CPU interpreter; this must be set
# before triton is first imported. On the device machine (`pytest -m gpu`) they compile.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# tests never download: lm-eval's tasks read local fixtures (tests/eval/fixtures)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402


def _vectorise_the_interpreters_xor_sum():
    """tl.sort's bitonic network reduces with xor, which Triton's CPU interpreter runs
    element by element in Python (it vectorises only sum, min, max and argmin/argmax): a
    third of the suite's interpreter time. Here xor is one numpy reduction, the same
    integers. A Triton without these internals keeps its own way."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return
    ops, xor = getattr(interpreter, "ReduceOps", None), getattr(tl.standard, "_xor_combine", None)
    if ops is None or xor is None or not hasattr(ops, "apply_impl"):
        return
    slow = ops.apply_impl

    def apply_impl(self, input):
        x = input[0] if isinstance(input, (tuple, list)) else input
        if self.combine_fn is not xor or getattr(self, "axis", None) is None:
            return slow(self, input)
        got = np.bitwise_xor.reduce(x.handle.data, axis=self.axis, keepdims=self.keep_dims)
        return self.to_tensor(got, x.dtype)
    ops.apply_impl = apply_impl


_vectorise_the_interpreters_xor_sum()


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    # the interpreter evaluates -inf - (-inf) on padded rows; those lanes are masked
    with np.errstate(invalid="ignore", over="ignore"):
        yield
    if torch.cuda.is_available():       # each GPU test starts with the memory the last freed
        import gc
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


@pytest.fixture
def lm_eval_tasks(tmp_path):
    """A folder of lm-eval task YAMLs that include the installed tasks and read the local
    fixtures (tests/eval/fixtures): pass it as include_path / --include-path."""
    import string
    from pathlib import Path
    lm_eval = pytest.importorskip("lm_eval")
    pytest.importorskip("datasets")
    fixtures = (Path(__file__).parent / "eval" / "fixtures").resolve()
    out = tmp_path / "lm_eval_tasks"
    out.mkdir()
    installed = Path(lm_eval.__file__).parent / "tasks"
    for template in (fixtures / "tasks").glob("*_fixture.yaml"):
        (out / template.name).write_text(string.Template(template.read_text()).substitute(
            LM_EVAL_TASKS=installed, FIXTURES=fixtures))
    return out


@pytest.fixture(scope="session")
def text_data(tmp_path_factory):
    """A prepared directory of real prose, byte-level (tests/prepared.py)."""
    from prepared import write_token_dir
    return write_token_dir(tmp_path_factory.mktemp("tokens"))


@pytest.fixture(scope="session")
def gpt2_text_data(tmp_path_factory):
    """The same prose through the GPT-2 tokenizer (vocab 50,257; tests/prepared.py)."""
    from prepared import write_token_dir
    return write_token_dir(tmp_path_factory.mktemp("gpt2_tokens"), gpt2=True)


@pytest.fixture(scope="session")
def gpt2_run(gpt2_text_data, tmp_path_factory):
    """A tiny run on GPT-2 tokens (what `moremoe generate` and the export's tokenizer need)."""
    from prepared import train_tiny_run
    return train_tiny_run(gpt2_text_data, tmp_path_factory.mktemp("gpt2_run") / "run")
