"""benchmarks/router_sass.py: loops found by their backward branches, counted by opcode."""
import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("triton")
PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "router_sass.py"
spec = importlib.util.spec_from_file_location("router_sass", PATH)
sass = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sass)

LISTING = """
        /*0000*/                   LDC R1, c[0x0][0x28] ;
.L_x_0:
        /*0010*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], RZ ;
        /*0020*/                   FMNMX R2, R3, R4, !PT ;
        /*0030*/              @!P0 FMNMX R2, R2, R5, !PT ;
        /*0040*/               @P1 BRA `(.L_x_0) ;
        /*0050*/                   STG.E [R6.64], R2 ;
.L_x_1:
        /*0060*/                   SHFL.BFLY PT, R7, R2, 0x1, 0x1f ;
        /*0070*/                   BRA `(.L_x_1) ;
        /*0080*/                   BRA `(.L_x_2) ;
.L_x_2:
        /*0090*/                   EXIT ;
"""


def test_each_backward_branch_is_a_loop_with_its_opcodes():
    loops = sass.loops(LISTING)
    assert [(lp["start"], lp["end"], lp["instructions"], lp["hgmma"]) for lp in loops] == [
        (0x10, 0x40, 4, 1), (0x60, 0x70, 2, 0)]        # a forward branch is no loop
    assert dict(loops[0]["top"])["FMNMX"] == 2          # predicated ones counted too


def test_k_out_of_range_is_one_line(capsys):
    with pytest.raises(SystemExit) as e:
        sass.main(["--k", "9"])
    assert e.value.code == 2
    assert "--k must be in [1, 8], got 9" in capsys.readouterr().err
