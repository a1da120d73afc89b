"""Scenarios for test_join_async_mpi.py, one per argv[1], on real ranks. Each prints what the
test asserts (timings measured here, results compared exactly with a single-process replay).

* join [fp16]: rank 0 runs 10 DistributedOptimizer steps, rank 1 runs 12, both call join()
  (Horovod's documented idiom): rank 0 must take part with zeros in rank 1's last two steps.
* async: rank 1 reaches allreduce_async 3 s after rank 0; rank 0's call must return at once.
* one_rank_step: rank 0 takes one step more than rank 1, which goes on to a metric allreduce;
  with the default 300 s timeout both must get the named error within seconds.
* order: collectives matched by name when the ranks submit them in different orders.
* sparse: sparse gradients (nn.Embedding(sparse=True)) through DistributedOptimizer.
* join_adasum: rank 0 joins while rank 1 still steps with op=Adasum (point-to-point rounds): a
  clear refusal on rank 0, and rank 1 is told within seconds.
"""
import hashlib
import sys
import time

import torch

import torch_plugin as hvd

hvd.init()
torch.set_num_threads(1)
R = hvd.rank()
scenario = sys.argv[1]


def model_pair():
    def make():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    return make(), make()


def digest(model):
    return hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()[:16]


def sparse_run(method, steps):
    """The Top-k or DGC loop, the same data on every rank; prints the weights' digest after 10
    steps and at the end. With ``replay`` (one process) steps 11-12 use half the learning rate:
    a joined rank's zeros halve the average of the selected values, and nothing else (each
    rank's residual and momentum are its own), so the ranks must match the replay bit for bit."""
    torch.manual_seed(0)  # no biases: DGC applies momentum after the average on dense buckets (1-D tensors)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32, bias=False), torch.nn.Linear(32, 4, bias=False))
    comp = (hvd.Compression.topk(density=0.05) if method == "topk"
            else hvd.Compression.dgc(density=0.05, momentum=0.9))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), compression=comp)
    x = torch.linspace(-1, 1, 128).reshape(2, 64)
    for step in range(steps):
        if step == 10:
            print(f"rank {R}: at 10 weights={digest(model)}", flush=True)
            if "replay" in sys.argv:
                for g in opt.param_groups:
                    g["lr"] = 0.05
        opt.zero_grad()
        model(x).pow(2).sum().backward()
        opt.step()
    return model


if scenario == "join" and sys.argv[2] in ("topk", "dgc"):
    model = sparse_run(sys.argv[2], 12 if "replay" in sys.argv or R == 1 else 10)
    last = -1 if "replay" in sys.argv else hvd.join()
    print(f"rank {R}: join returned {last}; final weights={digest(model)}", flush=True)
    sys.exit(0)

if scenario == "join":
    fp16 = "fp16" in sys.argv[2:]
    model, ref = model_pair()
    comp = hvd.Compression.fp16 if fp16 else hvd.Compression.none
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), compression=comp)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    x = torch.ones(2, 4)  # the same data on both ranks: the average of two equal gradients is exact
    for step in range(10 if R == 0 else 12):
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()
        ref_opt.zero_grad()
        ref(x).sum().backward()
        for p in ref.parameters():
            g = p.grad / 2 if step >= 10 else p.grad  # steps 11 and 12: rank 0 contributes zeros
            p.grad = (g / 2).half().float() * 2 if fp16 else g  # fp16: x/P on the wire, summed
        ref_opt.step()
    t0 = time.monotonic()
    last = hvd.join()
    took = time.monotonic() - t0
    exact = all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters()))
    after = hvd.allreduce(torch.tensor([float(R)]), op=hvd.Sum).item()  # the stream is intact
    print(f"rank {R}: join returned {last} after {took:.2f}s; exact={exact}; after={after:g}", flush=True)
    sys.exit(0)

if scenario == "async":
    hvd.barrier()
    if R == 1:
        time.sleep(3)
    t0 = time.monotonic()
    h = hvd.allreduce_async(torch.full((3,), float(R + 1)), op=hvd.Sum, name="late")
    returned = time.monotonic() - t0
    dup = "none"
    try:
        hvd.allreduce_async(torch.ones(1), name="late")
    except ValueError as e:
        dup = type(e).__name__
    first_poll = hvd.poll(h)
    out = hvd.synchronize(h).tolist()
    print(f"rank {R}: returned after {returned:.3f}s; poll={first_poll}; result={out}; duplicate={dup}", flush=True)
    sys.exit(0)

if scenario == "one_rank_step":
    model = torch.nn.Linear(4, 2)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    t0 = time.monotonic()
    try:
        for _ in range(3 if R == 0 else 2):
            opt.zero_grad()
            model(torch.ones(2, 4)).sum().backward()
            t0 = time.monotonic()
            opt.step()
        t0 = time.monotonic()
        hvd.allreduce(torch.ones(1), name="metric")
    except Exception as e:
        print(f"rank {R}: {type(e).__name__} after {time.monotonic() - t0:.1f}s: {e}", flush=True)
        raise
    sys.exit(0)

if scenario == "join_adasum":
    model = torch.nn.Linear(4, 2)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), op=hvd.Adasum)
    t0 = time.monotonic()
    try:
        for _ in range(1 if R == 0 else 2):
            opt.zero_grad()
            model(torch.ones(2, 4)).sum().backward()
            opt.step()
        t0 = time.monotonic()
        hvd.join()
    except Exception as e:
        print(f"rank {R}: {type(e).__name__} after {time.monotonic() - t0:.1f}s: {e}", flush=True)
        raise
    sys.exit(0)

if scenario == "order":
    # Horovod's negotiation matches by name: an async call pending on rank 0 while rank 1 is in
    # a barrier, and two named calls submitted in opposite orders
    h = None
    if R == 0:
        h = hvd.allreduce_async(torch.full((2,), 1.0), op=hvd.Sum, name="pending")
    hvd.barrier()
    if R == 1:
        h = hvd.allreduce_async(torch.full((2,), 2.0), op=hvd.Sum, name="pending")
    first = hvd.synchronize(h).tolist()
    names = ["a", "b"] if R == 0 else ["b", "a"]
    hs = {n: hvd.allreduce_async(torch.full((1,), float(ord(n) + R)), op=hvd.Sum, name=n) for n in names}
    swapped = {n: hvd.synchronize(h).item() for n, h in hs.items()}
    t0 = time.monotonic()
    try:
        hvd.allreduce(torch.ones(2), name="x") if R == 0 else hvd.allgather(torch.ones(2), name="y")
        mismatch = "none"
    except RuntimeError as e:
        mismatch = f"{type(e).__name__} after {time.monotonic() - t0:.1f}s"
    after = hvd.allreduce(torch.ones(1), op=hvd.Sum).item()
    print(f"rank {R}: first={first}; a={swapped['a']:g}; b={swapped['b']:g}; mismatch={mismatch}; after={after:g}",
          flush=True)
    sys.exit(0)

if scenario == "sparse":
    # nn.Embedding(sparse=True) under DistributedOptimizer, both values of Horovod's sparse_as_dense:
    # the step equals SparseAdam on the average of both ranks' gradients, handed over sparse
    inputs = [torch.LongTensor([[1, 2, 4, 5], [4, 3, 2, 9]]), torch.LongTensor([[1, 3, 4], [4, 7, 9]])]
    results = []
    for sparse_as_dense in (False, True):
        torch.manual_seed(0)
        model = torch.nn.Embedding(10, 3, sparse=True)
        ref = torch.nn.Embedding(10, 3, sparse=True)
        ref.load_state_dict(model.state_dict())
        opt = hvd.DistributedOptimizer(torch.optim.SparseAdam(list(model.parameters()), lr=0.1),
                                       sparse_as_dense=sparse_as_dense)
        opt.zero_grad()
        model(inputs[R]).sum().backward()
        opt.step()
        grads = []
        for x in inputs:
            ref.zero_grad()
            ref(x).sum().backward()
            grads.append(ref.weight.grad.to_dense())
        ref.weight.grad = ((grads[0] + grads[1]) / 2).to_sparse()
        torch.optim.SparseAdam(list(ref.parameters()), lr=0.1).step()
        results.append(torch.equal(model.weight, ref.weight))
    print(f"rank {R}: sparse exact={results}", flush=True)
    sys.exit(0)

sys.exit(f"unknown scenario {scenario}")
