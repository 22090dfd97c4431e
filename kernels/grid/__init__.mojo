"""The kernel model: how every GPU kernel of the package is declared,
launched on a GPU and emulated on the host.

`gpu_kernel` holds the declaration (`GpuKernel`), the launcher, the GPU
entry of a cooperative kernel and its emulation; `block_phases` what a
phase touches besides registers (shared memory and its race stamps,
atomics, blocks meeting through global memory); `collectives` the warp
and block collectives between phases; `parallel`
kernels whose threads never communicate and the CPU's parallel ranges;
`profile` what an emulated launch asks of shared memory (wavefronts,
bank conflicts, atomics per address); `operands` the operand structs'
contract and the ops' shape checks;
`ragged` the pointer types and the ragged-batch helpers every op reads
through. docs/kernels.md says how to write a kernel.
"""
