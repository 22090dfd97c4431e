"""The kernel model's emulation: exact for barrier-separated code, and strict.

Each feature is a small kernel declared as a `GpuKernel`, run over the
emulated grid with answers computed here in plain loops, then with a fault
planted that the emulation must refuse (or, for block order, expose):

- phase tables: counts, collectives, names and rounds of a joined table;
- phases and shared memory: a block sum in two phases; the barrier left
  out, a word read before any write, a word overwritten after another
  thread read it, an index past the block's words;
- atomics: a shared histogram counted with `atomic_add` and a maximum with
  `atomic_max`; a plain store to a word other threads add to atomically;
- per-thread state across barriers: a value kept in `State` from phase 0
  to phase 2;
- collectives: every kind against the same reduction written out here; a
  lane that offers nothing, an offer in a phase whose table entry has no
  collective, a result read where no collective gave one, and one read a
  phase too late;
- shared memory sized at launch: the words follow the call; a launch that
  asks more than the declared most, an index past the launch's words;
- rows over several blocks: a row summed by blocks that meet through
  global memory, the last block to arrive (a global atomic counter)
  adding the partials; the same with the merge given to block 0, which
  the shuffled block order makes wrong.

Finally the kernels compile for sm_90a, sm_100a and gfx942 with what the
model promises in their code: barriers, `atom` on shared memory,
`shfl.sync`, dynamic shared memory.
"""

from max.gpu.host import get_gpu_target
from max.gpu.host.compile import _compile_code
from std.atomic import Atomic, Ordering
from std.math import max
from std.testing import TestSuite, assert_equal, assert_true

from kernels.grid.block_phases import (
    BLOCK_EXCLUSIVE_SUM,
    BLOCK_MAX,
    BLOCK_SUM,
    EMULATED_WARP,
    NO_COLLECTIVE,
    WARP_BALLOT,
    WARP_BROADCAST,
    WARP_EXCLUSIVE_SUM,
    WARP_MAX,
    WARP_SUM,
    Lane,
    Shared,
    arrive,
    block_order,
)
from kernels.grid.gpu_kernel import GpuKernel, emulate_kernel, kernel_code
from kernels.grid.shared_buffer import Buffer
from kernels.grid.operands import KernelOperands
from kernels.grid.phases import Phase, Phases
from kernels.grid.ragged import Field, Ptr

comptime BLOCK = 8


@fieldwise_init
struct Operands[origin: MutOrigin](KernelOperands):
    """Every test kernel's operands: an output, an input, a counter, a
    size and the planted fault (0: none)."""

    var out: Field[DType.uint32, Self.origin]
    var input: Field[DType.uint32, Self.origin]
    var counter: Field[DType.uint32, Self.origin]
    var n: Int
    var fault: Int


comptime Op = Operands[MutAnyOrigin]


struct Buffers(Movable):
    """Host memory behind an `Op`."""

    var out: List[UInt32]
    var input: List[UInt32]
    var counter: List[UInt32]

    def __init__(out self, outputs: Int, inputs: List[UInt32]):
        self.out = List[UInt32](length=outputs, fill=7)
        self.input = inputs.copy()
        self.counter = List[UInt32](length=1, fill=0)

    def op(mut self, n: Int, fault: Int) -> Op:
        return Op(
            self.out.unsafe_ptr().unsafe_origin_cast[MutAnyOrigin](),
            self.input.unsafe_ptr().unsafe_origin_cast[MutAnyOrigin](),
            self.counter.unsafe_ptr().unsafe_origin_cast[MutAnyOrigin](),
            n,
            fault,
        )


def _error[K: GpuKernel](op: K.Operands, grid: Int) -> String:
    """The emulation's error for `K` over `grid` blocks, or empty."""
    try:
        emulate_kernel[K](op, grid)
    except e:
        return String(e)
    return String()


def _value(b: Int, t: Int) -> UInt32:
    return UInt32(100 * b + t * t + 1)


# --- phase tables --------------------------------------------------------


def test_a_phase_table_answers_by_name() raises:
    comptime pass_ = Phases(Phase("count"), Phase("offer", BLOCK_SUM))
    comptime table = (
        Phases(Phase("load"))
        .then(pass_.repeat(2))
        .then(Phases(Phase("step", times=3), Phase("idle", times=0)))
        .then(Phases(Phase("write")))
    )
    # load, count, offer, count, offer, step, step, step, write
    comptime count = table.count()
    comptime offers = table.collective(4)
    comptime steps = table.collective(5)
    comptime second = table.round(3)
    comptime third = table.round(7)
    comptime write = table.index("write")
    comptime is_step = table.named(6, "step")
    comptime is_idle = table.named(6, "idle")
    assert_equal(count, 9)
    assert_equal(offers, BLOCK_SUM)
    assert_equal(steps, NO_COLLECTIVE)
    assert_equal(second, 1)
    assert_equal(third, 2)
    assert_equal(write, 8)
    assert_true(is_step and not is_idle)


# --- phases and shared memory -------------------------------------------


struct BlockSum(GpuKernel):
    """Phase 0: each thread stores its value; phase 1: thread 0 adds them.
    Faults: 1 the barrier left out (one phase), 2 a word nobody wrote, 3 a
    word overwritten after another thread read it, 4 an index past the
    words, 5 an index past a named buffer."""

    comptime Operands = Op
    comptime name = "block_sum"
    comptime block_threads = BLOCK
    comptime shared_words = BLOCK + 1
    comptime phase_table = Phases(Phase("store"), Phase("sum"))
    comptime grid_rows = "blocks"

    @staticmethod
    def rows(op: Op) -> Int:
        return op.n

    @staticmethod
    def run(p: Int, b: Int, t: Int, s: Shared, op: Op):
        if op.fault == 1:
            if p == 1:
                return
            s.store(t, _value(b, t))
            if t == 0:
                var total: UInt32 = 0
                for i in range(BLOCK):
                    total += s.load(i)
                op.out[unsafe_offset=b] = total
        elif op.fault == 2 and p == 1 and t == 0:
            _ = s.load(BLOCK)
        elif op.fault == 3 and p == 1:
            if t == 0:
                _ = s.load(3)
            if t == 3:
                s.store(3, 7)
        elif op.fault == 4 and p == 0 and t == 5:
            s.store(BLOCK + 2, 1)
        elif op.fault == 5 and p == 0 and t == 5:
            # Past the named buffer of the values, into the block's last
            # word (its own buffer): inside the block's words.
            Buffer["values"](s, 0, BLOCK).store(BLOCK, 1)
        elif p == 0:
            s.store(t, _value(b, t))
        elif t == 0:
            var total: UInt32 = 0
            for i in range(BLOCK):
                total += s.load(i)
            op.out[unsafe_offset=b] = total


def _block_sum(b: Int) -> UInt32:
    var total: UInt32 = 0
    for t in range(BLOCK):
        total += _value(b, t)
    return total


def test_two_phases_sum_every_block() raises:
    var m = Buffers(5, List[UInt32]())
    assert_equal(_error[BlockSum](m.op(5, 0), 5), "")
    for b in range(5):
        assert_equal(m.out[b], _block_sum(b))


def test_a_missing_barrier_is_refused() raises:
    var m = Buffers(1, List[UInt32]())
    var error = _error[BlockSum](m.op(1, 1), 1)
    # Descending thread order ran threads 7..1 before thread 0, so the sum
    # itself came out right: only the stamps can see the race.
    assert_equal(m.out[0], _block_sum(0))
    assert_true(
        "block_sum: block 0 phase 0 thread 0 read shared word 1 that thread"
        " 1 used in the same phase (a missing barrier)" in error,
        error,
    )


def test_an_unwritten_word_is_refused() raises:
    var m = Buffers(2, List[UInt32]())
    var error = _error[BlockSum](m.op(2, 2), 2)
    assert_true(
        "phase 1 thread 0 read shared word 8 before any thread wrote it"
        in error,
        error,
    )


def test_overwriting_a_word_read_in_the_same_phase_is_refused() raises:
    var m = Buffers(1, List[UInt32]())
    var error = _error[BlockSum](m.op(1, 3), 1)
    # Thread 3 runs first and writes; thread 0's read then sees the race.
    assert_true("phase 1" in error and "word 3" in error, error)
    assert_true("missing barrier" in error, error)


def test_an_index_past_the_shared_words_is_refused() raises:
    var m = Buffers(1, List[UInt32]())
    var error = _error[BlockSum](m.op(1, 4), 1)
    assert_true(
        "block 0 phase 0 thread 5 used shared word 10 out of range" in error,
        error,
    )


def test_an_index_past_a_named_buffer_is_refused() raises:
    var m = Buffers(1, List[UInt32]())
    var error = _error[BlockSum](m.op(1, 5), 1)
    assert_true(
        "block 0 phase 0 thread 5 used a word outside its shared buffer"
        in error,
        error,
    )


# --- atomics -------------------------------------------------------------

comptime HIST_THREADS = 64
comptime BUCKETS = 5


struct Histogram(GpuKernel):
    """Counts `input` (`n` values) into 5 buckets by `value % 5` with shared
    `atomic_add`, and their largest value with `atomic_max`. Fault 1:
    thread 3 also stores bucket 0 plainly in the counting phase; fault 2:
    the buckets are never cleared."""

    comptime Operands = Op
    comptime name = "histogram"
    comptime block_threads = HIST_THREADS
    comptime shared_words = BUCKETS + 1
    comptime phase_table = Phases(Phase("clear"), Phase("count"), Phase("out"))
    comptime grid_rows = "1"

    @staticmethod
    def rows(op: Op) -> Int:
        return 1

    @staticmethod
    def run(p: Int, b: Int, t: Int, s: Shared, op: Op):
        if p == 0:
            if t <= BUCKETS and op.fault != 2:
                s.store(t, 0)
        elif p == 1:
            for i in range(t, op.n, HIST_THREADS):
                var v = op.input[unsafe_offset=i]
                _ = s.atomic_add(Int(v % BUCKETS), 1)
                s.atomic_max(BUCKETS, v)
            if op.fault == 1 and t == 3:
                s.store(0, 0)
        elif t <= BUCKETS:
            op.out[unsafe_offset=t] = s.load(t)


def _inputs(n: Int) -> List[UInt32]:
    var out = List[UInt32]()
    for i in range(n):
        out.append(UInt32((i * 7919 + 13) % 1000))
    return out^


def test_atomics_count_a_histogram() raises:
    var values = _inputs(1000)
    var m = Buffers(BUCKETS + 1, values)
    assert_equal(_error[Histogram](m.op(1000, 0), 1), "")
    var want = List[UInt32](length=BUCKETS + 1, fill=0)
    for v in values:
        want[Int(v % BUCKETS)] += 1
        want[BUCKETS] = max(want[BUCKETS], v)
    for i in range(BUCKETS + 1):
        assert_equal(m.out[i], want[i])


def test_a_plain_store_racing_atomics_is_refused() raises:
    var m = Buffers(BUCKETS + 1, _inputs(1000))
    var error = _error[Histogram](m.op(1000, 1), 1)
    # Threads 63..4 added to bucket 0 before thread 3's store: the race is
    # with several threads, not one.
    assert_true(
        "histogram: block 0 phase 1 thread 3 mixed a plain access of shared"
        " word 0 with that of several threads in the same phase, one of them"
        " atomic (a race)" in error,
        error,
    )


def test_an_atomic_on_an_unwritten_word_is_refused() raises:
    var m = Buffers(BUCKETS + 1, _inputs(1000))
    var error = _error[Histogram](m.op(1000, 2), 1)
    assert_true(
        "atomically before any thread wrote it" in error
        and "histogram: block 0 phase 1" in error,
        error,
    )


# --- state across barriers and collectives -------------------------------

comptime LANES = 128


@fieldwise_init
struct Kept(Copyable, Defaultable, TrivialRegisterPassable):
    """What a collective test's thread keeps across barriers."""

    var mine: UInt64

    def __init__(out self):
        self.mine = 0


def _lane_value(b: Int, t: Int) -> UInt64:
    """Values with repeats and zeros, so ballots and maxima are not trivial."""
    return UInt64(((t * 37 + b * 11) % 23) // 3)


struct Collective[kind: Int](GpuKernel):
    """Phase `keep` keeps a value in `State`; `offer` offers it to the
    collective `kind`; `write` writes the result; `after` does nothing.
    Faults: 1 thread 6 offers nothing; 2 thread 9 reads a result in
    `offer`, before any collective; 3 thread 4 offers in `keep`, whose
    table entry has no collective; 4 thread 2 reads the result again in
    `after`, a phase after the one that follows the collective."""

    comptime Operands = Op
    comptime State = Kept
    comptime name = "collective"
    comptime block_threads = LANES
    comptime phase_table = Phases(
        Phase("keep"), Phase("offer", Self.kind), Phase("write"), Phase("after")
    )
    comptime grid_rows = "blocks"

    @staticmethod
    def rows(op: Op) -> Int:
        return op.n

    @staticmethod
    def run_phase[
        phase: Int
    ](b: Int, t: Int, mut state: Kept, mut lane: Lane, s: Shared, op: Op):
        comptime table = Self.phase_table
        comptime if table.named(phase, "keep"):
            state.mine = _lane_value(b, t)
            if op.fault == 3 and t == 4:
                lane.offer(state.mine)
        elif table.named(phase, "offer"):
            if op.fault == 2 and t == 9:
                _ = lane.result()
            if op.fault != 1 or t != 6:
                lane.offer(state.mine)
        elif table.named(phase, "write"):
            op.out[unsafe_offset=b * LANES + t] = UInt32(lane.result())
        else:
            if op.fault == 4 and t == 2:
                _ = lane.result()


def _want(kind: Int, b: Int, t: Int) -> UInt64:
    """Thread `t`'s result of `kind` in block `b`, written out."""
    var lo = 0 if kind >= BLOCK_SUM else t - t % EMULATED_WARP
    var hi = LANES if kind >= BLOCK_SUM else lo + EMULATED_WARP
    var result: UInt64 = 0
    for u in range(lo, hi):
        var v = _lane_value(b, u)
        if kind == WARP_SUM or kind == BLOCK_SUM:
            result += v
        elif kind == WARP_MAX or kind == BLOCK_MAX:
            result = max(result, v)
        elif kind == WARP_EXCLUSIVE_SUM or kind == BLOCK_EXCLUSIVE_SUM:
            if u < t:
                result += v
        elif kind == WARP_BROADCAST:
            if u == lo:
                result = v
        elif v != 0:  # WARP_BALLOT
            result |= UInt64(1) << UInt64(u - lo)
    return result


def _check_collective[kind: Int]() raises:
    var m = Buffers(2 * LANES, List[UInt32]())
    assert_equal(_error[Collective[kind]](m.op(2, 0), 2), "")
    for b in range(2):
        for t in range(LANES):
            if UInt64(m.out[b * LANES + t]) != _want(kind, b, t) & 0xFFFFFFFF:
                raise Error(
                    "collective ",
                    kind,
                    " block ",
                    b,
                    " thread ",
                    t,
                    ": got ",
                    m.out[b * LANES + t],
                    ", want ",
                    _want(kind, b, t),
                )


def test_every_collective_equals_its_reduction() raises:
    _check_collective[WARP_SUM]()
    _check_collective[WARP_MAX]()
    _check_collective[WARP_EXCLUSIVE_SUM]()
    _check_collective[WARP_BROADCAST]()
    _check_collective[WARP_BALLOT]()
    _check_collective[BLOCK_SUM]()
    _check_collective[BLOCK_MAX]()
    _check_collective[BLOCK_EXCLUSIVE_SUM]()


def test_a_lane_that_offers_nothing_is_refused() raises:
    var m = Buffers(LANES, List[UInt32]())
    var error = _error[Collective[WARP_SUM]](m.op(1, 1), 1)
    assert_true(
        "collective: block 0 phase 1 (offer) thread 6 offered no value to the"
        " collective" in error,
        error,
    )


def test_an_offer_with_no_collective_in_the_table_is_refused() raises:
    var m = Buffers(LANES, List[UInt32]())
    var error = _error[Collective[WARP_SUM]](m.op(1, 3), 1)
    assert_true(
        "collective: block 0 phase 0 (keep) thread 4 offered a value, but"
        " the phase table has no collective after phase keep" in error,
        error,
    )


def test_a_result_no_collective_gave_is_refused() raises:
    var m = Buffers(LANES, List[UInt32]())
    var error = _error[Collective[BLOCK_SUM]](m.op(1, 2), 1)
    assert_true(
        "collective: block 0 phase 1 (offer) thread 9 read a collective"
        " result that no collective gave it" in error,
        error,
    )


def test_a_result_read_past_the_phase_after_its_collective_is_refused() raises:
    var m = Buffers(LANES, List[UInt32]())
    var error = _error[Collective[BLOCK_SUM]](m.op(1, 4), 1)
    assert_true(
        "collective: block 0 phase 3 (after) thread 2 read a collective"
        " result that no collective gave it" in error,
        error,
    )


# --- shared memory sized at launch ---------------------------------------

comptime MOST_WORDS = 15000
"""60,000 bytes: past the 48 KiB of static shared memory, within the 64 KiB
every target gives a block."""


struct Reverse(GpuKernel):
    """Reverses `input` (`n` words) through `n` shared words sized at
    launch. Fault 1: thread 0 also writes word `n`."""

    comptime Operands = Op
    comptime name = "reverse"
    comptime block_threads = 64
    comptime shared_words = MOST_WORDS
    comptime dynamic_shared = True
    comptime phase_table = Phases(Phase("store"), Phase("reverse"))
    comptime grid_rows = "1"

    @staticmethod
    def rows(op: Op) -> Int:
        return 1

    @staticmethod
    def launch_shared_words(op: Op) -> Int:
        return op.n

    @staticmethod
    def run(p: Int, b: Int, t: Int, s: Shared, op: Op):
        if p == 0:
            for i in range(t, op.n, 64):
                s.store(i, op.input[unsafe_offset=i])
            if op.fault == 1 and t == 0:
                s.store(op.n, 1)
        else:
            for i in range(t, op.n, 64):
                op.out[unsafe_offset=i] = s.load(op.n - 1 - i)


def test_shared_words_sized_at_launch() raises:
    for n in [1, 300, MOST_WORDS]:
        var values = _inputs(n)
        var m = Buffers(n, values)
        assert_equal(_error[Reverse](m.op(n, 0), 1), "")
        for i in range(n):
            assert_equal(m.out[i], values[n - 1 - i])


def test_past_the_launch_words_is_refused() raises:
    var m = Buffers(300, _inputs(300))
    var error = _error[Reverse](m.op(300, 1), 1)
    assert_true("thread 0 used shared word 300 out of range" in error, error)
    var big = Buffers(MOST_WORDS + 1, _inputs(MOST_WORDS + 1))
    error = _error[Reverse](big.op(MOST_WORDS + 1, 0), 1)
    assert_true(
        "reverse: launch_shared_words=15001 outside 0..15000" in error, error
    )


# --- rows over several blocks --------------------------------------------

comptime SPLIT_THREADS = 64


@fieldwise_init
struct Arrival(Copyable, Defaultable, TrivialRegisterPassable):
    """Whether this block arrived last (thread 0 learns it)."""

    var last: Bool

    def __init__(out self):
        self.last = False


struct SplitSum(GpuKernel):
    """One row of `n` values summed by `grid` blocks: each block's partial
    (a block sum) goes to `out[1 + block]`; the last block to arrive at the
    global counter adds the partials into `out[0]`. Fault 1: block 0
    merges, whatever arrived."""

    comptime Operands = Op
    comptime State = Arrival
    comptime name = "split_sum"
    comptime block_threads = SPLIT_THREADS
    comptime phase_table = Phases(
        Phase("partial", BLOCK_SUM), Phase("arrive", BLOCK_MAX), Phase("merge")
    )
    comptime grid_rows = "blocks"

    @staticmethod
    def rows(op: Op) -> Int:
        return op.n // 1000

    @staticmethod
    def run_phase[
        phase: Int
    ](b: Int, t: Int, mut state: Arrival, mut lane: Lane, s: Shared, op: Op):
        var blocks = op.n // 1000
        comptime table = Self.phase_table
        comptime if table.named(phase, "partial"):
            var partial: UInt64 = 0
            for i in range(b * 1000 + t, (b + 1) * 1000, SPLIT_THREADS):
                partial += UInt64(op.input[unsafe_offset=i])
            lane.offer(partial)
        elif table.named(phase, "arrive"):
            var arrived: UInt64 = 0
            if t == 0:
                op.out[unsafe_offset=1 + b] = UInt32(lane.result())
                var before = arrive(op.counter)
                arrived = 1 if Int(before) == blocks - 1 else 0
                if op.fault == 1:
                    arrived = 1 if b == 0 else 0
            lane.offer(arrived)
        else:
            if lane.result() != 0 and t == 0:
                var total: UInt32 = 0
                for v in range(blocks):
                    total += op.out[unsafe_offset=1 + v]
                op.out[unsafe_offset=0] = total


def test_blocks_meet_through_global_memory() raises:
    var values = _inputs(7000)
    var m = Buffers(8, values)
    assert_equal(_error[SplitSum](m.op(7000, 0), 7), "")
    var want: UInt32 = 0
    for v in values:
        want += v
    assert_equal(m.out[0], want)
    assert_equal(m.counter[0], 7)


def test_block_order_dependence_is_exposed() raises:
    # Block 0 does not run last in the shuffled order, so a merge it does
    # reads partials still at their fill (7).
    var order = block_order(7)
    assert_true(order[6] != 0, "block 0 runs last: pick another grid")
    var m = Buffers(8, _inputs(7000))
    assert_equal(_error[SplitSum](m.op(7000, 1), 7), "")
    var want: UInt32 = 0
    for v in _inputs(7000):
        want += v
    assert_true(m.out[0] != want, "the planted order dependence went unseen")


# --- compiled code -------------------------------------------------------


def _code[arch: StaticString]() raises -> String:
    return String(
        kernel_code[BlockSum, arch](),
        kernel_code[Histogram, arch](),
        kernel_code[Collective[BLOCK_EXCLUSIVE_SUM], arch](),
        kernel_code[Collective[WARP_BALLOT], arch](),
        kernel_code[Reverse, arch](),
        kernel_code[SplitSum, arch](),
    )


def test_the_model_compiles_for_nvidia() raises:
    for asm in [_code["sm_90a"](), _code["sm_100a"]()]:
        for what in [
            ".entry block_sum_",
            "bar.sync",
            "atom.relaxed.cta.shared.add.u32",
            "atom.relaxed.cta.shared.max.u32",
            "shfl.sync",
            ".extern .shared",
            "atom.acq_rel.gpu",
        ]:
            assert_true(what in asm, String("no ", what, " in the PTX"))


def test_the_model_compiles_for_amd() raises:
    var asm = _code["gfx942"]()
    for what in ["s_barrier", "ds_add_u32", "ds_max_u32", "ds_bpermute"]:
        assert_true(what in asm, String("no ", what, " in the AMDGCN"))


def main() raises:
    TestSuite.discover_tests[__functions_in_module()]().run()
