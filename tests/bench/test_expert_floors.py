"""The expert rows' two floors: expert_cost's (each input read once, each output written
once) and expert_design_bytes' (our kernels' dataflow, with the deterministic combine's
pair rows), counted by hand at a small point."""
from moremoe.bench.layer import LayerPoint, expert_cost, expert_design_bytes


def test_the_design_bytes_counted_by_hand():
    p = LayerPoint(8, 3, s=2, k=2, N=5)           # P = 10 pairs, weights 3 * 3 * 8 * 2 = 144
    fwd, bwd = expert_design_bytes(p)
    # forward: x per pair 80 + pair rows 80 + the combine's read 80 + y 40 + weights 144
    assert fwd == 2 * (80 + 80 + 80 + 40 + 144)
    # backward: five (P, h) passes 400, ten (P, s) 200, dx 40, weights 144; fp32 dW 4 * 144
    assert bwd == 2 * (400 + 200 + 40 + 144) + 4 * 144


def test_the_design_moves_more_than_the_layer_floor():
    for k in (1, 2, 4, 8):
        p = LayerPoint(512, 256, s=64, k=k, N=65536)
        _, layer_fwd, layer_bwd = expert_cost(p)
        fwd, bwd = expert_design_bytes(p)
        assert fwd > layer_fwd and bwd > layer_bwd
    # at the presets' k = 4 the design's forward moves 5x the layer's floor bytes: 3 k + 1
    # rows of h a token (and the weights) against 2
    p = LayerPoint(512, 256, s=64, k=4, N=65536)
    assert 4.8 < expert_design_bytes(p)[0] / expert_cost(p)[1] < 5.2
