import os

import torch

# Without a GPU the Triton kernels are tested in Triton's CPU interpreter; this must be set
# before triton is first imported. On the device machine (`pytest -m gpu`) they compile.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# tests never download: lm-eval's tasks read local fixtures (tests/eval/fixtures)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
# CPU compiles without inductor's precompiled C++ header: 130-155 MB a venv and ISA in the
# shared /tmp/torchinductor_<user>, and parallel workers building one header raced
# ("at::vec has not been declared"); the compiled tests take the same time without it
try:
    import torch._inductor.config as _inductor_config
    if hasattr(_inductor_config, "cpp_cache_precompile_headers"):
        _inductor_config.cpp_cache_precompile_headers = False
except ImportError:
    pass

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


def _position_independent_dot():
    """A GPU's tensor cores compute every element of a tl.dot the same way, so equal rows
    and columns give equal logits wherever they sit in a tile, and the routers' exact
    selection breaks such ties by index. The interpreter's np.matmul in fp32 can round the
    same dot product differently at different positions (numpy's SIMD blocking, which
    changes with the numpy version): here float dots are summed in fp64 and rounded once to
    the accumulator's dtype, the same value wherever it sits (and within fp32's error of the
    GPU's sums, as the tests' tolerances expect)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    builder = getattr(interpreter, "InterpreterBuilder", None)
    handle = getattr(interpreter, "TensorHandle", None)
    if builder is None or handle is None or not hasattr(builder, "create_dot"):
        return
    fast = builder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        out = d.data.dtype
        if not (np.issubdtype(a.data.dtype, np.floating) and np.issubdtype(b.data.dtype,
                                                                            np.floating)
                and out == np.float32 and a.dtype.primitive_bitwidth > 8):
            return fast(self, a, b, d, input_precision, max_num_imprecise_acc)
        prod = np.matmul(a.data.astype(np.float64), b.data.astype(np.float64)).astype(out)
        return handle(prod + d.data, d.dtype.scalar)
    builder.create_dot = create_dot


_position_independent_dot()


def _a_share_of_the_cores_a_worker():
    """Under pytest-xdist each worker gives torch's intra-op threads its share of the cores
    (unless OMP_NUM_THREADS says otherwise): two workers of two threads on two cores
    contend (the two longest tests side by side: 129 s, against 114 s at a thread each)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
    if workers > 1 and "OMP_NUM_THREADS" not in os.environ:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else \
            (os.cpu_count() or 1)
        torch.set_num_threads(max(1, cores // workers))


_a_share_of_the_cores_a_worker()


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
