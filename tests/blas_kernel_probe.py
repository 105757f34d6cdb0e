"""Prints, as exact hex floats, what the fingerprint's fits and the policy's demand pressures
give on fixed random inputs: ``test_same_bits_on_every_cpu`` runs it under several OpenBLAS
kernels and requires the same bytes from each."""

import numpy as np
from fleetpilot.fingerprint.curves import fit_accel, fit_line, fit_quad, fit_teeth
from fleetpilot.policy.fragmentation import TaskShape
from fleetpilot.policy.state import ClusterState
from fleetpilot.policy.transformers import DemandPressure, ModelPressure

rng = np.random.default_rng(2026)
t = np.sort(rng.uniform(0.0, 7200.0, 1500))
y = 2000.0 + 0.5 * t + 3e-5 * t * t + rng.normal(0.0, 30.0, t.size)
out = []
for f in (fit_line(t, y), fit_quad(t, y), fit_accel(t, y)):
    out += [f.rss, *np.ravel(f.xtx_inv).tolist()]
saw = (t % 900.0) * 4.0 + rng.normal(0.0, 5.0, t.size)
out += [fit_teeth(t, saw, 5.0).rss]
n = 600
models = ["A100", "G2", "G3", "T4", "V100"]
state = ClusterState.build(names=[f"n{i}" for i in range(n)], cpu_milli=[96000] * n, memory_mb=[512000] * n,
                           gpus=rng.integers(1, 9, n).tolist(), models=[models[i % 5] for i in range(n)])
free = np.where(state.gpu_exists, rng.integers(0, 1001, state.gpu_exists.shape), 0)
shapes = [TaskShape(cpu_milli=int(rng.integers(0, 32000)), gpu_milli=int(rng.integers(100, 1001)),
                    gpus=int(rng.choice([1, 1, 2, 4, 8])), models=tuple(rng.choice(models, int(rng.integers(0, 3)), replace=False)),
                    weight=float(rng.random())) for _ in range(300)]
out += ModelPressure(shapes, state.models)(state, free).tolist()
rows = np.arange(n)
out += DemandPressure(shapes, state.models).costs(state, free, rows, 500, 4000, np.ones(n, dtype=np.int64)).tolist()
print(" ".join(float(v).hex() for v in out))
