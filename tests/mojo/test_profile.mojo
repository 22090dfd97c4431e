"""The emulated profile's counts on planted kernels with known answers.

Each kernel is one block of 64 threads (two 32-lane warps, or one 64-lane
wave) doing one shared access a thread, whose bank pattern fixes the
answer, counted here by hand:

- a stride of 32 words: every lane of a warp on bank 0, 32 distinct
  words: 32 wavefronts a request, 32-way;
- a broadcast: every lane reads word 0: one wavefront; a 16-byte load
  every lane pair shares: two lanes a bank slot, half the wavefronts;
- 16-byte stores of consecutive words: a quarter warp's 8 lanes cover
  the 32 banks once: 4 wavefronts a 32-lane request, no conflict;
- 16-byte stores 8 words apart: a quarter warp's 8 lanes on 16 of the
  banks, two lanes a bank: 2-way, 8 wavefronts a request;
- 32 lanes adding to one word atomically: 32 lanes per address;
- a global read of one float by every lane: uniform, one sector;
- global reads of consecutive floats: 4 sectors a 32-lane request, all
  of each sector asked for; the same reads 8 floats apart: 32 sectors,
  an eighth of each; a store: its bytes written once each;
- a site named by its source line, the per-phase critical path, the
  barriers per block, and a sampled launch;
- and the same kernel compiled for sm_90a has no recording code.
"""

from std.reflection import call_location
from std.testing import TestSuite, assert_equal, assert_true

from kernels.grid.block_phases import Lane, Shared
from kernels.grid.gpu_kernel import (
    GpuKernel,
    NoState,
    kernel_code,
    profile_kernel,
)
from kernels.grid.operands import KernelOperands
from kernels.grid.phases import Phase, Phases
from kernels.grid.profile import (
    ACCESS_LOAD,
    ACCESS_STORE,
    LaunchProfile,
    request_counts,
    request_bytes,
    request_sectors,
    site_name,
)
from kernels.grid.ragged import Field

comptime THREADS = 64
comptime STRIDE = 0
comptime BROADCAST = 1
comptime WIDE = 2
comptime WIDE_GAPPED = 3
comptime ATOMIC = 4
comptime COALESCED = 5
comptime STRIDED = 6
comptime GLOBAL_STORE = 7
comptime GLOBAL_UNIFORM = 8
comptime GLOBAL_WIDE = 9
comptime HELPER_SITES = 10


@always_inline
def _load_for_caller(
    s: Shared, data: Field[DType.float32, MutAnyOrigin], i: Int
) -> Float32:
    """A helper that loads for its callers, recorded at each caller's line."""
    return s.global_load_at(call_location(), data, i)[0]


@fieldwise_init
struct Operands[origin: MutOrigin](KernelOperands):
    """A planted kernel's one output word, and floats in global memory."""

    var out: Field[DType.uint32, Self.origin]
    var data: Field[DType.float32, Self.origin]


comptime Op = Operands[MutAnyOrigin]


struct Planted[pattern: Int](GpuKernel):
    """Phase 0: every thread fills its own words (so reads are defined);
    phase 1: the planted access."""

    comptime Operands = Op
    comptime name = "planted"
    comptime State = NoState
    comptime block_threads = THREADS
    comptime shared_words = 32 * THREADS
    comptime phase_table = Phases(Phase("fill"), Phase("planted"))
    comptime grid_rows = "1"

    @staticmethod
    def rows(op: Op) -> Int:
        return 1

    @staticmethod
    def run_phase[
        phase: Int
    ](
        b: Int,
        t: Int,
        mut state: Self.State,
        mut lane: Lane,
        s: Shared,
        op: Op,
    ):
        comptime if Self.phase_table.named(phase, "fill"):
            for w in range(32):
                s.store(t * 32 + w, UInt32(t))
        else:
            comptime if Self.pattern == STRIDE:
                op.out[unsafe_offset=0] += s.load(t * 32)
            elif Self.pattern == BROADCAST:
                op.out[unsafe_offset=0] += s.load(0)
            elif Self.pattern == WIDE:
                s.store_words[4](4 * t, SIMD[DType.uint32, 4](UInt32(t)))
            elif Self.pattern == WIDE_GAPPED:
                s.store_words[4](8 * t, SIMD[DType.uint32, 4](UInt32(t)))
            elif Self.pattern == ATOMIC:
                _ = s.atomic_add(0, 1)
            elif Self.pattern == COALESCED:
                _ = s.global_load(op.data, t)
            elif Self.pattern == STRIDED:
                _ = s.global_load(op.data, 8 * t)
            elif Self.pattern == GLOBAL_WIDE:
                var v = s.global_load[width=8, alignment=32](op.data, 8 * t)
                op.out[unsafe_offset=0] += UInt32(v[0])
            elif Self.pattern == HELPER_SITES:
                _ = _load_for_caller(s, op.data, t)
                _ = _load_for_caller(s, op.data, THREADS + t)
            elif Self.pattern == GLOBAL_UNIFORM:
                op.out[unsafe_offset=0] += UInt32(s.global_load(op.data, 0)[0])
            else:
                s.global_store(op.data, t, Float32(t))


comptime DATA_FLOATS = 8 * THREADS


def _profile[pattern: Int](warp: Int, grid: Int = 1) raises -> LaunchProfile:
    var out = List[UInt32](length=1, fill=0)
    # Floats on a 32-byte boundary, so sectors fall where counted here.
    var data = List[Float32](length=DATA_FLOATS + 8, fill=0)
    var first = data.unsafe_ptr().unsafe_origin_cast[MutAnyOrigin]()
    var skip = (32 - Int(first) % 32) % 32 // 4
    var op = Op(
        out.unsafe_ptr().unsafe_origin_cast[MutAnyOrigin](),
        first.unsafe_offset(skip),
    )
    var p = profile_kernel[Planted[pattern]](op, grid, warp)
    _ = data^
    _ = out^
    return p^


def _site(p: LaunchProfile) raises -> Int:
    """The planted access's site: the second one recorded (phase 0's store
    is the first), named by its place in this file."""
    assert_equal(len(p.sites), 2, p.json())
    assert_true(p.sites[1].name.startswith("test_profile.mojo:"))
    return 1


def test_a_32_word_stride_is_32_way() raises:
    var p = _profile[STRIDE](32)
    ref s = p.sites[_site(p)]
    assert_equal(s.requests, 2)  # two warps of 32 lanes
    assert_equal(s.wavefronts, 64)
    assert_equal(s.ideal_wavefronts, 2)
    assert_equal(s.worst_ways, 32)


def test_a_broadcast_is_one_wavefront() raises:
    var p = _profile[BROADCAST](32)
    ref s = p.sites[_site(p)]
    assert_equal(s.requests, 2)
    assert_equal(s.wavefronts, 2)
    assert_equal(s.worst_ways, 1)


def test_consecutive_16_byte_stores_are_conflict_free() raises:
    var p = _profile[WIDE](32)
    ref s = p.sites[_site(p)]
    assert_equal(s.width, 4)
    assert_equal(s.requests, 2)
    assert_equal(s.wavefronts, 8)  # 4 quarter warps a request
    assert_equal(s.ideal_wavefronts, 8)
    assert_equal(s.worst_ways, 1)


def test_16_byte_stores_8_words_apart_are_2_way() raises:
    var p = _profile[WIDE_GAPPED](32)
    ref s = p.sites[_site(p)]
    assert_equal(s.wavefronts, 16)
    assert_equal(s.ideal_wavefronts, 8)
    assert_equal(s.worst_ways, 2)


def test_32_lanes_on_one_atomic_word() raises:
    var p = _profile[ATOMIC](32)
    ref s = p.sites[_site(p)]
    assert_equal(s.requests, 2)
    assert_equal(s.max_lanes_per_address, 32)
    assert_equal(s.atomic_lanes, 64)
    assert_equal(s.atomic_addresses, 2)  # one word a request
    # A 64-lane wave: one request of 64 lanes on the word.
    var wave = _profile[ATOMIC](64)
    assert_equal(wave.sites[_site(wave)].max_lanes_per_address, 64)


def _global(p: LaunchProfile) raises -> Int:
    """The planted global access's site: the only one recorded."""
    assert_equal(len(p.global_sites), 1, p.json())
    assert_true(p.global_sites[0].name.startswith("test_profile.mojo:"))
    return 0


def test_consecutive_floats_are_4_sectors_a_request() raises:
    var p = _profile[COALESCED](32)
    ref g = p.global_sites[_global(p)]
    assert_equal(g.requests, 2)
    assert_equal(g.sectors, 8)  # 32 lanes x 4 bytes = 4 whole sectors
    assert_equal(p.cold_sectors, 8)
    assert_equal(g.bytes_requested, 2 * 32 * 4)
    assert_equal(g.uniform_requests, 0)
    assert_true('"bytes_read": 256, "bytes_written": 0' in p.json(), p.json())


def test_floats_8_apart_are_32_sectors_a_request() raises:
    var p = _profile[STRIDED](32)
    ref g = p.global_sites[_global(p)]
    assert_equal(g.requests, 2)
    assert_equal(g.sectors, 64)  # a sector a lane, 4 of its 32 bytes
    assert_equal(g.bytes_requested, 256)
    assert_true('"bytes_read": 256' in p.json(), p.json())


def test_a_uniform_load_is_one_sector_served_once() raises:
    var p = _profile[GLOBAL_UNIFORM](32)
    ref g = p.global_sites[_global(p)]
    assert_equal(g.requests, 2)
    assert_equal(g.sectors, 2)
    assert_equal(g.bytes_requested, 8)  # 4 bytes a request, asked once
    assert_equal(g.uniform_requests, 2)
    assert_equal(g.uniform_sectors, 2)
    assert_equal(g.uniform_bytes, 8)


def test_a_32_byte_load_is_two_16_byte_requests() raises:
    # As a GPU runs it: two 16-byte loads a lane, each request 32 lanes a
    # sector apart, half of each sector asked for.
    var p = _profile[GLOBAL_WIDE](32)
    ref g = p.global_sites[_global(p)]
    assert_equal(g.requests, 4)
    assert_equal(g.sectors, 128)
    assert_equal(g.bytes_requested, 4 * 32 * 16)
    assert_true('"bytes_read": 2048' in p.json(), p.json())


def test_a_global_store_counts_its_bytes_written() raises:
    # Three blocks write the same 64 floats: 256 distinct bytes.
    var p = _profile[GLOBAL_STORE](32, grid=3)
    ref g = p.global_sites[_global(p)]
    assert_equal(g.requests, 6)
    assert_equal(g.sectors, 24)
    # Each block's first touch of its 8 sectors; they are new to it.
    assert_equal(p.cold_sectors, 24)
    assert_equal(p.phase_global[0], 0)
    assert_equal(p.phase_global[1], 1)  # one store a thread
    # The first of 8 threads to store in a sector opens it: one cold
    # access at most a thread.
    assert_equal(p.phase_cold[1], 1)
    assert_true('"bytes_read": 0, "bytes_written": 256' in p.json(), p.json())


def test_a_64_lane_wave_is_one_request_of_two_halves() raises:
    var p = _profile[STRIDE](64)
    ref s = p.sites[_site(p)]
    assert_equal(s.requests, 1)
    assert_equal(s.wavefronts, 64)
    assert_equal(s.ideal_wavefronts, 2)
    assert_equal(s.worst_ways, 32)


def test_the_launch_counts() raises:
    var p = _profile[STRIDE](32, grid=3)
    assert_equal(p.grid, 3)
    assert_equal(p.blocks, 3)
    assert_equal(p.phases, 2)
    # Phase 0: 32 stores a thread, one site each warp request; phase 1:
    # one load a thread.
    assert_equal(p.phase_path[0], 32)
    assert_equal(p.phase_path[1], 1)
    assert_equal(p.phase_global[1], 0)
    assert_true('"block_threads": 64, "shared_bytes": 8192' in p.json())
    assert_equal(p.busiest_block, 64 * 33)
    assert_equal(p.idlest_block, 64 * 33)
    var text = p.json()
    assert_true('"barriers_per_block": 1' in text, text)
    assert_true('"sampled_blocks": 0' in text, text)


def test_a_sampled_launch_says_so() raises:
    var out = List[UInt32](length=1, fill=0)
    var data = List[Float32](length=1, fill=0)
    var op = Op(
        out.unsafe_ptr().unsafe_origin_cast[MutAnyOrigin](),
        data.unsafe_ptr().unsafe_origin_cast[MutAnyOrigin](),
    )
    var p = profile_kernel[Planted[BROADCAST]](op, 5, 32, sample=2)
    assert_equal(p.grid, 5)
    assert_equal(p.blocks, 2)
    assert_true('"sampled_blocks": 2' in p.json(), p.json())


def test_a_helper_passing_its_caller_names_each_call_a_site() raises:
    var p = _profile[HELPER_SITES](32)
    assert_equal(len(p.global_sites), 2, p.json())
    var first = p.global_sites[0].name
    var second = p.global_sites[1].name
    assert_true(first.startswith("test_profile.mojo:"), first)
    assert_true(second.startswith("test_profile.mojo:"), second)
    assert_true(first != second, first)
    assert_equal(p.global_sites[0].requests, 2)
    assert_equal(p.global_sites[1].requests, 2)


def test_sites_are_named_from_the_package_root() raises:
    assert_equal(
        site_name("/x/y/kernels/index/gpu/pick.mojo:218:20"),
        "kernels/index/gpu/pick.mojo:218:20",
    )
    assert_equal(site_name("/x/tests/mojo/t.mojo:3:4"), "t.mojo:3:4")


def test_the_gpu_build_has_no_recording() raises:
    # The same kernel for a GPU: plain shared loads and stores, nothing
    # of the profile (its record calls are host code only).
    var ptx = kernel_code[Planted[STRIDE], "sm_90a"]()
    assert_true("ld.shared" in ptx and "st.shared" in ptx, ptx)
    assert_true("call" not in ptx, ptx)
    assert_true("LaunchProfile" not in ptx and "record" not in ptx, ptx)
    # A global store: one plain `st.global`, nothing recorded.
    var store = kernel_code[Planted[GLOBAL_STORE], "sm_90a"]()
    assert_true("st.global" in store, store)
    assert_true("call" not in store and "record" not in store, store)


def test_request_sectors_by_hand() raises:
    # A 16-byte access across a sector boundary touches two; a lane
    # inside a sector another lane touched adds none.
    assert_equal(request_sectors([24], 16), 2)
    assert_equal(request_sectors([0, 4, 64], 4), 2)
    # Two lanes on the same word (a broadcast) ask for its bytes once.
    assert_equal(request_bytes([0, 0, 8], 4), 8)


def test_request_counts_by_hand() raises:
    # Lanes 0 and 16 on word 0 and 32 (both bank 0): 2-way; lane 1 on
    # word 0 too (a broadcast with lane 0).
    var c = request_counts([0, 16, 1], [0, 32, 0], 1, 32)
    assert_equal(c.wavefronts, 2)
    assert_equal(c.ideal, 1)
    assert_equal(c.ways, 2)
    assert_equal(c.max_lanes, 2)
    assert_equal(c.addresses, 2)


def _lanes(n: Int) -> List[Int]:
    var out = List[Int]()
    for lane in range(n):
        out.append(lane)
    return out^


def test_a_wide_load_on_paired_lanes_packs_two_lanes() raises:
    # Every lane reads words 0-3: lane pairs agree, so 16 lanes share a
    # wavefront: 2, not the 4 of distinct 16-byte loads.
    var all_zero = List[Int](length=32, fill=0)
    assert_equal(
        request_counts(_lanes(32), all_zero, 4, 32, ACCESS_LOAD).wavefronts, 2
    )
    # Stores do not pack.
    assert_equal(
        request_counts(_lanes(32), all_zero, 4, 32, ACCESS_STORE).wavefronts,
        4,
    )
    # Lanes n and n ^ 1 on one 16-byte chunk, 16 chunks on the 32 banks
    # four times over: 2 wavefronts.
    var pairs = List[Int]()
    var quads = List[Int]()
    for lane in range(32):
        pairs.append(4 * (lane // 2))
        # Lane n on chunk n % 4: no pair agrees (lanes 0 and 4 do, but
        # not as partners), so it stays 4 (the forum's example).
        quads.append(4 * (lane % 4))
    assert_equal(
        request_counts(_lanes(32), pairs, 4, 32, ACCESS_LOAD).wavefronts, 2
    )
    assert_equal(
        request_counts(_lanes(32), quads, 4, 32, ACCESS_LOAD).wavefronts, 4
    )
    # A 64-lane wave: no packing counted (the rule is NVIDIA's).
    assert_equal(
        request_counts(
            _lanes(64), List[Int](length=64, fill=0), 4, 64, ACCESS_LOAD
        ).wavefronts,
        8,
    )


def main() raises:
    TestSuite.discover_tests[__functions_in_module()]().run()
