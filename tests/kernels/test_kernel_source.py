"""What Triton's compiler refuses but the interpreter (the CPU suites' way of running
kernels) accepts, found in the kernels' source: a chained comparison (`a == b == c`) in a
@triton.jit function compiled on a GPU as "simultaneous multiple comparison is not
supported" (84 GPU tests failed at e3866a8 that had passed here)."""
import ast
from pathlib import Path

import pytest

KERNELS = sorted((Path(__file__).parents[2] / "src" / "moremoe" / "kernels").glob("*.py"))


def _jit_functions(tree: ast.Module):
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and any(
                "jit" in ast.unparse(d) for d in node.decorator_list):
            yield node


def _chained(tree: ast.Module) -> list[ast.Compare]:
    """The chained comparisons inside the tree's @triton.jit functions."""
    return [node for fn in _jit_functions(tree) for node in ast.walk(fn)
            if isinstance(node, ast.Compare) and len(node.ops) > 1]


@pytest.mark.parametrize("path", KERNELS, ids=lambda p: p.name)
def test_no_chained_comparison_in_a_jit_function(path):
    found = [f"{path.name}:{node.lineno} {ast.unparse(node)}"
             for node in _chained(ast.parse(path.read_text()))]
    assert not found, "chained comparisons Triton will not compile: " + "; ".join(found)


def test_the_check_finds_one_in_a_jit_function_only():
    src = "def g(C, K):\n    return C == K == 4\n"
    assert _chained(ast.parse(src)) == []                      # plain Python may chain
    assert len(_chained(ast.parse("@triton.jit\n" + src))) == 1
