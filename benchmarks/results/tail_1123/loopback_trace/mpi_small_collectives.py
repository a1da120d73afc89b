import os, time, numpy as np
from mpi4py import MPI
c = MPI.COMM_WORLD.Dup()
for n in (12800, 5242, 131072):
    b = np.ones(n, np.float32)
    out = np.empty(n*2, np.float32)
    for name, f in (("allreduce", lambda: c.Allreduce(MPI.IN_PLACE, b, MPI.SUM)), ("allgather", lambda: c.Allgather(b, out))):
        for _ in range(20): f()
        c.Barrier()
        t = time.perf_counter()
        for _ in range(200): f()
        dt = (time.perf_counter() - t) / 200
        if c.rank == 0: print(name, n*4, f"{dt*1e6:.1f} us")
