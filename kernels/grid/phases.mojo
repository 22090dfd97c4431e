"""A phased kernel's phases, declared once: `Phases`.

A cooperative kernel (`gpu_kernel.GpuKernel`) runs its body in phases, a
block barrier after each. Its `phase_table` lists them in order, each with
its name and the collective that follows it (`NO_COLLECTIVE`: none). The
launcher and the emulator unroll the table, the collective after phase `p`
is `phase_table.collective(p)`, `gpu_kernel.phase_count` is its `count()`,
and the body dispatches on names:

    comptime SCAN_PHASES = Phases(
        Phase("count", BLOCK_EXCLUSIVE_SUM), Phase("write")
    )
    ...
    comptime if SCAN_PHASES.named(phase, "count"):

A phase that runs several times (a radix pass, a sort step, a pipelined
pair) is one entry with `times`, or a group `repeat`ed; `round(p)` says
which time phase `p` is. Tables join with `then` (the select's is its
split count's, a pick's, the sort's). A name the table lacks is a compile
error, so a misspelt name cannot silently match nothing.

Tables are compile-time values, read in `comptime` expressions only: a
table is not implicitly copyable, so a run-time read fails to compile
rather than putting a table in a kernel.
"""

from std.os import abort

from .collectives import NO_COLLECTIVE


struct Phase(ImplicitlyCopyable, Movable):
    """One entry of a phase table: a phase (or a run of phases that do the
    same thing) and the collective after each."""

    var name: StaticString
    """What the body dispatches on."""
    var collective: Int
    """The collective after the phase (`collectives.WARP_SUM`, ...)."""
    var times: Int
    """Phases of this entry, one after another (0: none)."""

    def __init__(
        out self,
        name: StaticString,
        collective: Int = NO_COLLECTIVE,
        *,
        times: Int = 1,
    ):
        """A phase `name` run `times` times, each followed by `collective`."""
        self.name = name
        self.collective = collective
        self.times = times


struct Phases(Copyable, Movable):
    """A kernel's phases in order (`GpuKernel.phase_table`)."""

    var entries: List[Phase]
    """The phases, each entry `times` of them."""

    def __init__(out self, *phases: Phase):
        """The table of `phases`, in order."""
        self.entries = List[Phase]()
        for p in phases:
            self.entries.append(p)

    def then(self, other: Self) -> Self:
        """This table's phases, then `other`'s."""
        var joined = self.copy()
        for e in other.entries:
            joined.entries.append(e)
        return joined^

    def repeat(self, n: Int) -> Self:
        """This table's phases `n` times over (a pass of several phases)."""
        var repeated = Phases()
        for _ in range(n):
            repeated = repeated.then(self)
        return repeated^

    def count(self) -> Int:
        """Phases in all."""
        var n = 0
        for e in self.entries:
            n += e.times
        return n

    def _entry(self, p: Int) -> Phase:
        """The entry phase `p` belongs to."""
        var i = p
        for e in self.entries:
            if i < e.times:
                return e
            i -= e.times
        abort(String("phase ", p, " is past the table's ", self.count()))

    def name(self, p: Int) -> StaticString:
        """Phase `p`'s name."""
        return self._entry(p).name

    def collective(self, p: Int) -> Int:
        """The collective after phase `p` (`NO_COLLECTIVE`: none)."""
        return self._entry(p).collective

    def has(self, name: StaticString) -> Bool:
        """Whether an entry is called `name` (run 0 times or more)."""
        for e in self.entries:
            if e.name == name:
                return True
        return False

    def named(self, p: Int, name: StaticString) -> Bool:
        """Whether phase `p` is called `name` (a compile error if no entry
        is: a misspelt name)."""
        if not self.has(name):
            abort(String("no phase is called '", name, "'"))
        return self.name(p) == name

    def index(self, name: StaticString) -> Int:
        """The first phase called `name` (a compile error if none is)."""
        for p in range(self.count()):
            if self.named(p, name):
                return p
        abort(String("no phase is called '", name, "'"))

    def round(self, p: Int) -> Int:
        """Which time phase `p`'s name runs: the phases called the same
        before it (a pass's number, a sort step's)."""
        var n = 0
        for q in range(p):
            if self.name(q) == self.name(p):
                n += 1
        return n
