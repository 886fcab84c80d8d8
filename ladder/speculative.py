"""`--speculative-tokens`, `--speculative-model` and `--speculative-max-batch`, shared by serve and bench
(engine/speculative.py, engine/draft_model.py)."""

from __future__ import annotations

import argparse

from engine.sampling_params import MAX_SPECULATIVE_TOKENS


def add_speculative_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--speculative-tokens", type=int, default=None, metavar="K",
                        help="speculative decoding: up to K draft tokens per step, verified in one step (0 to "
                             f"{MAX_SPECULATIVE_TOKENS}). Drafts come by prompt lookup (what followed the "
                             "sequence's last few tokens where they occurred before), or from --speculative-model. "
                             "Greedy text is unchanged; outputs that copy their input come faster. Default: 0, "
                             "only requests that ask with `speculative_tokens` speculate; 4 with a draft model")
    parser.add_argument("--speculative-model", default=None, metavar="PATH",
                        help="a smaller model of the same vocabulary (HF directory or GGUF) whose greedy tokens "
                             "are the drafts, instead of prompt lookup")
    parser.add_argument("--speculative-max-batch", type=int, default=4, metavar="N",
                        help="no request speculates while more than N sequences decode (default 4)")


def speculative_config(args: argparse.Namespace) -> dict:
    """The EngineConfig fields of the parsed arguments."""
    return {"speculative_tokens": args.speculative_tokens, "speculative_max_batch": args.speculative_max_batch,
            "speculative_model": args.speculative_model}
