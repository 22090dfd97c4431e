"""``python -m mla_kpool demo``: a serving workload, checked pool by pool.

The command line (:mod:`~mla_kpool.demo.cli`) resolves the options (and a
``--schedule`` file, :mod:`~mla_kpool.demo.schedule_file`) into a
configuration and a plan of calls (:mod:`~mla_kpool.demo.workload`, the
requests and their data; :mod:`~mla_kpool.demo.scheduling`, batching and ring
slots), compiles the step, index_top_k and expand_topk models once, all on
``--device`` (:mod:`~mla_kpool.demo.indexing` names index_top_k's scorer
there), serves every call (chunked prefill, decode or speculative verify
steps, requests joining as ring slots free up;
:mod:`~mla_kpool.demo.checked_run`), checks every pool of every request,
every index_top_k row and every expand_topk row against the NumPy oracle
(:mod:`~mla_kpool.demo.checks`), and prints a summary
(:mod:`~mla_kpool.demo.summary`). Everything but the
kernels is pure Python and NumPy, deterministic for a given seed.

Exit status: 0 when every check passes, 1 when one fails (the failures are
printed), 2 for a usage error such as a bad ``--schedule`` file.
``--inject-fault`` (:mod:`~mla_kpool.demo.faults`) corrupts one ring member,
one key or one selected pool id behind the oracle's back, so a run that exits
0 with it would prove the check blind.
"""

from __future__ import annotations

from .cli import DESCRIPTION, add_arguments, main, run

__all__ = ["DESCRIPTION", "add_arguments", "main", "run"]
