"""`moremoe bench phonebook --points`: the pairs of the paper's points, and the arithmetic of a
whole trial from the loop's time a step (what a window of the GPU can hold)."""
from moremoe.phonebook import bench


def test_points_time_both_models_of_each_pair():
    models = bench._models(False, ["h256-s8", "h64-s32"])
    assert list(models) == ["h256-s8 MoE-32", "h256-s8 MoRE-384", "h64-s32 MoE-128",
                            "h64-s32 MoRE-480"]
    assert (models["h256-s8 MoRE-384"].hidden, models["h256-s8 MoRE-384"].rank) == (256, 16)
    assert bench._models(False, None) is bench.MODELS


def test_a_trial_costs_its_steps_at_the_loops_time():
    # MoRE-384's capacity in the paper is 300K, the grid's next size 400K: 1,500 epochs of
    # 300,000 / 1,024 steps (439,454) and of 400,000 / 1,024 (585,938) at 10 ms a step
    got = bench.trial_minutes("h256-s8 MoRE-384", 10.0)
    assert got == {"300000": 439_454 * 10 / 6e4, "400000": 585_938 * 10 / 6e4}
    assert bench.trial_minutes("h256-s8 MoE-32", 10.0).keys() == {"100000", "150000"}
    assert bench.trial_minutes("MoE-32", 10.0) == {}        # not a point's model


def test_kernels_are_counted_from_the_devices_records_with_copies_apart():
    from types import SimpleNamespace as E

    import torch
    from torch.autograd import DeviceType
    cuda, cpu = DeviceType.CUDA, DeviceType.CPU
    events = [E(name="void gemm_kernel<...>", device_type=cuda),
              E(name="triton_poi_fused_add_0", device_type=cuda),
              E(name="Memset (Device)", device_type=cuda),
              E(name="Memcpy DtoD (Device -> Device)", device_type=cuda),
              E(name="aten::mm", device_type=cpu), E(name="cudaLaunchKernel", device_type=cpu)]
    assert bench.count_kernel_events(events) == {"kernels": 2, "copies": 2}
    events += [E(name="triton_poi_fused_add_0", device_type=cuda)]
    assert bench.count_kernel_events(events, top=1) == {
        "kernels": 3, "copies": 2, "top_kernels": [["triton_poi_fused_add_0", 2]]}
    assert bench.kernels_a_step(None, torch.device("cpu")) == {}     # nothing to count


def test_the_table_shows_kernels_where_a_row_counted_them():
    rows = [{"model": "MoE-32", "variant": "graph", "ms": 4.1, "steps_per_s": 244.0,
             "kernels": 612.0},
            {"model": "MoE-32", "variant": "eager", "ms": 9.0, "steps_per_s": 111.0}]
    lines = bench.phonebook_table(rows).splitlines()
    assert "kernels a step" in lines[0]
    assert "612" in lines[2] and "612" not in lines[3]
