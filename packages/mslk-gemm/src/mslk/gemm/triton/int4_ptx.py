"""The PTX that turns packed int4 nibbles into bf16 pairs, shared by the INT4 GEMMs' Triton kernels (int4_gemm.py)
and their Gluon kernels for Hopper (int4_hopper.py, int4_decode_hopper.py)."""

import triton.language as tl

# A bf16 pair (int32) of q · s + z for the nibbles at bits 0-3 and 16-19 of $1 (other bits ignored): the magic
# 0x4300 | (nibble ^ 8) is the bf16 136 + q, an exact FMA takes 136 off, then one FMA by ($2, $3) = bf16x2 (s, z).
DEQUANT_PTX = tl.constexpr("""{
.reg .b32 v, one, bias;
mov.b32 one, 0x3F803F80;
mov.b32 bias, 0xC308C308;
lop3.b32 v, $1, 0x000F000F, 0x43084308, 0x6a;
fma.rn.bf16x2 v, v, one, bias;
fma.rn.bf16x2 $0, v, $2, $3;
}""")


def _bytes_ptx(scaled: bool) -> str:
    """DEQUANT_PTX for four bytes of the plain layout at once ($4; byte j holds k = 2j low, 2j + 1 high): a PRMT
    puts byte j at bits 0-7 and byte j of $4 >> 4 at bits 16-23, so both nibbles of the pair land where the magic
    expects them; pair j goes to $j, scaled by ($5 + j, $9 + j). Unscaled: the magic's bf16 pairs 136 + q alone."""
    if scaled:
        lines = [".reg .b32 hi, v, one, bias;", "mov.b32 one, 0x3F803F80;", "mov.b32 bias, 0xC308C308;"]
    else:
        lines = [".reg .b32 hi, v;"]
    lines.append("shr.b32 hi, $4, 4;")
    for j in range(4):
        pair = f"prmt.b32 v, $4, hi, 0x{4 + j:x}{4 + j:x}{j:x}{j:x};"
        magic = "lop3.b32 {}, v, 0x000F000F, 0x43084308, 0x6a;"
        if scaled:
            fmas = ["fma.rn.bf16x2 v, v, one, bias;", f"fma.rn.bf16x2 ${j}, v, ${5 + j}, ${9 + j};"]
            lines += [pair, magic.format("v"), *fmas]
        else:
            lines += [pair, magic.format(f"${j}")]
    return "{\n" + "\n".join(lines) + "\n}"


DEQUANT_BYTES_PTX = tl.constexpr(_bytes_ptx(scaled=True))
BIASED_BYTES_PTX = tl.constexpr(_bytes_ptx(scaled=False))

# The bf16 pairs 136 + q of the nibbles (j, j + 4) of the word $4, in $j: one LOP3 on the word shifted by 4j (the
# magic of DEQUANT_PTX, unscaled), for int4_decode_hopper's relabelled K.
WORD_PAIRS_PTX = tl.constexpr("""{
.reg .b32 t;
lop3.b32 $0, $4, 0x000F000F, 0x43084308, 0x6a;
shr.b32 t, $4, 4;
lop3.b32 $1, t, 0x000F000F, 0x43084308, 0x6a;
shr.b32 t, $4, 8;
lop3.b32 $2, t, 0x000F000F, 0x43084308, 0x6a;
shr.b32 t, $4, 12;
lop3.b32 $3, t, 0x000F000F, 0x43084308, 0x6a;
}""")
