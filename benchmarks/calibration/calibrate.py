"""Today's estimate against the H200's measured launches of old commits.

The launches of 4d86e1d and 3c21b2b (benchmarks/results/LOG.md), from the
calibration drivers' JSON lines: writes benchmarks/results/calibration.json.

    PYTHONPATH=python python benchmarks/calibration/calibrate.py \
        4d86e1d.jsonl 3c21b2b.jsonl > benchmarks/results/calibration.json

The constants are estimate.py's as they are (COST_MODELS["H200"]), not
fitted; registers unknown (0: the register limit lifted).
"""

import json
import sys

from mla_kpool.gpu_profile.estimate import COST_MODELS, estimate_us

# (commit, launch, workload) -> (measured us, what was measured). Nsight
# ranges: their midpoint; the writers: bench minus the no-op floor.
MEASURED = {
    ("4d86e1d", "plan", "glm5-next-decode"): (
        50.25,
        "Nsight 49.9-50.6 (simt call; wgmma call 51.1-51.5)",
    ),
    ("4d86e1d", "score-simt", "glm5-next-decode"): (59.6, "Nsight 59.5-59.7"),
    ("4d86e1d", "score-wgmma", "glm5-next-decode"): (18.75, "Nsight 18.6-18.9"),
    ("4d86e1d", "select", "glm5-next-decode"): (
        97.65,
        "Nsight 97.4-97.9 (simt call; wgmma call 97.0-97.2)",
    ),
    ("4d86e1d", "plan", "glm5-next-prefill"): (
        7.15,
        "Nsight 6.9-7.4 (simt call; wgmma call 7.0-7.2)",
    ),
    ("4d86e1d", "score-simt", "glm5-next-prefill"): (985.5, "Nsight 984-987"),
    ("4d86e1d", "score-wgmma", "glm5-next-prefill"): (223.0, "Nsight 223"),
    ("4d86e1d", "select", "glm5-next-prefill"): (
        1230.0,
        "Nsight 1,229-1,231 (simt call; wgmma call 1,228-1,230)",
    ),
    ("3c21b2b", "step", "step-b4096"): (
        583 - 90.4,
        "bench 583 minus no-op floor 90.4 (scan + rows launches)",
    ),
    ("3c21b2b", "expand_topk", "expand_topk-b64"): (
        102 - 30.5,
        "bench 102 minus floor 30.5",
    ),
    ("3c21b2b", "expand_topk", "expand_topk-b4096"): (
        198 - 31.5,
        "bench 198 minus floor 31.5",
    ),
}


def _key(line):
    launch = line["launch"]
    if launch == "score":
        launch = f"score-{line['scorer']}"
    if launch in ("scan", "rows"):
        launch = "step"
    return (line["commit"], launch, line["workload"])


def main(paths):
    """Prints the calibration JSON of the drivers' lines in ``paths``."""
    model = COST_MODELS["H200"]
    rows = {}
    for path in paths:
        for text in open(path):
            if not text.startswith("{"):
                continue
            line = json.loads(text)
            key = _key(line)
            est = estimate_us(line["profile"], model)
            entry = rows.setdefault(
                key,
                {
                    "commit": key[0],
                    "launch": key[1],
                    "workload": key[2],
                    "kernels": [],
                    "estimate_us": 0.0,
                    "parts_us": {
                        "floor": 0.0,
                        "dram": 0.0,
                        "l2": 0.0,
                        "shared": 0.0,
                        "latency": 0.0,
                    },
                },
            )
            p = line["profile"]
            entry["kernels"].append(
                {
                    "kernel": p["kernel"],
                    "grid": p["grid"],
                    "blocks_emulated": p["blocks"],
                    "estimate_us": round(est["us"], 3),
                    "waves": est["waves"],
                    "phases": p["phases"],
                    "phase_global_max": max(p["phase_global"]),
                    "dram_bytes": round(
                        (
                            p["global"]["bytes_read"]
                            + p["global"]["bytes_written"]
                        )
                        * p["grid"]
                        / max(p["blocks"], 1)
                    ),
                }
            )
            entry["estimate_us"] += est["us"]
            parts = entry["parts_us"]
            parts["floor"] += model.floor_us
            for part in ("dram", "l2", "shared", "latency"):
                parts[part] += est[part]
    out = []
    for key, (measured, how) in MEASURED.items():
        if key not in rows:
            continue
        e = rows[key]
        e["measured_us"] = round(measured, 2)
        e["measured"] = how
        e["estimate_us"] = round(e["estimate_us"], 3)
        e["parts_us"] = {k: round(v, 3) for k, v in e["parts_us"].items()}
        e["ratio"] = round(e["estimate_us"] / measured, 4)
        e["within_2x"] = 0.5 <= e["ratio"] <= 2.0
        out.append(
            {
                k: e[k]
                for k in (
                    "commit",
                    "launch",
                    "workload",
                    "measured_us",
                    "estimate_us",
                    "parts_us",
                    "ratio",
                    "within_2x",
                    "measured",
                    "kernels",
                )
            }
        )
    json.dump(
        {
            "model": (
                "COST_MODELS['H200'] of python/mla_kpool/gpu_profile/"
                "estimate.py, unchanged; registers 0"
            ),
            "ratio": "estimate_us / measured_us",
            "launches": out,
        },
        sys.stdout,
        indent=1,
    )
    print()


if __name__ == "__main__":
    main(sys.argv[1:])
