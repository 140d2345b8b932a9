"""``python -m rope_ops bench``: PERF.md's workloads and the public matrix of cases, for rope_ops'
backends and their peers, against floors measured in the same run.

- ``cases``: the workloads W1-W5, the matrix (real models' shapes in every layout, dtype, style,
  head_dim, GQA ratio, token count, direction, kind of positions) and the CPU workloads.
- ``providers``: rope_ops backends, Liger-Kernel, torch.compile of Hugging Face's form, the
  eager form.
- ``floors``: Triton kernels for the floors that a plain copy does not give (GPU).
- ``timing``: CUDA-graph GPU time, host time, CPU medians; the same-run copy.
- ``candidates``: every kernel configuration a backend exposes, timed against its policy's.
- ``run`` and ``report``: the run, and the table, Markdown results file and chart.

The command line is in ``rope_ops.cli``. The timers are also used by tools/ (GPU checks).
"""

from .cases import ALL_CASES, CPU_WORKLOADS, MATRIX, TABLE_POSITIONS, WORKLOADS, Case
from .timing import (copy_bandwidth, copy_time, cpu_times, gpu_time_per_call, graph_seconds_per_call,
                     host_time_per_call, host_times, l2_bytes, warm_up)

__all__ = [
    "ALL_CASES", "CPU_WORKLOADS", "MATRIX", "TABLE_POSITIONS", "WORKLOADS", "Case", "copy_bandwidth",
    "copy_time", "cpu_times", "gpu_time_per_call", "graph_seconds_per_call", "host_time_per_call",
    "host_times", "l2_bytes", "warm_up",
]
