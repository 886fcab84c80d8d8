"""`python -m compile.report DIR...`: one table of the parity and speed figures in artifact manifests."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from engine.backends.manifest import read_manifest


def rows(directories: list[Path]) -> list[dict]:
    out = []
    for directory in directories:
        m = read_manifest(directory, verify_files=False)
        p, b = m.parity, m.bench
        out.append({
            "artifact": directory.name, "backend": m.backend, "precision": m.precision,
            "MiB": sum(f["bytes"] for f in m.files.values()) / 2**20,
            "max_logit_diff": p["max_abs_logit_diff"], "top1_forced": p["teacher_forced_top1_agreement"],
            "greedy_equal": f"{p['greedy_tokens_equal']}/{p['greedy_tokens_compared']}",
            "ppl": p["perplexity"], "ppl_change": p["perplexity_change"],
            **{f"{k}_tok_s": v["artifact_tokens_per_s"] for k, v in b.items()},
            **{f"{k}_eager_tok_s": v["eager_fp32_tokens_per_s"] for k, v in b.items()},
            **{f"{k}_speedup": v["speedup"] for k, v in b.items()},
        })
    return out


def format_rows(table: list[dict]) -> str:
    lines = ["| artifact | MiB | max logit diff | top-1 (forced) | greedy equal | ppl (change) | "
             "batch 1 tok/s (vs eager) | batch 32 tok/s (vs eager) |", "|---" * 8 + "|"]
    for r in table:
        speed = [f"{r.get(f'batch_{n}_tok_s', float('nan')):.1f} ({r.get(f'batch_{n}_speedup', float('nan')):.2f}x)"
                 for n in (1, 32)]
        lines.append(f"| {r['backend']} {r['precision']} | {r['MiB']:.0f} | {r['max_logit_diff']:.3g} | "
                     f"{r['top1_forced']:.1%} | {r['greedy_equal']} | {r['ppl']:.3f} ({r['ppl_change']:+.2%}) | "
                     f"{speed[0]} | {speed[1]} |")
    return "\n".join(lines)


if __name__ == "__main__":
    table = rows([Path(a) for a in sys.argv[1:]])
    print(format_rows(table))
    print(json.dumps(table, indent=1), file=sys.stderr)
