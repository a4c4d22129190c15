"""Accuracy of a trained toy model without reuse, read by the checker on held-out prompts and noise seeds.

    python -m workers.toy.evaluate --steps 4,50 --guidance 3 --prompts 192 [--weights-dir DIR] [--json OUT]

Prompts come from ``world.eval_prompts`` (``EVAL_TEMPLATES``, never used in training; every attribute
combination in turn); prompt ``i`` is sampled from noise seed ``seed_base + i`` with the reference Euler sampler
(classifier-free guidance against the empty prompt) and the diffusers scheduler of the bundle.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

from workers.toy import world
from workers.toy.model import WEIGHTS_DIR, load_toy_bundle
from workers.toy.train import evaluate

DEFAULT_PROMPT_SEED = 2024
DEFAULT_SEED_BASE = 5_000_000


def run(
    weights_dir: Path = WEIGHTS_DIR,
    steps: tuple[int, ...] = (4, 50),
    guidance: float = 3.0,
    prompts: int = 192,
    prompt_seed: int = DEFAULT_PROMPT_SEED,
    seed_base: int = DEFAULT_SEED_BASE,
    threads: int = 1,
) -> dict[str, Any]:
    torch.set_num_threads(threads)
    bundle = load_toy_bundle(weights_dir=weights_dir)
    eval_set = world.eval_prompts(prompts, seed=prompt_seed)
    t0 = time.time()
    accuracy = evaluate(bundle.transformer, eval_set, steps, guidance, seed_base=seed_base)
    return {
        "weights_id": bundle.weights_id,
        "prompts": prompts,
        "prompt_seed": prompt_seed,
        "noise_seeds": [seed_base, seed_base + prompts - 1],
        "guidance": guidance,
        "accuracy": accuracy,
        "wall_s": round(time.time() - t0, 1),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--weights-dir", type=Path, default=WEIGHTS_DIR)
    parser.add_argument("--steps", default="4,50", help="comma-separated sampling step counts")
    parser.add_argument("--guidance", type=float, default=3.0)
    parser.add_argument("--prompts", type=int, default=192)
    parser.add_argument("--prompt-seed", type=int, default=DEFAULT_PROMPT_SEED)
    parser.add_argument("--seed-base", type=int, default=DEFAULT_SEED_BASE)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", type=Path, default=None, help="also write the result here")
    args = parser.parse_args(argv)
    result = run(
        weights_dir=args.weights_dir,
        steps=tuple(int(s) for s in args.steps.split(",")),
        guidance=args.guidance,
        prompts=args.prompts,
        prompt_seed=args.prompt_seed,
        seed_base=args.seed_base,
        threads=args.threads,
    )
    text = json.dumps(result, indent=2)
    print(text)
    if args.json is not None:
        args.json.write_text(text + "\n")


if __name__ == "__main__":
    main()
