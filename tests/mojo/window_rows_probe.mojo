"""Prints the GPU path's workspace and windows, for
tests/docs_and_layout/test_kernel_constants.py.

`mojo run -I <root> window_rows_probe.mojo C0 T0 C1 T1 ...` prints
`GPU_WORKSPACE_BYTES`, then `window_rows(Ci, Ti)` a line each, then
`select_slices(Ci, Ti, k)` for k 1, 512 and 2048, a line each, then
`wgmma_groups_rows(Ti, r)` for r 0, 1, Ti / 2 and Ti, as 0 or 1.
"""

from std.sys import argv

from kernels.index.gpu.launches import GPU_WORKSPACE_BYTES, window_rows
from kernels.index.gpu.select import select_slices
from kernels.index.gpu.wgmma import wgmma_groups_rows


def main() raises:
    var args = argv()
    print(GPU_WORKSPACE_BYTES)
    var i = 1
    while i + 1 < len(args):
        print(window_rows(Int(args[i]), Int(args[i + 1])))
        i += 2
    i = 1
    while i + 1 < len(args):
        for k in [1, 512, 2048]:
            print(select_slices(Int(args[i]), Int(args[i + 1]), k))
        i += 2
    i = 1
    while i + 1 < len(args):
        var t = Int(args[i + 1])
        for r in [0, 1, t // 2, t]:
            print(Int(wgmma_groups_rows(t, r)))
        i += 2
