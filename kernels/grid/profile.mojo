"""What an emulated launch would ask of a GPU's shared memory, by site.

`profile_kernel` (in `gpu_kernel`) runs a phased kernel over the emulated
grid as `emulate_kernel` does, with a `LaunchProfile` behind every
thread's `Shared` view: each load, store and atomic is recorded with its
site (the source location of the call, as `call_location` gives it),
thread, word and width. After each phase the records are grouped into
warp requests, as a GPU issues them: the `n`-th access of a site by each
thread of a warp is one request. For each request:

- **wavefronts**: shared memory serves 32 banks of 4 bytes at a time
  (128 bytes, one wavefront); a request of `w`-word accesses is served
  `32 / w` lanes at a time (a 16-byte access: a quarter of a 32-lane
  warp), and each such group takes as many wavefronts as the most
  distinct words any one bank holds among its lanes (lanes reading the
  same word share it, a broadcast); a wide load whose lane pairs agree
  serves twice the lanes a group (`request_counts`). A conflict-free
  request takes one wavefront per group; its **ways** are that
  most-loaded bank's count;
- **atomics**: the most lanes of the request on one word (they
  serialize on a GPU).

Per launch, `LaunchProfile` adds barriers, the critical path and the
busiest and idlest blocks. These are the counts Nsight Compute reports as
shared wavefronts per request and bank conflicts, computed the way its
documentation defines them; the emulation knows no timing.

Only host code records (the GPU build of every kernel has no recording
code: `BlockShared` compiles it under `not is_gpu()`), and only when a
launch asks (`profile_kernel`); `emulate_kernel` passes no profile.
"""

from std.collections import Dict
from std.bit import pop_count
from std.math import max, min
from std.reflection import SourceLocation

comptime BANKS = 32
"""Shared-memory banks (NVIDIA since Kepler; AMD's LDS on CDNA 3)."""

comptime MAX_ACCESS_WORDS = 4
"""The widest shared access one instruction makes (16 bytes: `LDS.128`,
`ds_read_b128`)."""

comptime SECTOR_BYTES = 32
"""The unit global memory moves between L2 and an SM (a sector; NVIDIA
since Volta, and a 64-byte line's half on CDNA 3, counted the same)."""

comptime ACCESS_LOAD = 0
comptime ACCESS_STORE = 1
comptime ACCESS_ATOMIC = 2


def access_name(kind: Int) -> String:
    """`load`, `store` or `atomic`."""
    if kind == ACCESS_LOAD:
        return "load"
    if kind == ACCESS_STORE:
        return "store"
    return "atomic"


def site_name(location: String) -> String:
    """A source location as the profile names it: from `kernels/` for the
    package's own files (`kernels/index/gpu/pick.mojo:218:20`), else
    the file's name and place."""
    var at = location.rfind("/kernels/")
    if at >= 0:
        return String(location[byte = at + 1 :])
    var slash = location.rfind("/")
    return String(location[byte = slash + 1 :])


@fieldwise_init
struct Access(Copyable, Movable):
    """One thread's shared access in the phase being recorded."""

    var thread: Int
    var site: Int
    var word: Int
    var width: Int


@fieldwise_init
struct SiteCounts(Copyable, Movable):
    """One site's requests over a launch."""

    var name: String
    """`file.mojo:line:column` of the access."""
    var buffer: String
    """The named shared buffer it accesses (`shared_buffer`), or ""."""
    var kind: Int
    """`ACCESS_LOAD`, `ACCESS_STORE` or `ACCESS_ATOMIC`."""
    var width: Int
    """Words per lane (1, 2 or 4)."""
    var requests: Int
    var wavefronts: Int
    var ideal_wavefronts: Int
    """Wavefronts the same requests take without a bank conflict."""
    var worst_ways: Int
    """The most distinct words on one bank in one wavefront group."""
    var max_lanes_per_address: Int
    """Atomics: the most lanes of one request on one word."""
    var atomic_lanes: Int
    """Atomics: lanes summed over requests (mean lanes per address is
    `atomic_lanes / atomic_addresses`)."""
    var atomic_addresses: Int


@fieldwise_init
struct GlobalAccess(Copyable, Movable):
    """One thread's global access in the phase being recorded."""

    var thread: Int
    var site: Int
    var address: Int
    var bytes: Int


@fieldwise_init
struct GlobalSite(Copyable, Movable):
    """One global-memory site's requests over a launch."""

    var name: String
    """`file.mojo:line:column` of the access."""
    var kind: Int
    """`ACCESS_LOAD` or `ACCESS_STORE`."""
    var bytes: Int
    """Bytes per lane."""
    var requests: Int
    var sectors: Int
    """32-byte sectors the requests touched (each request's distinct ones)."""
    var bytes_requested: Int
    """Distinct bytes each request asked for, summed: sector efficiency
    is `bytes_requested / (32 * sectors)`."""
    var uniform_requests: Int
    """Requests whose lanes all read or wrote the same bytes (a value
    every thread of the warp needs: one sector, served once)."""
    var uniform_sectors: Int
    var uniform_bytes: Int


def request_sectors(addresses: List[Int], bytes: Int) -> Int:
    """The distinct 32-byte sectors one warp request touches, its lanes
    reading or writing `bytes` bytes from each of `addresses`."""
    var seen = Dict[Int, Bool]()
    for a in addresses:
        for sector in range(
            a // SECTOR_BYTES, (a + bytes - 1) // SECTOR_BYTES + 1
        ):
            seen[sector] = True
    return len(seen)


def request_bytes(addresses: List[Int], bytes: Int) -> Int:
    """The distinct bytes one warp request asks for: lanes on the same
    bytes (a broadcast) ask for them once, as Nsight Compute counts the
    sector bytes a request uses."""
    var seen = Dict[Int, Bool]()
    for a in addresses:
        for b in range(a, a + bytes):
            seen[b] = True
    return len(seen)


struct RequestCounts(Copyable, Movable):
    """Wavefronts, ideal wavefronts, ways and atomic lanes of one request."""

    var wavefronts: Int
    var ideal: Int
    var ways: Int
    var max_lanes: Int
    var addresses: Int
    var lanes: Int

    def __init__(out self):
        self.wavefronts = 0
        self.ideal = 0
        self.ways = 0
        self.max_lanes = 0
        self.addresses = 0
        self.lanes = 0


def lanes_paired(lanes: List[Int], words: List[Int]) -> Bool:
    """Whether every lane's partner `n ^ 1`, or every lane's partner
    `n ^ 2`, is in the request on the same word."""
    var word_of = Dict[Int, Int]()
    for a in range(len(lanes)):
        word_of[lanes[a]] = words[a]
    for mask in [1, 2]:
        var paired = True
        for entry in word_of.items():
            if word_of.get(entry.key ^ mask, -1) != entry.value:
                paired = False
                break
        if paired:
            return True
    return False


def request_counts(
    lanes: List[Int],
    words: List[Int],
    width: Int,
    warp: Int,
    kind: Int = ACCESS_STORE,
) -> RequestCounts:
    """What one warp request costs shared memory.

    A wide load on a 32-lane warp whose lanes pair up on one address
    (`n` and `n ^ 1`, or `n` and `n ^ 2`, for every lane: a broadcast
    included) returns two lanes' registers at once, so twice the lanes
    share a wavefront (NVIDIA's rule for `LDS.64`/`LDS.128`, stated for
    compute capability 7.x on its developer forum, "Unexpected shared
    memory bank conflict", 2019; taken to hold on Hopper, unmeasured).

    Args:
        lanes: Each access's lane in its warp (`thread % warp`).
        words: Each access's first word (its `width` words follow).
        width: Words per access (1, 2 or 4).
        warp: Lanes per warp (32 on NVIDIA, 64 on AMD).
        kind: `ACCESS_LOAD`, `ACCESS_STORE` or `ACCESS_ATOMIC`.

    Returns:
        Wavefronts (summed over the groups of `BANKS / width` lanes a
        wavefront serves), the ideal (one per group with an access), the
        worst ways and, counting accesses to one word, the most lanes on
        one word, the distinct words and the lanes.
    """
    var out = RequestCounts()
    var per_group = max(BANKS // max(width, 1), 1)
    if (
        kind == ACCESS_LOAD
        and width > 1
        and warp == 32
        and lanes_paired(lanes, words)
    ):
        per_group *= 2
    var groups = (warp + per_group - 1) // per_group
    for g in range(groups):
        # bank -> distinct first words of the accesses on it.
        var banks = Dict[Int, List[Int]]()
        var any = False
        for a in range(len(lanes)):
            if lanes[a] // per_group != g:
                continue
            any = True
            for w in range(width):
                var word = words[a] + w
                var bank = word % BANKS
                if bank not in banks:
                    banks[bank] = List[Int]()
                try:
                    if word not in banks[bank]:
                        banks[bank].append(word)
                except:
                    pass
        if not any:
            continue
        var most = 1
        for entry in banks.items():
            most = max(most, len(entry.value))
        out.wavefronts += most
        out.ideal += 1
        out.ways = max(out.ways, most)
    var seen = Dict[Int, Int]()
    for a in range(len(words)):
        seen[words[a]] = seen.get(words[a], 0) + 1
    for entry in seen.items():
        out.max_lanes = max(out.max_lanes, entry.value)
    out.addresses = len(seen)
    out.lanes = len(words)
    return out^


def warp_requests(
    threads: List[Int], sites: List[Int], warp: Int
) -> List[List[Int]]:
    """A phase's accesses (access `a` by thread `threads[a]` at site
    `sites[a]`, in program order) grouped into warp requests, as a GPU
    issues them: the `n`-th access of a site by each thread of a warp is
    one request. Each request lists its accesses, requests in the order
    their first access came."""
    # (thread, site) -> accesses so far; request key -> its index.
    var seen = Dict[Int, Int]()
    var index = Dict[Int, Int]()
    var out = List[List[Int]]()
    var site_count = 1
    for site in sites:
        site_count = max(site_count, site + 1)
    for a in range(len(threads)):
        var mine = threads[a] * site_count + sites[a]
        var n = seen.get(mine, 0)
        seen[mine] = n + 1
        var key = (n * site_count + sites[a]) * 65536 + threads[a] // warp
        var at = index.get(key, -1)
        if at < 0:
            at = len(out)
            index[key] = at
            out.append(List[Int]())
        out[at].append(a)
    return out^


struct LaunchProfile(Movable):
    """A launch's shared-memory profile, filled by the emulation.

    `record` is called by `BlockShared` for every access; the emulation
    calls `close_phase` after each phase of each block and
    `close_block` after each block.

    Per launch: blocks and phases (a barrier after each phase but the
    last), the per-phase critical path (the most shared accesses any one
    thread made in that phase, over every block) and the accesses of the
    busiest and the idlest block.
    """

    var kernel: String
    var warp: Int
    var sites: List[SiteCounts]
    var site_ids: Dict[String, Int]
    var pending: List[Access]
    var global_sites: List[GlobalSite]
    var global_ids: Dict[String, Int]
    var global_pending: List[GlobalAccess]
    var read_bytes: Dict[Int, UInt32]
    """Sector -> the bytes of it read (a bit each): distinct bytes read."""
    var written_bytes: Dict[Int, UInt32]
    """Sector -> the bytes of it written."""
    var grid: Int
    """Blocks of the launch (`blocks` of them emulated)."""
    var blocks: Int
    var phases: Int
    var phase_path: List[Int]
    """Per phase: the most shared accesses one thread made, over blocks."""
    var phase_global: List[Int]
    """Per phase: the most global accesses one thread made, over blocks."""
    var phase_cold: List[Int]
    """Per phase: the most global accesses one thread made that touched a
    sector its block had not (a miss of an L1 that kept all the block's
    sectors), over blocks."""
    var block_sectors: Dict[Int, Bool]
    """The sectors the block being emulated has touched."""
    var cold_sectors: Int
    """Sectors first touched by their block, over the launch's blocks."""
    var block_threads: Int
    var shared_bytes: Int
    """Shared memory a block of the launch uses."""
    var block_accesses: Int
    var busiest_block: Int
    var idlest_block: Int

    def __init__(
        out self,
        kernel: String,
        warp: Int,
        phases: Int,
        grid: Int,
        block_threads: Int = 0,
        shared_bytes: Int = 0,
    ):
        """An empty profile of a launch of `grid` blocks of `kernel`, in
        warps of `warp` lanes (`block_threads` threads and `shared_bytes`
        of shared memory a block)."""
        self.block_threads = block_threads
        self.shared_bytes = shared_bytes
        self.kernel = kernel
        self.warp = warp
        self.grid = grid
        self.sites = List[SiteCounts]()
        self.site_ids = Dict[String, Int]()
        self.pending = List[Access]()
        self.global_sites = List[GlobalSite]()
        self.global_ids = Dict[String, Int]()
        self.global_pending = List[GlobalAccess]()
        self.read_bytes = Dict[Int, UInt32]()
        self.written_bytes = Dict[Int, UInt32]()
        self.blocks = 0
        self.phases = phases
        self.phase_path = List[Int](length=phases, fill=0)
        self.phase_global = List[Int](length=phases, fill=0)
        self.phase_cold = List[Int](length=phases, fill=0)
        self.block_sectors = Dict[Int, Bool]()
        self.cold_sectors = 0
        self.block_accesses = 0
        self.busiest_block = 0
        self.idlest_block = -1

    def record(
        mut self,
        site: SourceLocation,
        kind: Int,
        thread: Int,
        word: Int,
        width: Int,
        buffer: StaticString = "",
    ):
        """Notes one access of `width` words at `word` by `thread` (of the
        named `buffer`, if any).

        A vector wider than 16 bytes is the instructions a GPU runs for it:
        one access of `MAX_ACCESS_WORDS` words each.
        """
        if width > MAX_ACCESS_WORDS:
            for w in range(0, width, MAX_ACCESS_WORDS):
                self.record(
                    site, kind, thread, word + w, MAX_ACCESS_WORDS, buffer
                )
            return
        var name = site_name(String(site))
        var id = self.site_ids.get(name, -1)
        if id < 0:
            id = len(self.sites)
            self.site_ids[name] = id
            self.sites.append(
                SiteCounts(
                    name^, String(buffer), kind, width, 0, 0, 0, 0, 0, 0, 0
                )
            )
        self.pending.append(Access(thread, id, word, width))

    def record_global(
        mut self,
        site: SourceLocation,
        kind: Int,
        thread: Int,
        address: Int,
        bytes: Int,
    ):
        """Notes one global access of `bytes` bytes at `address` by
        `thread`, and the bytes it touches among the launch's distinct
        bytes read or written.

        An access wider than 16 bytes is the instructions a GPU runs for
        it: one access of `4 * MAX_ACCESS_WORDS` bytes each, as `record`
        counts shared ones.
        """
        comptime most = 4 * MAX_ACCESS_WORDS
        if bytes > most:
            for b in range(0, bytes, most):
                self.record_global(
                    site, kind, thread, address + b, min(most, bytes - b)
                )
            return
        var name = site_name(String(site))
        var id = self.global_ids.get(name, -1)
        if id < 0:
            id = len(self.global_sites)
            self.global_ids[name] = id
            self.global_sites.append(
                GlobalSite(name^, kind, bytes, 0, 0, 0, 0, 0, 0)
            )
        self.global_pending.append(GlobalAccess(thread, id, address, bytes))
        for b in range(address, address + bytes):
            var sector = b // SECTOR_BYTES
            var bit = UInt32(1) << UInt32(b % SECTOR_BYTES)
            if kind == ACCESS_STORE:
                self.written_bytes[sector] = (
                    self.written_bytes.get(sector, 0) | bit
                )
            else:
                self.read_bytes[sector] = self.read_bytes.get(sector, 0) | bit

    def _close_global_phase(mut self, phase: Int):
        """Folds the phase's global accesses into warp requests (as
        `close_phase` does the shared ones)."""
        var per_thread = Dict[Int, Int]()
        var cold = Dict[Int, Int]()
        for access in self.global_pending:
            per_thread[access.thread] = per_thread.get(access.thread, 0) + 1
            var new = 0
            for sector in range(
                access.address // SECTOR_BYTES,
                (access.address + access.bytes - 1) // SECTOR_BYTES + 1,
            ):
                if sector not in self.block_sectors:
                    self.block_sectors[sector] = True
                    new += 1
            if new:
                self.cold_sectors += new
                cold[access.thread] = cold.get(access.thread, 0) + 1
        for entry in per_thread.items():
            self.phase_global[phase] = max(
                self.phase_global[phase], entry.value
            )
        for entry in cold.items():
            self.phase_cold[phase] = max(self.phase_cold[phase], entry.value)
        var threads = List[Int]()
        var sites = List[Int]()
        for access in self.global_pending:
            threads.append(access.thread)
            sites.append(access.site)
        for members in warp_requests(threads, sites, self.warp):
            var addresses = List[Int]()
            ref first = self.global_pending[members[0]]
            for m in members:
                addresses.append(self.global_pending[m].address)
            ref g = self.global_sites[first.site]
            var sectors = request_sectors(addresses, first.bytes)
            var asked = request_bytes(addresses, first.bytes)
            g.requests += 1
            g.sectors += sectors
            g.bytes_requested += asked
            if asked == first.bytes:
                g.uniform_requests += 1
                g.uniform_sectors += sectors
                g.uniform_bytes += asked
        self.global_pending.clear()

    def close_phase(mut self, phase: Int):
        """Folds the phase's accesses into warp requests, then forgets them.

        The `n`-th access of a site by each thread of a warp is one
        request (threads of a warp run the same instruction stream).
        """
        var per_thread = Dict[Int, Int]()
        var threads = List[Int]()
        var sites = List[Int]()
        for access in self.pending:
            per_thread[access.thread] = per_thread.get(access.thread, 0) + 1
            threads.append(access.thread)
            sites.append(access.site)
        for members in warp_requests(threads, sites, self.warp):
            var lanes = List[Int]()
            var words = List[Int]()
            var site = self.pending[members[0]].site
            var width = self.pending[members[0]].width
            for m in members:
                lanes.append(self.pending[m].thread % self.warp)
                words.append(self.pending[m].word)
            ref s = self.sites[site]
            var c = request_counts(lanes, words, width, self.warp, s.kind)
            s.requests += 1
            s.wavefronts += c.wavefronts
            s.ideal_wavefronts += c.ideal
            s.worst_ways = max(s.worst_ways, c.ways)
            if s.kind == ACCESS_ATOMIC:
                s.max_lanes_per_address = max(
                    s.max_lanes_per_address, c.max_lanes
                )
                s.atomic_lanes += c.lanes
                s.atomic_addresses += c.addresses
        var most = 0
        for entry in per_thread.items():
            most = max(most, entry.value)
        self.phase_path[phase] = max(self.phase_path[phase], most)
        self.block_accesses += len(self.pending)
        self.pending.clear()
        self._close_global_phase(phase)

    def close_block(mut self):
        """Counts the block just emulated and its accesses."""
        self.blocks += 1
        self.busiest_block = max(self.busiest_block, self.block_accesses)
        if self.idlest_block < 0:
            self.idlest_block = self.block_accesses
        else:
            self.idlest_block = min(self.idlest_block, self.block_accesses)
        self.block_accesses = 0
        self.block_sectors.clear()

    def json(self) -> String:
        """The profile as one JSON object (one line)."""
        var requests = 0
        var wavefronts = 0
        for s in self.sites:
            requests += s.requests
            wavefronts += s.wavefronts
        var out = String(
            '{"kernel": "',
            self.kernel,
            '", "warp": ',
            self.warp,
            ', "grid": ',
            self.grid,
            ', "blocks": ',
            self.blocks,
            ', "sampled_blocks": ',
            self.blocks if self.blocks < self.grid else 0,
            ', "phases": ',
            self.phases,
            ', "barriers_per_block": ',
            max(self.phases - 1, 0),
            ', "block_threads": ',
            self.block_threads,
            ', "shared_bytes": ',
            self.shared_bytes,
            ', "phase_path": [',
        )
        for p in range(len(self.phase_path)):
            out += String(", " if p else "", self.phase_path[p])
        out += '], "phase_global": ['
        for p in range(len(self.phase_global)):
            out += String(", " if p else "", self.phase_global[p])
        out += '], "phase_cold": ['
        for p in range(len(self.phase_cold)):
            out += String(", " if p else "", self.phase_cold[p])
        out += String(
            '], "busiest_block_accesses": ',
            self.busiest_block,
            ', "idlest_block_accesses": ',
            max(self.idlest_block, 0),
            ', "shared": {"requests": ',
            requests,
            ', "wavefronts": ',
            wavefronts,
            ', "sites": [',
        )
        for i in range(len(self.sites)):
            ref s = self.sites[i]
            out += String(
                ", " if i else "",
                '{"site": "',
                s.name,
                '", "buffer": "',
                s.buffer,
                '", "access": "',
                access_name(s.kind),
                '", "width_words": ',
                s.width,
                ', "requests": ',
                s.requests,
                ', "wavefronts": ',
                s.wavefronts,
                ', "ideal_wavefronts": ',
                s.ideal_wavefronts,
                ', "ways": ',
                s.worst_ways,
                ', "max_lanes_per_address": ',
                s.max_lanes_per_address,
                ', "atomic_lanes": ',
                s.atomic_lanes,
                ', "atomic_addresses": ',
                s.atomic_addresses,
                "}",
            )
        out += "]}, "
        out += self._global_json()
        out += "}"
        return out^

    def _global_json(self) -> String:
        """`"global": {...}`: requests, sectors, bytes asked for, distinct
        bytes read and written, and per site the same."""
        var requests = 0
        var sectors = 0
        var requested = 0
        for g in self.global_sites:
            requests += g.requests
            sectors += g.sectors
            requested += g.bytes_requested
        var read = 0
        for entry in self.read_bytes.items():
            read += Int(pop_count(entry.value))
        var written = 0
        for entry in self.written_bytes.items():
            written += Int(pop_count(entry.value))
        var out = String(
            '"global": {"requests": ',
            requests,
            ', "sectors": ',
            sectors,
            ', "cold_sectors": ',
            self.cold_sectors,
            ', "bytes_requested": ',
            requested,
            ', "bytes_read": ',
            read,
            ', "bytes_written": ',
            written,
            ', "sites": [',
        )
        for i in range(len(self.global_sites)):
            ref g = self.global_sites[i]
            out += String(
                ", " if i else "",
                '{"site": "',
                g.name,
                '", "access": "',
                access_name(g.kind),
                '", "bytes_per_lane": ',
                g.bytes,
                ', "requests": ',
                g.requests,
                ', "sectors": ',
                g.sectors,
                ', "bytes_requested": ',
                g.bytes_requested,
                ', "uniform_requests": ',
                g.uniform_requests,
                ', "uniform_sectors": ',
                g.uniform_sectors,
                ', "uniform_bytes": ',
                g.uniform_bytes,
                "}",
            )
        out += "]}"
        return out^
