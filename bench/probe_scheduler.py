"""Scheduler throughput without HTTP: C clients submitting jobs back to back for D seconds."""
import sys, threading, time
from pathlib import Path
from nanoeuler_core.inference.loading import load_model
from nanoeuler_core.inference.decoder import Sampling
from nanoeuler_core.serving.scheduler import Scheduler, Job, Done, Failed

run, backend, rows, clients, dur = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])
model, tok = load_model(Path(run), backend)
mode = sys.argv[6] if len(sys.argv) > 6 else "plain"
sched = Scheduler(model, tok, rows, 1000, {"plain": False, "spec": True, "auto": None}[mode]).start()
prompt = tok.encode("To be, or not to be, that is the question: whether tis nobler")
total = [0]
def client(i):
    end = time.perf_counter() + dur
    n = 0
    while time.perf_counter() < end:
        ev = threading.Event()
        def emit(e):
            if isinstance(e, (Done, Failed)):
                if isinstance(e, Done):
                    total[0] += e.completion_tokens
                ev.set()
        sched.submit(Job([prompt], 1, 64, Sampling(0.8), i * 1000 + n, [], None, emit))
        ev.wait(); n += 1
t0 = time.perf_counter()
ts = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
[t.start() for t in ts]; [t.join() for t in ts]
el = time.perf_counter() - t0
print(f"{mode}: {clients} clients, {rows} rows: {total[0] / el:.0f} tokens/s, decoder steps {sched.decoder.steps}")
sched.close()
