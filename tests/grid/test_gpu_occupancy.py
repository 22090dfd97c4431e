"""The occupancy model against hand-worked calculator examples."""

import pytest

from mla_kpool.gpu_report.occupancy import LIMITERS, occupancy_by_gpu


def test_select_block_on_h200_is_shared_memory_bound():
    # 32 threads (1 warp), 34,064 B of shared memory, 40 registers.
    # Shared: 34,064 + 1,024 reserved = 35,088, rounded up to 128 B:
    # 35,200; 233,472 (228 KB) // 35,200 = 6 blocks. Registers: 40 * 32 =
    # 1,280 per warp; 16,384 // 1,280 = 12 warps per sub-partition, 48 per
    # SM, 48 blocks. Warps: 64 // 1 = 64. Blocks: 32. So 6 blocks, 6 warps
    # of 64: 9.375%.
    got = occupancy_by_gpu("sm_90a", 40, 34064, 32)
    assert set(got) == {"H100", "H200"}
    h200 = got["H200"]
    assert h200["limited_by"] == "shared memory"
    assert h200["resident_blocks"] == 6
    assert h200["resident_warps"] == 6
    assert h200["fraction"] == pytest.approx(6 / 64)
    assert h200["limits"] == {
        "registers": 48,
        "shared memory": 6,
        "block size": 64,
        "blocks per SM": 32,
    }
    assert h200["units"] == 132


def test_select_block_on_mi300x_is_one_workgroup():
    # 34,064 B of LDS rounds up to 512 B granules: 34,304; 65,536 //
    # 34,304 = 1 workgroup of 1 wave (32 threads in a wave64), of 32
    # waves per CU: 3.125%.
    got = occupancy_by_gpu("gfx942", 40, 34064, 32)
    assert list(got) == ["MI300X"]
    mi = got["MI300X"]
    assert (mi["resident_blocks"], mi["resident_warps"]) == (1, 1)
    assert mi["limited_by"] == "shared memory"
    assert mi["fraction"] == pytest.approx(1 / 32)
    assert mi["units"] == 304


def test_register_bound_block_on_h200():
    # 128 threads (4 warps), 80 registers, 16.5 KiB (16,896 B) shared.
    # Registers: 80 * 32 = 2,560 per warp (a multiple of 256); 16,384 //
    # 2,560 = 6 warps per sub-partition, 24 per SM, 24 // 4 = 6 blocks.
    # Shared: 16,896 + 1,024 = 17,920 (a multiple of 128); 233,472 //
    # 17,920 = 13. Warps: 64 // 4 = 16. So 6 blocks, 24 warps: 37.5%.
    h200 = occupancy_by_gpu("sm_90a", 80, 16896, 128)["H200"]
    assert h200["limited_by"] == "registers"
    assert (h200["resident_blocks"], h200["resident_warps"]) == (6, 24)
    assert h200["limits"]["shared memory"] == 13
    assert h200["fraction"] == pytest.approx(0.375)


def test_full_blocks_are_block_size_bound_on_b200():
    # 1024 threads = 32 warps: 64 // 32 = 2 blocks, 64 warps: 100%.
    # Registers 32: 1,024 per warp, 16 per sub-partition, 64 warps, 2
    # blocks too: a tie, reported as registers (the first limiter); with
    # no register count the block size binds alone.
    b200 = occupancy_by_gpu("sm_100a", 32, 0, 1024)["B200"]
    assert b200["resident_blocks"] == 2 and b200["fraction"] == 1.0
    assert b200["limited_by"] == "registers"
    assert b200["units"] == 148
    none = occupancy_by_gpu("sm_100a", 0, 0, 1024)["B200"]
    assert none["limited_by"] == "block size"
    assert none["limits"]["registers"] is None


def test_small_blocks_hit_blocks_per_sm():
    # 32 threads, 16 registers (512 per warp: 32 warps per sub-partition),
    # no shared memory (1,024 B reserved: 228 blocks): the 32-block cap
    # binds, 32 warps of 64: 50%.
    h100 = occupancy_by_gpu("sm_90a", 16, 0, 32)["H100"]
    assert h100["limited_by"] == "blocks per SM"
    assert h100["resident_blocks"] == 32
    assert h100["fraction"] == pytest.approx(0.5)


def test_amd_barrier_limit_and_vgprs():
    # 128 threads = 2 waves, 32 VGPRs (512 // 32 = 16 waves per SIMD,
    # capped at 8: 32 per CU, 16 workgroups), no LDS: 32 // 2 = 16 by
    # waves, and 16 barriers: a tie at 16 workgroups, 32 waves (100%).
    mi = occupancy_by_gpu("gfx942", 32, 0, 128)["MI300X"]
    assert mi["resident_blocks"] == 16 and mi["fraction"] == 1.0
    # 64 threads = 1 wave, 8 VGPRs: single-wave workgroups take no
    # barrier, 32 of them by waves, tied with 32 by the VGPRs.
    one = occupancy_by_gpu("gfx942", 0, 0, 64)["MI300X"]
    assert one["resident_blocks"] == 32
    assert one["limited_by"] == "block size"
    # 256 threads = 4 waves, 100 VGPRs: rounded to 104, 512 // 104 = 4
    # waves per SIMD, 16 per CU, 16 // 4 = 4 workgroups: 16 waves, 50%.
    regs = occupancy_by_gpu("gfx942", 100, 0, 256)["MI300X"]
    assert regs["limited_by"] == "registers"
    assert (regs["resident_blocks"], regs["fraction"]) == (4, 0.5)
    # 32 threads, 8 VGPRs (32 waves per CU), 3 KiB of LDS (a multiple of
    # 512 B): 65,536 // 3,072 = 21 workgroups, fewer than the 32 waves.
    lds = occupancy_by_gpu("gfx942", 8, 3072, 32)["MI300X"]
    assert lds["resident_blocks"] == 21
    assert lds["limited_by"] == "shared memory"


def test_a_kernel_that_cannot_launch_gets_zero():
    # 256 registers pass the 255 per thread; 228 KB of shared memory
    # passes the 227 KB a block may use.
    regs = occupancy_by_gpu("sm_90a", 256, 0, 32)["H200"]
    assert (regs["resident_blocks"], regs["limited_by"]) == (0, "registers")
    smem = occupancy_by_gpu("sm_90a", 32, 228 * 1024, 32)["H200"]
    assert smem["resident_blocks"] == 0
    assert smem["limited_by"] == "shared memory"
    # 1024 threads at 128 registers: 4,096 per warp x 32 warps = 131,072,
    # past the 65,536 a block may hold.
    big = occupancy_by_gpu("sm_90a", 128, 0, 1024)["H200"]
    assert big["resident_blocks"] == 0 and big["fraction"] == 0.0


def test_every_limiter_is_named():
    assert LIMITERS == (
        "registers",
        "shared memory",
        "block size",
        "blocks per SM",
    )


@pytest.mark.parametrize(
    "args",
    [("sm_80", 32, 0, 32), ("sm_90a", 32, 0, 0), ("sm_90a", 32, 0, 1025)],
)
def test_bad_input_raises(args):
    with pytest.raises(ValueError):
        occupancy_by_gpu(*args)
