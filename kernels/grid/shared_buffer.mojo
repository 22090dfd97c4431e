"""A named buffer of a block's shared words: `SharedBuffer`.

A kernel's shared memory is a few buffers (a histogram, a row cache, a
query tile), each a run of `UInt32` words of the block's view (`Shared`).
A kernel lays them out once, from its launch's sizes, and hands its
phases views by name (`histogram(p)`, `pair_keys()`, ...): a body indexes
a buffer from 0, never the block's words.

Each access goes through the block's view, recorded at the caller's
source line with the buffer's name (the profile's `buffer` of a site).
Emulated (`SHARED_CHECKED`), an index outside the buffer is refused as an
index outside the block's words would be, so one buffer cannot run into
the next unseen; the GPU build has neither the check nor the recording.
"""

from std.memory import bitcast
from std.reflection import SourceLocation, call_location

from .block_phases import SHARED_CHECKED, BlockShared

comptime Buffer[name: StaticString] = SharedBuffer[MutAnyOrigin, name]
"""The buffer a kernel's layout hands out (of a `Shared` view)."""


@fieldwise_init
struct SharedBuffer[origin: MutOrigin, name: StaticString](
    TrivialRegisterPassable
):
    """Words `[start, start + size)` of a block's shared memory, called
    `name`.

    Parameters:
        origin: Origin of the view's pointers (`MutAnyOrigin`: `Buffer`).
        name: What the kernel calls the buffer (the profile's `buffer`).
    """

    var s: BlockShared[Self.origin, SHARED_CHECKED]
    """The block's view."""
    var start: Int
    """The buffer's first word in the block's words."""
    var size: Int
    """Its words."""

    @always_inline
    def _word(self, i: Int) -> Int:
        """The block's word of the buffer's word `i`; emulated, -1 (out of
        every block's range, refused there) when `i` is outside it."""
        comptime if SHARED_CHECKED:
            if i < 0 or i >= self.size:
                return -1
        return self.start + i

    @always_inline
    def load(self, i: Int) -> UInt32:
        """Word `i`."""
        return self.s.load_at(call_location(), self._word(i), Self.name)

    @always_inline
    def load_at(self, site: SourceLocation, i: Int) -> UInt32:
        """Word `i`, recorded at `site` (a helper that loads for its
        callers passes its own `call_location()`)."""
        return self.s.load_at(site, self._word(i), Self.name)

    @always_inline
    def store(self, i: Int, value: UInt32):
        """Sets word `i`."""
        self.s.store_at(call_location(), self._word(i), value, Self.name)

    @always_inline
    def atomic_add(self, i: Int, value: UInt32) -> UInt32:
        """Adds `value` to word `i` atomically (relaxed); the old word."""
        return self.s.atomic_add_at(
            call_location(), self._word(i), value, Self.name
        )

    @always_inline
    def store_words[width: Int](self, i: Int, value: SIMD[DType.uint32, width]):
        """Stores words `i ..< i + width` (one vector store on a GPU; `i` a
        multiple of `width`)."""
        comptime if SHARED_CHECKED:
            if i + width > self.size:
                self.s.store_at(call_location(), -1, 0, Self.name)
                return
        self.s.store_words_at[width](
            call_location(), self._word(i), value, Self.name
        )

    @always_inline
    def load_f32x[width: Int](self, i: Int) -> SIMD[DType.float32, width]:
        """Words `i ..< i + width` as float32 lanes (one vector load on a
        GPU; `i` a multiple of `width`)."""
        comptime if SHARED_CHECKED:
            if i + width > self.size:
                _ = self.s.load_at(call_location(), -1, Self.name)
                return SIMD[DType.float32, width](0)
        return self.s.load_f32x_at[width](
            call_location(), self._word(i), Self.name
        )

    @always_inline
    def load_f32(self, i: Int) -> Float32:
        """Word `i` as a float32 bit pattern."""
        return bitcast[DType.float32, 1](
            self.s.load_at(call_location(), self._word(i), Self.name)
        )

    @always_inline
    def store_f32(self, i: Int, value: Float32):
        """Stores `value`'s bit pattern in word `i`."""
        self.s.store_at(
            call_location(),
            self._word(i),
            bitcast[DType.uint32, 1](value),
            Self.name,
        )
