"""Selection-quality evaluation of EPS page selection (issue 8).

The shipped core/ C++ code builds summaries and selects (through libeps_eval,
eval/capi.cc); this package makes the workloads, computes dense attention and
the metrics, and writes CSV/JSON, plots and a markdown summary.
"""

import os as _os

# Small matrices and a shared, oversubscribed CPU: BLAS threads only spin. One
# thread per process (set before numpy loads; a caller's setting wins).
for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    _os.environ.setdefault(_var, "1")
