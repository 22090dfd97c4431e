"""Facts read from compiled kernel code: PTX, ``ptxas -v`` and AMDGPU asm.

Everything here is text parsing with no tool run, so the tests can feed it
both the report's files and fabricated snippets.

- PTX (``sm_*``): the ``.entry`` symbols, each entry's parameter block (the
  ``.param`` declarations laid out with their sizes and alignments, as the
  CUDA driver packs kernel arguments), its static ``.shared`` bytes, and
  :func:`ptx_facts`, the instructions of interest (local memory, ``cvt``,
  global load widths).
- ``ptxas -v`` output: registers, barriers, stack, spills and shared memory
  per entry (:func:`parse_ptxas`).
- AMDGPU assembly (``gfx*``): the ``.amdhsa_*`` kernel descriptor and the
  code object metadata (:func:`amd_kernels`).
- Memory instructions by barrier segment, kind and width in SASS or
  AMDGPU assembly (:func:`memory_ops`).
- Out-of-line calls in the code of a kernel and the functions it calls:
  :func:`amd_calls`, :func:`sass_calls` (and the calls to ptxas's own
  division subroutines, :func:`sass_subroutine_calls`), :func:`ptx_calls`.
"""

from __future__ import annotations

import re
from collections import Counter

#: Bytes of one element of a PTX ``.param``/``.shared`` type.
_PTX_TYPE_BYTES = {
    "b8": 1, "u8": 1, "s8": 1,
    "b16": 2, "u16": 2, "s16": 2, "f16": 2, "bf16": 2,
    "b32": 4, "u32": 4, "s32": 4, "f32": 4,
    "b64": 8, "u64": 8, "s64": 8, "f64": 8,
}  # fmt: skip

_ENTRY = re.compile(
    r"^\s*(?:\.visible\s+|\.weak\s+)?\.entry\s+(\S+?)\s*\(", re.M
)
_PARAM = re.compile(
    r"\.param\s+(?:\.align\s+(\d+)\s+)?\.(\w+)\s+\S+?(?:\[(\d+)\])?\s*[,)]?$"
)
_SHARED = re.compile(
    r"^\s*\.shared\s+(?:\.align\s+(\d+)\s+)?\.(\w+)\s+\S+?(?:\[(\d+)\])?;",
    re.M,
)


def ptx_entries(ptx: str) -> list[str]:
    """The ``.entry`` symbols of a PTX module, in order."""
    return _ENTRY.findall(ptx)


def ptx_entry_text(ptx: str, entry: str) -> str:
    """One entry's text, from its ``.entry`` line to the next entry.

    Raises:
        KeyError: If ``ptx`` has no entry ``entry``.
    """
    starts = [(m.group(1), m.start()) for m in _ENTRY.finditer(ptx)]
    for i, (name, start) in enumerate(starts):
        if name == entry:
            end = starts[i + 1][1] if i + 1 < len(starts) else len(ptx)
            return ptx[start:end]
    raise KeyError(f"no .entry {entry} in the PTX")


def _align(offset: int, alignment: int) -> int:
    return -(-offset // alignment) * alignment


def ptx_param_bytes(ptx: str, entry: str) -> int:
    """Bytes of ``entry``'s parameter block.

    Each ``.param`` is placed at the next multiple of its alignment (its
    ``.align``, else its element size) and the block ends after the last,
    which is how the driver packs a launch's arguments.

    Raises:
        KeyError: If there is no such entry.
        ValueError: For a parameter type this parser does not know.
    """
    text = ptx_entry_text(ptx, entry)
    header = text[text.index("(") + 1 : text.index(")")]
    offset = 0
    for line in header.splitlines():
        m = _PARAM.search(line.strip())
        if m is None:
            continue
        align, kind, count = m.groups()
        if kind not in _PTX_TYPE_BYTES:
            raise ValueError(f"{entry}: unknown .param type .{kind}")
        size = _PTX_TYPE_BYTES[kind] * int(count or 1)
        offset = _align(offset, int(align or _PTX_TYPE_BYTES[kind])) + size
    return offset


def ptx_shared_bytes(ptx: str, entry: str) -> int:
    """Static ``.shared`` bytes declared in ``entry``'s body."""
    total = 0
    for align, kind, count in _SHARED.findall(ptx_entry_text(ptx, entry)):
        size = _PTX_TYPE_BYTES.get(kind, 1) * int(count or 1)
        total = _align(total, int(align or 1)) + size
    return total


_LOCAL = re.compile(r"\b((?:ld|st)\.local[\w.]*)")
_CVT = re.compile(r"\b(cvt(?:\.[\w]+)+)")
_LD_GLOBAL = re.compile(r"\b(ld\.global(?:\.[\w]+)+)")
_TENSOR = re.compile(r"\b((?:wgmma\.mma_async|mma\.sync)(?:\.[\w]+)+)")


def ptx_facts(ptx: str, entry: str) -> dict[str, dict[str, int]]:
    """The instructions of ``entry`` that tell how it uses memory and FP8.

    Args:
        ptx: The PTX module.
        entry: An ``.entry`` symbol of it.

    Returns:
        ``{"local": ..., "cvt": ..., "global_loads": ..., "tensor": ...}``,
        each a dict of
        instruction (with its type suffixes, e.g. ``ld.global.nc.v2.u32``
        or ``cvt.rn.f16x2.e4m3x2``) -> occurrences in the entry's text:
        local-memory loads and stores (spills or stack arrays), conversions
        (a hardware FP8 decode is a ``cvt`` from ``e4m3x2``), and global
        loads, whose suffix gives the width (``.u8`` is a byte at a time,
        ``.v2.u32`` / ``.u64`` eight bytes), and tensor-core instructions
        (``wgmma.mma_async...`` with its shape and types, ``mma.sync...``).

    Raises:
        KeyError: If there is no such entry.
    """
    text = ptx_entry_text(ptx, entry)
    return {
        "local": dict(Counter(_LOCAL.findall(text))),
        "cvt": dict(Counter(_CVT.findall(text))),
        "global_loads": dict(Counter(_LD_GLOBAL.findall(text))),
        "tensor": dict(Counter(_TENSOR.findall(text))),
    }


_PTXAS_ENTRY = re.compile(r"Compiling entry function '([^']+)'")
_PTXAS_FRAME = re.compile(
    r"(\d+) bytes stack frame, (\d+) bytes spill stores, "
    r"(\d+) bytes spill loads"
)
_PTXAS_USED = re.compile(r"Used (\d+) registers")
_PTXAS_BARRIERS = re.compile(r"used (\d+) barriers")
_PTXAS_SMEM = re.compile(r"(\d+) bytes smem")
#: A performance advisory: ``(C7518) Potential Performance Loss: ... in the
#: function 'name' ...`` or ``(C7517) ... in function 'name'``.
_PTXAS_ADVISORY = re.compile(
    r"\((C\d{4})\)\s*(.*?)\s*in (?:the )?function '([^']+)'"
)


def ptxas_advisories(output: str) -> dict[str, list[str]]:
    """The performance advisories ``ptxas`` printed, per function.

    ``ptxas`` explains code it had to slow down (serialized ``wgmma``,
    a wait it injected, ...) in numbered info lines (``C75xx``); a fast
    kernel has none.

    Returns:
        Function symbol -> ``"C7518: <what ptxas says>"`` per advisory, in
        the order printed; functions without any are absent.
    """
    found: dict[str, list[str]] = {}
    for m in _PTXAS_ADVISORY.finditer(output):
        code, text, function = m.groups()
        found.setdefault(function, []).append(f"{code}: {text}")
    return found


def parse_ptxas(output: str) -> dict[str, dict[str, int]]:
    """Per entry facts from ``ptxas -v`` output.

    Returns:
        Entry symbol -> ``registers``, ``barriers``, ``stack_bytes``,
        ``spill_store_bytes``, ``spill_load_bytes`` and ``shared_bytes``
        (static shared memory; 0 when ptxas prints no ``smem``). Lines about
        called functions (not entries) are not counted.
    """
    facts: dict[str, dict[str, int]] = {}
    current: dict[str, int] | None = None
    for line in output.splitlines():
        m = _PTXAS_ENTRY.search(line)
        if m:
            current = facts.setdefault(
                m.group(1), {"barriers": 0, "shared_bytes": 0}
            )
            continue
        if "Function properties for" in line and current is not None:
            name = line.rsplit("for", 1)[1].strip()
            if name not in facts:
                current = None  # a callee's properties, not the entry's
            continue
        if current is None:
            continue
        if m := _PTXAS_FRAME.search(line):
            frame = ("stack_bytes", "spill_store_bytes", "spill_load_bytes")
            for key, value in zip(frame, m.groups(), strict=True):
                current.setdefault(key, int(value))
        if m := _PTXAS_USED.search(line):
            current["registers"] = int(m.group(1))
            if b := _PTXAS_BARRIERS.search(line):
                current["barriers"] = int(b.group(1))
            if s := _PTXAS_SMEM.search(line):
                current["shared_bytes"] = int(s.group(1))
    return facts


_AMD_KERNEL = re.compile(
    r"^\s*\.amdhsa_kernel\s+(\S+)(.*?)^\s*\.end_amdhsa_kernel", re.M | re.S
)
_AMD_FIELD = re.compile(r"^\s*\.amdhsa_(\w+)\s+(-?\d+)", re.M)


def _metadata_kernels(asm: str) -> dict[str, str]:
    """Kernel name -> its block of the code object metadata (YAML)."""
    start = asm.find("amdhsa.kernels:")
    if start < 0:
        return {}
    end = asm.find(".end_amdgpu_metadata", start)
    body = asm[start : end if end > 0 else len(asm)]
    blocks: dict[str, str] = {}
    # A kernel's entry starts at two spaces of indent: `  - .agpr_count: 0`.
    for chunk in re.split(r"^  - ", body, flags=re.M)[1:]:
        if m := re.search(r"^\s*\.name:\s+(\S+)", chunk, re.M):
            blocks[m.group(1)] = chunk
    return blocks


def _explicit_kernarg_bytes(meta: str) -> int | None:
    """End of the last non-hidden argument in a kernel's metadata."""
    end = None
    args = re.findall(
        r"\.offset:\s+(\d+)\s+\.size:\s+(\d+)\s+\.value_kind:\s+(\w+)", meta
    )
    for offset, size, kind in args:
        if not kind.startswith("hidden_"):
            end = max(end or 0, int(offset) + int(size))
    return end


def _meta_int(meta: str, key: str) -> int | None:
    m = re.search(rf"^\s*\.{key}:\s+(\d+)", meta, re.M)
    return int(m.group(1)) if m else None


def amd_kernels(asm: str) -> dict[str, dict[str, int]]:
    """Per kernel facts from AMDGPU assembly.

    Returns:
        Kernel symbol -> ``registers`` (``.amdhsa_next_free_vgpr``, the
        VGPRs the kernel descriptor asks the dispatcher for: on gfx90a and
        gfx942 the unified file, architectural VGPRs up to
        ``.amdhsa_accum_offset`` then AGPRs, which LLVM may reserve even
        when the metadata counts none), ``vgpr_count`` and ``agprs`` (the
        metadata's ``.vgpr_count`` and ``.agpr_count``), ``sgprs``
        (metadata ``.sgpr_count``, else ``.amdhsa_next_free_sgpr``),
        ``shared_bytes`` (``.amdhsa_group_segment_fixed_size``, LDS),
        ``private_bytes`` (``.amdhsa_private_segment_fixed_size``, scratch
        per lane: spills and stack), ``vgpr_spills`` and ``sgpr_spills``
        (the metadata's ``.vgpr_spill_count`` and ``.sgpr_spill_count``:
        registers spilled, 0 when the metadata has no such field),
        ``kernarg_bytes``
        (``.amdhsa_kernarg_size``, hidden arguments included) and
        ``param_bytes`` (the explicit arguments only: the end of the last
        metadata ``.args`` entry whose kind is not ``hidden_*``).
    """
    meta = _metadata_kernels(asm)
    out: dict[str, dict[str, int]] = {}
    for name, body in _AMD_KERNEL.findall(asm):
        f = {k: int(v) for k, v in _AMD_FIELD.findall(body)}
        m = meta.get(name, "")
        vgprs = f.get("next_free_vgpr", 0)
        kernarg = f.get("kernarg_size", 0)
        explicit = _explicit_kernarg_bytes(m)
        out[name] = {
            "registers": vgprs,
            "vgpr_count": _meta_int(m, "vgpr_count") or vgprs,
            "agprs": _meta_int(m, "agpr_count") or 0,
            "sgprs": _meta_int(m, "sgpr_count") or f.get("next_free_sgpr", 0),
            "shared_bytes": f.get("group_segment_fixed_size", 0),
            "private_bytes": f.get("private_segment_fixed_size", 0),
            "vgpr_spills": _meta_int(m, "vgpr_spill_count") or 0,
            "sgpr_spills": _meta_int(m, "sgpr_spill_count") or 0,
            "kernarg_bytes": kernarg,
            "param_bytes": kernarg if explicit is None else explicit,
        }
    return out


#: Matrix (tensor-core) instructions, by their SASS and AMDGPU mnemonics:
#: Hopper's warpgroup FP8 and half MMAs, warp-level half MMAs, FP8 warp
#: MMAs (sm_89, sm_120), and AMD's MFMAs.
_MATRIX = re.compile(r"\b(QGMMA|HGMMA|HMMA|QMMA|v_mfma_\w+)\b")
#: Scalar FP32 fused multiply-adds: SASS ``FFMA``, AMD ``v_fma_f32`` /
#: ``v_fmac_f32`` (and their packed ``v_pk_fma_f32``).
_FMA = re.compile(r"\b(FFMA|v_fmac?_f32|v_pk_fma_f32)\b")


def machine_ops(code: str) -> dict[str, dict[str, int]]:
    """Static counts of matrix instructions and FP32 FMAs in machine code.

    Args:
        code: SASS (``nvdisasm``'s listing of one kernel's cubin) or AMDGPU
            assembly (one kernel's ``.s``).

    Returns:
        ``{"matrix": {mnemonic: count}, "fma": {mnemonic: count}}``: each
        instruction as often as it appears in the code (a loop body
        counts once), e.g. ``{"QGMMA": 4}`` or
        ``{"v_mfma_f32_16x16x32_fp8_fp8": 4}``.
    """
    return {
        "matrix": dict(Counter(_MATRIX.findall(code))),
        "fma": dict(Counter(_FMA.findall(code))),
    }


#: One SASS instruction line of ``nvdisasm``'s listing: its address
#: comment, an optional predicate, the mnemonic.
_SASS_INSTRUCTION = re.compile(
    r"^\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", re.M
)
#: One AMDGPU instruction line: an indented lowercase mnemonic.
_AMD_INSTRUCTION = re.compile(r"^\s+([a-z][a-z0-9_]*)\b", re.M)
#: SASS memory mnemonics (the part before the first dot).
_SASS_MEMORY = {
    "LDG", "STG", "LDS", "STS", "LDL", "STL", "LD", "ST", "LDSM",
    "ATOMS", "ATOMG", "ATOM", "RED", "LDGSTS",
}  # fmt: skip
#: SASS access widths by suffix (32 bits without one).
_SASS_WIDTH = {
    ".128": 128,
    ".64": 64,
    ".U8": 8,
    ".S8": 8,
    ".U16": 16,
    ".S16": 16,
}
#: AMDGPU memory instruction prefixes and the name the counts give them.
_AMD_MEMORY = (
    ("global_atomic", "global_atomic"),
    ("global_load", "global_load"),
    ("global_store", "global_store"),
    ("ds_read2", "ds_read2"),
    ("ds_write2", "ds_write2"),
    ("ds_read", "ds_read"),
    ("ds_write", "ds_write"),
    ("ds_bpermute", "ds_permute"),
    ("ds_permute", "ds_permute"),
    ("ds_", "ds_atomic"),
    ("scratch_", "local"),
    ("buffer_load", "local"),
    ("buffer_store", "local"),
)
_AMD_WIDTH = re.compile(r"(?:dwordx(\d)|dword|b(\d+)|[ui](8|16))$")


def _sass_op(mnemonic: str) -> str | None:
    base = mnemonic.split(".", 1)[0]
    if base not in _SASS_MEMORY:
        return None
    if base in ("ATOMS", "ATOMG", "ATOM", "RED"):
        return base
    rest = mnemonic[len(base) :]
    width = next((w for sfx, w in _SASS_WIDTH.items() if sfx in rest), 32)
    return f"{base}.{width}"


def _amd_op(mnemonic: str) -> str | None:
    for prefix, name in _AMD_MEMORY:
        if mnemonic.startswith(prefix):
            if name in ("global_atomic", "ds_atomic", "ds_permute", "local"):
                return name
            m = _AMD_WIDTH.search(mnemonic)
            if m is None:
                return name
            words, bits, small = m.groups()
            width = 32 * int(words) if words else int(bits or small or 32)
            return f"{name}.{width}"
    return None


def memory_ops(code: str) -> dict:
    """Static memory instructions of one kernel's code, by barrier segment.

    The code is cut at each block barrier (SASS ``BAR.SYNC``, AMDGPU
    ``s_barrier``); each segment counts its instructions and its memory
    instructions by kind and width in bits (SASS ``LDG.128``, ``LDS.32``,
    ``STS.64``, ``ATOMS``, ``ATOMG``, ``RED``, local ``LDL``/``STL``;
    AMDGPU ``global_load.128``, ``ds_read.32``, ``ds_read2.32`` (two
    words), ``ds_atomic``, ``ds_permute`` (a cross-lane move through the
    LDS crossbar), ``global_atomic``, ``local``: scratch). Static counts:
    a loop body counts once.

    Args:
        code: SASS (``nvdisasm``'s listing) or AMDGPU assembly of one
            kernel.

    Returns:
        ``{"segments": [{"instructions": n, "ops": {kind: count}}],
        "ops": {kind: count}, "local": n}``: the segments in code order,
        the kernel's totals, and its local-memory (spill, stack)
        instructions.
    """
    sass = _SASS_INSTRUCTION.findall(code)
    if sass:
        mnemonics, classify, barriers = sass, _sass_op, ("BAR.SYNC", "BAR")
    else:
        mnemonics = _AMD_INSTRUCTION.findall(code)
        classify, barriers = _amd_op, ("s_barrier",)

    def barrier(m: str) -> bool:
        return m in barriers or m.startswith("BAR.SYNC.")

    segments = [{"instructions": 0, "ops": Counter()}]
    for m in mnemonics:
        if barrier(m):
            segments.append({"instructions": 0, "ops": Counter()})
            continue
        segments[-1]["instructions"] += 1
        op = classify(m)
        if op is not None:
            segments[-1]["ops"][op] += 1
    total = sum((seg["ops"] for seg in segments), Counter())
    local = sum(
        n for op, n in total.items() if op.startswith(("LDL", "STL", "local"))
    )
    return {
        "segments": [
            {"instructions": seg["instructions"], "ops": dict(seg["ops"])}
            for seg in segments
        ],
        "ops": dict(total),
        "local": local,
    }


#: An AMDGPU call: ``s_swappc_b64`` jumps to a function and saves the
#: return address. ``s_setpc_b64`` jumps without saving one: a return
#: when its operand is the return address (``s[30:31]``), else a tail
#: call.
_AMD_CALL = re.compile(r"^\s*s_swappc_b64\b", re.M)
_AMD_SETPC = re.compile(r"^\s*s_setpc_b64\s+(s\[\d+:\d+\])", re.M)
#: The return address register pair of the AMDGPU calling convention.
_AMD_RETURN_ADDRESS = "s[30:31]"


def amd_calls(asm: str) -> int:
    """Out-of-line calls in AMDGPU assembly.

    Args:
        asm: One kernel's ``.s`` file: the kernel and every function it
            calls (counted too: a call from a callee is a call).

    Returns:
        The ``s_swappc_b64`` instructions (a call) plus the
        ``s_setpc_b64`` whose operand is not ``s[30:31]`` (a tail call;
        with ``s[30:31]`` it is a callee's return). 0 when every function
        is inlined into the kernel.
    """
    tail = [r for r in _AMD_SETPC.findall(asm) if r != _AMD_RETURN_ADDRESS]
    return len(_AMD_CALL.findall(asm)) + len(tail)


#: A SASS call: ``CALL.REL`` (a function of the same cubin) or
#: ``CALL.ABS`` (an absolute address), with any suffix (``.NOINC``), and
#: its target (``nvdisasm`` names a function of the cubin in backquotes).
_SASS_CALL = re.compile(r"\bCALL\.(?:REL|ABS)[\w.]*\s+([^;]*?)\s*;")
#: A subroutine ptxas adds for an operation of the PTX (not a function of
#: it): ``$__internal_0_$__cuda_sm20_div_s64`` (64-bit integer division),
#: ``$__internal_1_$__cuda_sm3x_div_rn_noftz_f32_slowpath`` (the rare
#: operands of an IEEE FP32 division).
_PTXAS_SUBROUTINE = re.compile(r"^`?\(?\$__internal_\d+_\$(__cuda_\w+)\)?$")


def _sass_targets(sass: str) -> list[str]:
    return _SASS_CALL.findall(sass)


def sass_calls(sass: str) -> int:
    """Out-of-line calls in SASS (``nvdisasm``'s listing of a cubin).

    Returns:
        The ``CALL.REL`` and ``CALL.ABS`` instructions (with any suffix,
        ``CALL.REL.NOINC``; predicated or not) but those of ptxas's own
        subroutines (:func:`sass_subroutine_calls`): the calls the PTX's
        code makes, which a kernel inlined whole has none of.
    """
    return sum(1 for t in _sass_targets(sass) if not _PTXAS_SUBROUTINE.match(t))


def sass_subroutine_calls(sass: str) -> dict[str, int]:
    """Calls in SASS to subroutines ptxas adds for single PTX operations.

    ptxas expands a 64-bit integer division (``div.s64``) or an IEEE FP32
    division (``div.rn.f32``) into a fast inline path and a call, taken
    for the operands that path does not cover, to a subroutine of its own
    that passes its arguments in registers (no stack frame). They are not
    the kernel's functions left out of line, so :func:`sass_calls` leaves
    them out.

    Returns:
        Subroutine (``__cuda_sm20_div_s64``, ...) -> its call sites.
    """
    found: Counter[str] = Counter()
    for target in _sass_targets(sass):
        if m := _PTXAS_SUBROUTINE.match(target):
            found[m.group(1)] += 1
    return dict(found)


#: A PTX call instruction, optionally predicated: ``call.uni (r), f, (a);``
#: or ``@%p1 call f;`` (not ``.callprototype`` declarations).
_PTX_CALL = re.compile(r"^\s*(?:@!?%\w+\s+)?call(?:\.uni)?\s", re.M)


def ptx_calls(ptx: str) -> int:
    """``call`` instructions in a PTX module (its entries and functions).

    The PTX's calls, before ``ptxas`` (which may inline a ``.func``):
    what the report counts for an NVIDIA kernel when there is no SASS.
    """
    return len(_PTX_CALL.findall(ptx))
