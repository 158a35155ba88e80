"""kernels.bench.compile_sm90 --sass: the loop opcode counts read off nvdisasm's text (no GPU, no compile)."""

from kernels.bench.compile_sm90 import _loop_opcodes

SASS = """
        /*0000*/                   LDC R1, c[0x0][0x28] ;
.L_x_1:
        /*0010*/                   LDG.E.128 R4, desc[UR4][R2.64] ;
        /*0020*/                   HMMA.16816.F32.BF16 R8, R4, R12, R8 ;
        /*0030*/              @!P0 LOP3.LUT R5, R4, 0xf, RZ, 0xc0, !PT ;
        /*0040*/                   HMMA.16816.F32.BF16 R8, R4, R14, R8 ;
        /*0050*/               @P1 BRA `(.L_x_1) ;
.L_x_2:
        /*0060*/                   STG.E desc[UR4][R2.64], R8 ;
        /*0070*/                   BRA `(.L_x_3) ;
.L_x_3:
        /*0080*/                   EXIT ;
"""


def test_counts_the_opcodes_of_each_backward_branch_only():
    loops = _loop_opcodes(SASS)
    assert len(loops) == 1, "the forward branch to .L_x_3 is not a loop"
    assert loops[0] == {"LDG": 1, "HMMA": 2, "LOP3": 1, "BRA": 1}
