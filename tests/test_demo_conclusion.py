"""The demo's verdict is a capacity comparison that holds on 3 seeds and at 1 and 2 threads:
MoRE-112 memorises the 1,024-entry phonebook (exact match 0.9 within the 800-epoch limit)
and MoE-32 does not, with room on both sides. About 3 minutes a case on a 2-core CPU, so not
in `make test`: `make test-demo` (marker demo; -s prints each case's numbers)."""
import pytest
import torch

from moremoe.cli.demo import DemoConfig, run_demo, verdict


@pytest.mark.demo
@pytest.mark.parametrize("threads", [2, 1])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_more_memorises_the_phonebook_and_moe_does_not(tmp_path, seed, threads):
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        result = run_demo(DemoConfig(seed=seed, device="cpu"), out_dir=tmp_path,
                          progress=False)
    finally:
        torch.set_num_threads(old)
    moe, more = result["runs"]
    print(f"\nseed {seed}, {threads} threads: " + "; ".join(
        f"{r['name']} exact match {r['exact_match']:.3f} after {r['history'][-1]['epoch']:.0f} "
        f"epochs, {r['seconds']:.0f} s" for r in (moe, more)))
    assert (moe["name"], more["name"]) == ("MoE-32", "MoRE-112")
    assert more["reached"] and more["history"][-1]["epoch"] <= 700     # 100 epochs to spare
    assert not moe["reached"] and moe["exact_match"] < 0.7             # well short of 0.9
    assert verdict(result).endswith("MoRE-112 memorises more.")
