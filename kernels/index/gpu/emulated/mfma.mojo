"""A host model of CDNA3's `v_mfma_f32_16x16x32_fp8_fp8` (MI300, gfx942).

The emulated grid runs the MFMA scorer's own code on the CPU; where a
gfx942 GPU issues `v_mfma_f32_16x16x32_fp8_fp8`, the emulation calls
`mfma_f32_16x16x32_fp8_model` instead. The model is written from AMD's
"AMD Instinct MI300 Instruction Set Architecture" reference (CDNA3 ISA,
section "Matrix Arithmetic Instructions": `D = A x B + C`, A 16 x 32,
B 32 x 16, D and C 16 x 16, one wave of 64 lanes) and the register
layouts printed by AMD's matrix instruction calculator
(`amd_matrix_instruction_calculator --architecture cdna3 --instruction
v_mfma_f32_16x16x32_fp8_fp8 --detail-instruction --register-layout`),
never from the scorer, so a scorer whose fragments disagree with the
hardware's gives wrong scores under emulation too (the model's docstring
has the layouts).

The operands are FP8 e4m3fnuz on CDNA3 (`decode_e4m3fnuz`). The model
sums each output's 32 products in float32 in ascending `k` and adds the
sum to `C`: an exact FP32 model, not the
hardware's adder (which, per the CDNA3 ISA's FP8 notes and bit-exact
studies such as microsoft/MMA-Sim, adds groups of products with fewer
bits). Tests keep every sum exact, where both agree.
"""

from std.memory import bitcast


comptime MFMA_LANES = 64
"""Lanes of a CDNA wave (wave64)."""

comptime MFMA_M = 16
"""Rows of A and D."""

comptime MFMA_N = 16
"""Columns of B and D."""

comptime MFMA_K = 32
"""FP8 elements of K one instruction consumes."""

comptime MFMA_OPERAND_BYTES = 8
"""Bytes of A (and of B) one lane holds: two VGPRs."""

comptime MFMA_ACC = 4
"""Float32 accumulator registers per lane."""


@always_inline
def _pow2(e: Int) -> Float32:
    """`2^e` for `-126 <= e <= 127`, built from its float32 bits."""
    return bitcast[DType.float32, 1](UInt32(e + 127) << 23)


def decode_e4m3fnuz(byte: UInt8) -> Float32:
    """One FP8 e4m3fnuz byte as float32, exactly.

    The operands of CDNA3's FP8 MFMA (gfx950 switched to OCP e4m3fn).
    e4m3fnuz (CDNA3 ISA, "FP8 and BF8 formats"; LLVM's `Float8E4M3FNUZ`):
    sign bit 7, exponent bits 3-6 with bias 8, mantissa bits 0-2. Exponent
    0 is subnormal, `m * 2^-10`; otherwise `(1 + m / 8) * 2^(e - 8)`, up to
    `0x7F` = 240. No infinities; `0x80` (what would be -0) is the only
    NaN, so there is no negative zero.

    Args:
        byte: The bit pattern.

    Returns:
        Its value (NaN for `0x80`).
    """
    if byte == 0x80:
        return Float32(FloatLiteral.nan)
    var e = Int((byte >> 3) & 0xF)
    var m = Int(byte & 0x7)
    var mag: Float32
    if e == 0:
        mag = Float32(m) * _pow2(-10)
    else:
        mag = Float32(8 + m) * _pow2(e - 8 - 3)
    return -mag if (byte & 0x80) != 0 else mag


def mfma_operand_element(lane: Int, byte: Int) -> Tuple[Int, Int]:
    """`(i, k)` of the operand element that byte `byte` of `lane` holds.

    For A this is `A[i][k]` (`i` its row); for B, `B[k][i]` (`i` its
    column): both operands of `v_mfma_f32_16x16x32_fp8_fp8` use the same
    layout (AMD matrix instruction calculator, CDNA3, `--register-layout`
    of src0 and src1: lane `16 (k / 8) + i`, 8 consecutive `k` per lane,
    byte `k % 8`).

    Args:
        lane: Lane of the wave, 0 to 63.
        byte: Byte of the lane's 8-byte operand (VGPR pair), 0 to 7.
    """
    return (lane % 16, 8 * (lane // 16) + byte)


def mfma_operand_lane(i: Int, k: Int) -> Tuple[Int, Int]:
    """`(lane, byte)` holding `A[i][k]` (or `B[k][i]`): the inverse of
    `mfma_operand_element`.

    Args:
        i: Row of A (column of B), 0 to 15.
        k: Index along K, 0 to 31.
    """
    return (16 * (k // 8) + i, k % 8)


def mfma_accumulator_element(lane: Int, register: Int) -> Tuple[Int, Int]:
    """`(i, j)` of `D` that accumulator `register` of `lane` holds.

    AMD matrix instruction calculator, CDNA3 `v_mfma_f32_16x16x32_fp8_fp8`,
    `--register-layout` of D: `D[i][j]` is register `i % 4` of lane
    `16 (i / 4) + j`.

    Args:
        lane: Lane of the wave, 0 to 63.
        register: Accumulator register, 0 to 3.
    """
    return (4 * (lane // 16) + register, lane % 16)


@always_inline
def _operand_byte(
    words: SIMD[DType.uint64, MFMA_LANES], i: Int, k: Int
) -> UInt8:
    """Element `(i, k)` of an operand from every lane's 8 bytes."""
    var at = mfma_operand_lane(i, k)
    return UInt8((words[at[0]] >> UInt64(8 * at[1])) & 0xFF)


def mfma_f32_16x16x32_fp8_model(
    a: SIMD[DType.uint64, MFMA_LANES],
    b: SIMD[DType.uint64, MFMA_LANES],
    lane: Int,
    c: SIMD[DType.float32, MFMA_ACC],
) -> SIMD[DType.float32, MFMA_ACC]:
    """One `v_mfma_f32_16x16x32_fp8_fp8` as lane `lane` sees it.

    `D = A x B + C` with A `[16, 32]` and B `[32, 16]` e4m3fnuz, D and C
    `[16, 16]` float32, each spread over the wave's registers as the CDNA3
    ISA lays them out:

    - **A** (`src0`, 2 VGPRs = 8 bytes per lane): lane `16 (k / 8) + i` holds
      `A[i][k]` in byte `k % 8` (bits `8 (k % 8)` up), for `i < 16`, `k < 32`.
    - **B** (`src1`, 8 bytes per lane): lane `16 (k / 8) + j` holds `B[k][j]`
      in byte `k % 8`.
    - **D / C** (4 VGPRs per lane): `D[i][j]` is register `i % 4` of lane
      `16 (i / 4) + j`.

    The model receives every lane's operand registers at once: on a GPU the
    64 lanes hold them side by side; on the emulated grid lanes are threads
    run one after another, so the caller gathers them (the MFMA scorer calls
    its own per-lane fragment loader for each lane; the loader reads only
    the op's inputs, which no phase writes).

    Args:
        a: Every lane's A operand (src0): lane `l`'s 8 bytes, byte 0 in
            bits 0-7 (the VGPR pair as a little-endian uint64).
        b: Every lane's B operand (src1), likewise.
        lane: The lane whose result to return, 0 to 63.
        c: That lane's accumulator registers (src2).

    Returns:
        That lane's 4 registers of D: products summed in float32 in
        ascending `k`, then added to `C`.
    """
    var d = c
    for r in range(MFMA_ACC):
        var at = mfma_accumulator_element(lane, r)
        var sum = Float32(0)
        for k in range(MFMA_K):
            sum += decode_e4m3fnuz(
                _operand_byte(a, at[0], k)
            ) * decode_e4m3fnuz(_operand_byte(b, at[1], k))
        d[r] += sum
    return d
