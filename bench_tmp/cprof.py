import torch, sys, cProfile, pstats, time
sys.path.insert(0, "scripts")
from bench_block import Cheap
import mhc
B,S,n,C=8,2048,4,768
blk = mhc.MHCBlock(Cheap(C).cuda().bfloat16(), C, n, init="paper").cuda()
res = Cheap(C).cuda().bfloat16()
x = torch.randn(B,S,n,C, device="cuda", dtype=torch.bfloat16, requires_grad=True); g = torch.randn_like(x)
x1 = torch.randn(B,S,C, device="cuda", dtype=torch.bfloat16, requires_grad=True); g1 = torch.randn_like(x1)
for name, fn in (("fused mhc", lambda: blk(x).backward(g)), ("residual", lambda: (x1 + res(x1)).backward(g1))):
    for _ in range(3): fn()
    torch.cuda.synchronize(); t0 = time.perf_counter()
    for _ in range(20): fn()
    t1 = time.perf_counter(); torch.cuda.synchronize(); t2 = time.perf_counter()
    print(f"C=768 {name} f+b: host {1e3*(t1-t0)/20:.3f} ms/call, wall {1e3*(t2-t0)/20:.3f} ms/call")
pr = cProfile.Profile(); pr.enable()
for _ in range(20): blk(x).backward(g)
torch.cuda.synchronize(); pr.disable()
pstats.Stats(pr).sort_stats("cumulative").print_stats(18)
