"""Claim 5 of ``tools/paper.py``: plan Qwen3.5-397B-A17B's layer pattern. A planning experiment:
nothing trains at that size here.

1. **Measure.** One CPU rank trains ``qwen35_397b_layers_cpu`` (``torchtitan03_ext``): the model's
   two block kinds at its widths (a gated-DeltaNet block and a full-attention block, both MoE
   with a gated shared expert), 10 local experts (every token goes to 10), one sequence of
   ``PROBE_TOKENS`` tokens. TapeSAC profiles it as planned mode does; the probe keeps the block
   graphs (per-op times, storage bytes), every value's shape and the step's memory windows.
2. **Scale** to :data:`TOKENS` tokens per rank, the probe's tokens times ``r``. A tensor
   dimension that is a multiple of ``PROBE_TOKENS`` counts tokens (no width of the model is one):
   a storage with such a dimension grows ``r`` times, and so does the time of an op that reads
   or writes one, except attention's score product, which grows ``r**2``. Activations are
   bf16 on the GPU, fp32 in the probe: their bytes are halved. A produced storage without a
   token dimension derives from weights alone (the bf16 casts of the expert weights that the
   CPU's grouped matmul reads); on the GPU it is FSDP2's gathered bf16 weight, counted with the
   gathered weights, so it costs nothing to hold. Per-op times stay CPU times: the
   plan weighs them against each other, and a GPU's ratio of matmul to elementwise speed is
   not this CPU's.
3. **Plan** the 397B's pattern, 60 blocks, full attention every fourth, on one rank of
   :data:`GPUS` H200s under FSDP2 with expert parallelism :data:`EP` (no tensor parallelism):
   its sharded states, two layers' all-gathered bf16 weights, and in backward one layer's
   unsharded fp32 gradients. Block working memory comes from the probe's measured windows,
   scaled as above. The limit is 90% of the device's memory.

Reported: the planner's wall time at that shape (block frontiers, allocation, step frontier);
TapeSAC's step frontier; full AC, torchtitan 0.3's ``selective`` op list and 0.2.x's (every other
matmul and attention), each costed as torch's checkpoint runs it (everything not saved is
recomputed); a uniform per-block budget; and TapeSAC planned at each of their predicted peaks,
and at the smallest peak where it recomputes no more than each of them.
The allocation MILP against greedy and a long MILP at three limits (claim 6 at this shape).

    python tools/paper_shape.py [--quick] [--json out.json]

``--quick`` measures the MoE debug model's widths instead (dim 256; seconds), for a smoke run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tapesac.autoplan import PlanConfig  # noqa: E402
from tapesac.planner import make_plan  # noqa: E402
from tapesac.planner.allocate import (allocate, formula_deltas, global_frontier, largest_useful_peak,  # noqa: E402
                                      predicted_peak, smallest_peak)
from tapesac.planner.graph import BlockGraph  # noqa: E402
from tapesac.planner.milp import Point, evaluate, frontier  # noqa: E402
from tapesac.stepmodel import StepMemory, Window  # noqa: E402

GIB = 2**30
BLOCKS = 60
"""Qwen3.5-397B-A17B's layers; every fourth has full attention, the rest gated DeltaNet."""
FULL_ATTENTION_INTERVAL = 4
PARAMS = 397e9
EXPERTS = 512
GPUS = 128
"""16 nodes of 8 H200s."""
EP = 16
"""Expert parallelism: each rank holds EXPERTS / EP = 32 experts."""
DEVICE_BYTES = 141e9
"""An H200's memory."""
LIMIT_FRACTION = 0.9
TOKENS = 4096
"""Tokens per rank per step (one sequence); torchtitan's job runs 4 x 4096 under TP 8."""
STATE_BYTES_PER_PARAM = 16
"""fp32 parameter, fp32 gradient, AdamW's two fp32 moments; sharded over every rank."""
VOCAB = 248320
LOSS_CHUNKS = 8
"""The loss's working memory: one of this many chunks of fp32 logits (ChunkedLossWrapper)."""
ACTIVATION_BYTES = 0.5
"""bf16 on the GPU for the probe's fp32."""

SAVE_03 = {"_scaled_dot_product_cudnn_attention", "_scaled_dot_product_attention_math",
           "_scaled_dot_product_fused_attention_overrideable", "max", "linear", "topk",
           "reduce_scatter_tensor", "all_to_all_single"}
"""torchtitan 0.3's ``selective`` save list (``_get_default_save_ops``); ``linear``, every other."""
SAVE_02 = {"mm", "_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention",
           "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_cudnn_attention",
           "_scaled_dot_product_attention_math", "_scaled_dot_product_fused_attention_overrideable",
           "max", "reduce_scatter_tensor"}
"""torchtitan 0.2.x's op list: ``mm`` every other, attention (the CPU's flash op stands for the
GPU's), ``max``, ``reduce_scatter``."""
EVERY_OTHER = {"mm", "linear"}


def probe(config: str, tmp: Path, log) -> dict:
    """Train ``config`` for 3 steps on one CPU rank with TapeSAC planned (a limit nothing reaches:
    only the profile is wanted); return the probe's graphs, shapes, windows and layer sizes."""
    graphs = tmp / f"{config}.graphs.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
           "-m", "tools.paper_probe", "--module", "torchtitan03_ext", "--config", config,
           "--dump_folder", str(tmp / f"{config}_dump"), "--training.steps", "3", "activation-checkpoint:tapesac"]
    env = {**os.environ, "PAPER_PROBE": str(tmp / config), "PAPER_GRAPHS": str(graphs),
           "PAPER_METER_STEP": "-1", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    t0 = time.perf_counter()
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=3600)
    if out.returncode != 0 or not graphs.exists():
        raise RuntimeError(f"claim 5: the probe {config} failed:\n" + (out.stdout + out.stderr)[-3000:])
    data = json.loads(graphs.read_text())
    data["wall_s"] = time.perf_counter() - t0
    log(f"claim 5: probed {config} in {data['wall_s']:.0f} s")
    return data


def _op_kind(name: str) -> str:
    """``aten.mm.default`` -> ``mm``."""
    parts = name.split(".")
    return parts[1] if len(parts) > 2 else parts[-1]


def scale_graph(block: dict, probe_tokens: int, r: float) -> tuple[BlockGraph, dict]:
    """The probed block at ``r`` times its tokens (see the module docstring); and what scaled."""
    g = BlockGraph.from_json(block["graph"])
    shapes = block["value_shapes"]
    token = [any(d > 0 and d % probe_tokens == 0 for d in s) for s in shapes]
    storage_token = [False] * len(g.storage_bytes)
    for v, s in enumerate(g.value_storage):
        storage_token[s] = storage_token[s] or token[v]

    def size(s: int, nbytes: float) -> float:
        # Without a token dimension a produced storage derives from weights only: in the probe,
        # the bf16 casts of the fp32 expert weights that the grouped matmul reads (and saves).
        # On the GPU those are FSDP2's gathered bf16 parameters, counted with the gathered weights.
        return nbytes * ACTIVATION_BYTES * r if storage_token[s] else 0.0

    outs = g.op_outputs()
    times = []
    for o, t in enumerate(g.op_time_s):
        touches = any(token[v] for v in (*g.op_deps[o], *outs[o]))
        attention = "scaled_dot_product" in g.op_names[o]
        times.append(t * (r * r if attention else r) if touches else t)
    fixed = g.fixed_bytes * ACTIVATION_BYTES * r  # keep-only outputs: routing, attention stats
    scaled = dataclasses.replace(
        g, op_time_s=times, storage_bytes=[size(s, b) for s, b in enumerate(g.storage_bytes)],
        storage_bound_bytes=(None if g.storage_bound_bytes is None else
                             [size(s, b) for s, b in enumerate(g.storage_bound_bytes)]),
        fixed_bytes=fixed, fixed_bound_bytes=g.fixed_bound_bytes * ACTIVATION_BYTES * r,
        unseen_bytes=g.unseen_bytes * ACTIVATION_BYTES * r)
    produced = {s for v, s in enumerate(g.value_storage) if g.value_op[v] >= 0}
    info = {"ops": len(g.op_time_s), "values": g.num_values, "read": len(g.read),
            "ops_scaled": sum(1 for a, b in zip(times, g.op_time_s) if a != b),
            "produced_bytes_probe": sum(g.storage_bytes[s] for s in produced),
            "produced_bytes_not_token": sum(g.storage_bytes[s] for s in produced if not storage_token[s]),
            "op_s_probe": sum(g.op_time_s), "op_s_scaled": sum(times)}
    return scaled, info


def _block_input_bytes(block: dict, probe_tokens: int) -> float:
    """Bytes of the block's hidden-state input ([batch, tokens, dim]) in the probe."""
    g = block["graph"]
    for v, s in enumerate(block["value_shapes"]):
        if g["value_op"][v] < 0 and len(s) == 3 and s[1] == probe_tokens:
            return float(s[0] * s[1] * s[2] * block["value_itemsize"][v])
    raise ValueError("no [batch, tokens, dim] input in the probed block")


def step_memory(data: dict, graphs: dict[int, BlockGraph], kinds: list[int], r: float,
                probe_tokens: int) -> tuple[StepMemory, dict]:
    """One rank's step of the 397B's pattern (see the module docstring), with block working
    memory from the probe's measured windows."""
    peaks = {w["label"]: w["peak_bytes"] for w in data["memory"]}
    blocks = [data["blocks"][str(k)] for k in range(len(data["blocks"]))]
    probe_graphs = [BlockGraph.from_json(b["graph"]) for b in blocks]
    x_probe = _block_input_bytes(blocks[0], probe_tokens)
    held_probe = [x_probe + g.fixed_bytes for g in probe_graphs]
    grads_probe = [float(layer["param_bytes"]) for layer in data["layers"]]
    base = peaks["after forward of block 0"] - held_probe[0]
    fwd_work, bwd_work = [], []
    for k in range(len(blocks)):
        below = sum(held_probe[:k])
        fwd_work.append(max(0.0, peaks[f"forward of block {k}"] - base - below) * ACTIVATION_BYTES * r)
        grads = sum(grads_probe[k:])  # the probe's gradients of the blocks backward has run
        bwd_work.append(max(0.0, peaks[f"backward of block {k}"] - base - below - grads) * ACTIVATION_BYTES * r)

    layer_params = []
    for layer in data["layers"]:
        experts = layer["expert_param_bytes"] / 4  # the probe's fp32 parameters
        local = experts / layer["local_experts"] * (EXPERTS / EP) if experts else 0.0
        layer_params.append(layer["param_bytes"] / 4 - experts + local)
    states = PARAMS * STATE_BYTES_PER_PARAM / GPUS
    gather = 2 * 2 * max(layer_params)  # this layer's and the prefetched next one's bf16 weights
    grads = 4 * max(layer_params)  # one layer's unsharded fp32 gradients before reduce-scatter
    x = x_probe * ACTIVATION_BYTES * r
    held = [x + graphs[b].fixed_bytes for b in range(len(kinds))]
    loss = TOKENS * VOCAB * 4 / LOSS_CHUNKS
    windows = [Window("before blocks", states + gather + x, [])]
    for b, k in enumerate(kinds):
        below = sum(held[:b])
        windows.append(Window(f"forward of block {b}", states + gather + below + fwd_work[k], list(range(b + 1))))
        windows.append(Window(f"after forward of block {b}", states + gather + below + held[b], list(range(b + 1))))
    windows.append(Window("loss", states + sum(held) + loss, list(range(len(kinds)))))
    for b in reversed(range(len(kinds))):
        k = kinds[b]
        windows.append(Window(f"backward of block {b}", states + gather + grads + sum(held[:b]) + bwd_work[k],
                              list(range(b)), b))
    model = {"states_bytes": states, "gathered_bytes": gather, "gradient_bytes": grads, "loss_bytes": loss,
             "block_input_bytes": x, "forward_work_bytes": fwd_work, "backward_work_bytes": bwd_work,
             "layer_params": layer_params}
    return StepMemory(windows), model


def torch_checkpoint_point(g: BlockGraph, save: set[str] | None) -> Point:
    """A block under torch's checkpoint with an op save list (None: full AC): the outputs of
    saved ops are kept, every other op reruns in backward (``mm``/``linear`` count as saved
    every other call, as torchtitan's policy does)."""
    saved_ops: set[int] = set()
    if save is not None:
        count = 0
        for o, name in enumerate(g.op_names):
            kind = _op_kind(name)
            if kind in EVERY_OTHER:
                count += 1
                if kind in save and count % 2 == 1:
                    saved_ops.add(o)
            elif kind in save:
                saved_ops.add(o)
    kept = tuple(v for v in range(g.num_values) if g.value_op[v] in saved_ops)
    time_s = sum(t for o, t in enumerate(g.op_time_s) if o not in saved_ops)
    return Point(kept, g.kept_bytes(kept), time_s, g.transient_bytes(kept))


def uniform_choice(memory: StepMemory, frontiers: dict[int, list[Point]], deltas, limit: float,
                   n: int) -> dict[int, int] | None:
    """Every block the same kept-bytes budget (its frontier's last point within it) among its
    first ``n`` (TapeSAC's) points: the largest budget whose choice fits ``limit``."""
    budgets = sorted({p.memory for pts in frontiers.values() for p in pts[:n]})
    best = None
    lo, hi = 0, len(budgets) - 1
    while lo <= hi:
        mid = (lo + hi) // 2
        choice = {b: max(i for i, p in enumerate(pts[:n]) if p.memory <= budgets[mid] or i == 0)
                  for b, pts in frontiers.items()}
        if predicted_peak(memory, choice, frontiers, deltas) <= limit:
            best, lo = choice, mid + 1
        else:
            hi = mid - 1
    return best


def same_recompute(memory: StepMemory, frontiers: dict[int, list[Point]], deltas, recompute_s: float,
                   lo: float, hi: float) -> dict | None:
    """TapeSAC's smallest predicted peak (bisected to 0.1% of the frontier's span) whose plan
    recomputes no more than ``recompute_s``; None if even its largest useful peak recomputes more."""
    def plan(limit: float):
        return allocate(memory, frontiers, limit, PlanConfig.solver_time_limit_s, deltas)

    best = plan(hi)
    if best.recompute_s > recompute_s:
        return None
    a, b = lo, hi
    while b - a > 1e-3 * (hi - lo):
        mid = (a + b) / 2
        p = plan(mid)
        if p.recompute_s <= recompute_s:
            best, b = p, mid
        else:
            a = mid
    return {"peak_bytes": best.predicted_peak_bytes, "recompute_s": best.recompute_s}


def ablation_row(memory: StepMemory, frontiers: dict[int, list[Point]], deltas, limit: float, long_s: float) -> dict:
    """One limit of claim 6: the allocation by the default planner (greedy start, MILP polish
    within ``solver_time_limit_s``), by greedy alone, and by the MILP given ``long_s``."""
    row: dict = {"limit_bytes": limit}
    for name, seconds in (("default", PlanConfig.solver_time_limit_s), ("greedy", 0.0), ("long MILP", long_s)):
        t0 = time.perf_counter()
        a = allocate(memory, frontiers, limit, seconds, deltas)
        row[name] = {"recompute_s": a.recompute_s, "peak_bytes": a.predicted_peak_bytes, "status": a.status,
                     "solve_s": time.perf_counter() - t0}
    return row


def experiment(data: dict, probe_tokens: int, quick: bool, log) -> dict:
    r = TOKENS / probe_tokens
    kinds = [1 if (b + 1) % FULL_ATTENTION_INTERVAL == 0 else 0 for b in range(BLOCKS)]
    scaled = {}
    infos = {}
    for k, name in ((0, "gated DeltaNet + MoE"), (1, "full attention + MoE")):
        scaled[k], infos[name] = scale_graph(data["blocks"][str(k)], probe_tokens, r)
    graphs = {b: scaled[k] for b, k in enumerate(kinds)}
    memory, model = step_memory(data, graphs, kinds, r, probe_tokens)
    limit = LIMIT_FRACTION * DEVICE_BYTES

    # The planner as planned mode runs it, timed.
    t0 = time.perf_counter()
    fronts = {k: frontier(g, max_points=PlanConfig.points_per_block) for k, g in scaled.items()}
    block_frontiers_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    plan = make_plan(graphs, memory, limit, points_per_block=PlanConfig.points_per_block,
                     frontier_points=PlanConfig.frontier_points, solver_time_limit_s=PlanConfig.solver_time_limit_s,
                     margin=PlanConfig.safety_margin)
    plan_s = time.perf_counter() - t0
    log(f"claim 5: planned {BLOCKS} blocks in {plan_s:.2f} s ({plan.allocation.status}); "
        f"predicted peak {plan.allocation.predicted_peak_bytes / GIB:.1f} GiB, limit {limit / GIB:.1f} GiB")

    # Every policy as points of one frontier per block, so one peak formula costs them all.
    n = {k: len(f) for k, f in fronts.items()}
    extra = {k: [torch_checkpoint_point(g, None), torch_checkpoint_point(g, SAVE_03),
                 torch_checkpoint_point(g, SAVE_02), evaluate(g, ())] for k, g in scaled.items()}
    frontiers = {b: fronts[k] + extra[k] for b, k in enumerate(kinds)}
    deltas = formula_deltas(memory, frontiers)
    only = {b: fronts[k] for b, k in enumerate(kinds)}  # TapeSAC's points alone
    only_deltas = formula_deltas(memory, only)
    lo, hi = smallest_peak(memory, only, only_deltas), largest_useful_peak(memory, only, only_deltas)
    t0 = time.perf_counter()
    sweep = global_frontier(memory, only, points=PlanConfig.frontier_points, deltas=only_deltas)
    sweep_s = time.perf_counter() - t0

    def at(choice: dict[int, int]) -> dict:
        return {"peak_bytes": predicted_peak(memory, choice, frontiers, deltas),
                "recompute_s": sum(frontiers[b][i].time for b, i in choice.items())}

    policies = {
        "full AC": at({b: n[k] for b, k in enumerate(kinds)}),
        "selective (0.3 list)": at({b: n[k] + 1 for b, k in enumerate(kinds)}),
        "selective (0.2.x list)": at({b: n[k] + 2 for b, k in enumerate(kinds)}),
        "TapeSAC replay-only": at({b: n[k] + 3 for b, k in enumerate(kinds)}),
    }
    u = uniform_choice(memory, frontiers, deltas, limit, min(n.values()))
    policies["uniform per-block budget"] = at(u) if u is not None else None
    for name, p in policies.items():
        if p is None:
            continue
        p["fits_limit"] = p["peak_bytes"] <= limit
        try:
            a = allocate(memory, only, p["peak_bytes"], PlanConfig.solver_time_limit_s, only_deltas)
            p["tapesac_at_same_peak"] = {"recompute_s": a.recompute_s, "peak_bytes": a.predicted_peak_bytes,
                                         "status": a.status}
        except Exception as e:  # noqa: BLE001 - below TapeSAC's floor
            p["tapesac_at_same_peak"] = {"error": str(e)}
        p["tapesac_at_same_recompute"] = same_recompute(memory, only, only_deltas, p["recompute_s"], lo, hi)
        log(f"claim 5: {name}: peak {p['peak_bytes'] / GIB:.1f} GiB, recompute {p['recompute_s']:.2f} s; TapeSAC at "
            f"that peak " + (f"{p['tapesac_at_same_peak']['recompute_s']:.2f} s"
                             if "recompute_s" in p["tapesac_at_same_peak"] else "infeasible"))

    # Claim 6 at this shape: default, greedy and a long MILP at three limits.
    ablation = []
    long_s = 10.0 if quick else 120.0
    for frac in (0.25, 0.5, 0.75):
        row = ablation_row(memory, only, only_deltas, lo + frac * (hi - lo), long_s)
        row["limit_fraction"] = frac
        ablation.append(row)
        log(f"claim 5/6: limit at {frac:.0%}: " + ", ".join(
            f"{k} {row[k]['recompute_s']:.3f} s ({row[k]['status']}, {row[k]['solve_s']:.2f} s)"
            for k in ("default", "greedy", "long MILP")))

    return {
        "blocks": BLOCKS, "pattern": "".join("A" if k else "D" for k in kinds), "tokens": TOKENS,
        "probe_tokens": probe_tokens, "scale": r, "gpus": GPUS, "ep": EP, "device_bytes": DEVICE_BYTES,
        "limit_bytes": limit, "kinds": infos, "memory_model": model,
        "block_frontier_points": {str(k): len(f) for k, f in fronts.items()},
        "planner": {"block_frontiers_s": block_frontiers_s, "one_plan_s": plan_s, "status": plan.allocation.status,
                    "predicted_peak_bytes": plan.allocation.predicted_peak_bytes,
                    "recompute_s": plan.allocation.recompute_s, "step_frontier_s": sweep_s,
                    "smallest_peak_bytes": lo, "largest_useful_peak_bytes": hi},
        "frontier": [{"peak_bytes": a.predicted_peak_bytes, "recompute_s": a.recompute_s} for a in sweep],
        "policies": policies, "ablation": ablation, "long_s": long_s,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="probe the debug model's widths (a smoke run)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--graphs", default=None,
                    help="plan from this probe file (written by --save-graphs) instead of probing")
    ap.add_argument("--save-graphs", default=None, help="write the probe's graphs, shapes and windows here")
    a = ap.parse_args()
    if a.graphs and not Path(a.graphs).is_file():
        ap.error(f"--graphs: no probe file at {a.graphs} (write one with --save-graphs)")
    start = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - start:6.0f} s] {msg}", flush=True)

    from torchtitan03_ext.config_registry import PROBE_TOKENS

    config = "qwen35_debug_layers_cpu" if a.quick else "qwen35_397b_layers_cpu"
    with tempfile.TemporaryDirectory(prefix="paper_shape_") as d:
        data = json.loads(Path(a.graphs).read_text()) if a.graphs else probe(config, Path(d), log)
    if a.save_graphs:
        Path(a.save_graphs).write_text(json.dumps(data))
    result = experiment(data, PROBE_TOKENS, a.quick, log)
    result["probe"] = {"config": config, "wall_s": data.get("wall_s"), "layers": data["layers"]}
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
