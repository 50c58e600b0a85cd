"""Fixtures of the pretraining tests: one thread, and the uninterrupted reference run."""
import pytest
import torch

from runs import SMALL, quiet


@pytest.fixture
def one_thread():
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="session")
def reference_run(text_data, tmp_path_factory):
    """The uninterrupted tiny-more run every interrupted one is compared with."""
    from moremoe.training.compose import build_run_config
    from moremoe.training.lm import train
    out = tmp_path_factory.mktemp("ref") / "run"
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        train(build_run_config(preset="tiny-more", data=str(text_data), out=str(out),
                               device="cpu", overrides=SMALL), echo=quiet)
    finally:
        torch.set_num_threads(old)
    return out
