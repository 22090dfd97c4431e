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

Every GPU kernel is declared once, next to its body, as a
`gpu_kernel.GpuKernel` (name, operands, threads, shared words, phases,
grid rule), and launched by `gpu_kernel.launch_kernel`: as
`parallel.gpu_kernel` when its threads never communicate (the writers,
the plan), as `gpu_kernel.gpu_block_kernel` when they cooperate (phases
separated by barriers, registers across them, shared memory, atomics,
collectives: the scorers, the select, the step's scan); on the CPU both
run over an emulated grid, the phased one with an emulation that refuses
a missing barrier, a race with an atomic or a lane left out of a
collective. `gpu-report` and the compile tests compile the same
declarations.
"""
