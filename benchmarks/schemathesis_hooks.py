"""Schemathesis hooks for benchmarks/schemathesis.sh: sampling numbers at the edges of float arithmetic.

Generated from the schema alone, a float in (0, 1] is rarely 5e-324 or 1e-300; those are the values that
broke the sampler (0 in float32, then a division by it). This hook redraws every sampling float a body
already holds, while it is in its valid range, from a mix of the range's bounds, subnormals, the smallest
normals of float32 and float64, and any float in range; and adds top_p and repetition_penalty to some
bodies. A value outside its range (a negative case) is left as it was generated, so such a case stays
negative.
"""

from __future__ import annotations

import schemathesis
from hypothesis import strategies as st

# name: (low, high, low excluded), the ranges server/protocol.py accepts
RANGES = {"temperature": (0.0, 2.0, False), "top_p": (0.0, 1.0, True), "min_p": (0.0, 1.0, False),
          "presence_penalty": (-2.0, 2.0, False), "frequency_penalty": (-2.0, 2.0, False),
          "repetition_penalty": (0.0, 2.0, True)}
EDGES = (5e-324, 2.2250738585072014e-308, 1e-300, 1.401298464324817e-45, 1.1754943508222875e-38, 1e-30, 1e-5,
         0.9999999999999999, 1.0000000000000002, -5e-324, -1e-300, 1.9999999999999998)
ADDED = ("top_p", "repetition_penalty")


def extreme_floats(low: float, high: float, low_excluded: bool) -> st.SearchStrategy[float]:
    edges = [x for x in (low, high, *EDGES) if low <= x <= high and not (low_excluded and x == low)]
    return st.one_of(st.sampled_from(edges), st.floats(low, high, exclude_min=low_excluded, allow_subnormal=True))


def in_range(value, low: float, high: float, low_excluded: bool) -> bool:
    return (isinstance(value, float) and (low < value if low_excluded else low <= value) and value <= high)


@schemathesis.hook
def flatmap_body(context, body):
    if not isinstance(body, dict) or not ("prompt" in body or "messages" in body):
        return st.just(body)
    fields = {name: extreme_floats(*RANGES[name]) for name, value in body.items()
              if name in RANGES and in_range(value, *RANGES[name])}
    added = {name: st.one_of(st.none(), extreme_floats(*RANGES[name])) for name in ADDED if name not in body}

    def merged(draws: tuple[dict, dict]) -> dict:
        redrawn, extra = draws
        return {**body, **redrawn, **{k: v for k, v in extra.items() if v is not None}}

    return st.tuples(st.fixed_dictionaries(fields), st.fixed_dictionaries(added)).map(merged)
