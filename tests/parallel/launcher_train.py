"""A small training script run unchanged under torchrun, mpirun and our launcher; rank 0 prints
the backend init() chose and a digest of the trained weights (test_launchers.py compares them)."""
import hashlib

import torch

import torch_plugin as hco
from hvd_commopt import runtime

hco.init()
torch.set_num_threads(1)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
opt = hco.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                               named_parameters=model.named_parameters())
hco.broadcast_parameters(model.state_dict(), root_rank=0)
for step in range(5):
    g = torch.Generator().manual_seed(100 * step + hco.rank())
    x, y = torch.randn(16, 8, generator=g), torch.randint(0, 4, (16,), generator=g)
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
h = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
control = getattr(runtime.communicator().backend, "control", None)
print(f"rank {hco.rank()} of {hco.size()}: backend {runtime.backend_name()} control "
      f"{control.name if control is not None else None} weights {h}", flush=True)
