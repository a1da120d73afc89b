"""Two builds of the native kernels, one process: the fused top-k on cold layers, alternating.

    python ab_so.py OLD.so NEW.so [n ...]   (run from the repository root's venv)
"""
import time, numpy as np, sys, importlib.util
from hvd_commopt.compress.exact_topk import ExactTopK
def load(path):
    spec = importlib.util.spec_from_file_location("hvd_commopt._hostkernels", path)
    m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); return m
mods = {"old": load(sys.argv[1]), "new": load(sys.argv[2])}
for n in [int(a) for a in sys.argv[3:]] or [65536]:
    L = max(8, int(48*65536/n)); k = int(n * 0.01)
    e = ExactTopK(); m = e.sample_size(n, k); s = n // m
    rng = np.random.default_rng(0)
    sidx = np.arange(m, dtype=np.int64) * s + rng.integers(0, s, size=m, dtype=np.int64)
    j_lo, j_hi = e._bracket_ranks(n, k, m)
    sets = [dict(x=rng.standard_normal(n).astype(np.float32)*0.01, g=rng.standard_normal(n).astype(np.float32),
                 u=rng.standard_normal(n).astype(np.float32)) for _ in range(L)]
    vals, idx = np.empty(k, np.float32), np.empty(k, np.int64)
    def run(mod, reps=10):
        t0 = time.perf_counter()
        for _ in range(reps):
            for d in sets:
                mod.topk(d["x"], d["g"], d["x"], d["u"], 0.9, d["u"], k, sidx, j_lo, j_hi, 2, vals, idx)
        return (time.perf_counter() - t0) / reps / L * 1e6
    res = {"old": [], "new": []}
    for r in range(8):
        for name in (("old", "new") if r % 2 == 0 else ("new", "old")):
            res[name].append(run(mods[name]))
    print(f"n={n}: old {np.median(res['old']):.1f} us, new {np.median(res['new']):.1f} us per call (median of 8)")
