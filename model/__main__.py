"""python -m model: explore the protocol's model (docs/model.md).

    python -m model                                   # every state of the default bounds
    python -m model --crashes 1 --variant commit_without_fence
    python -m model --messages 5 --crashes 4 --walks 2000 --length 60 --seed 7

Exit status 0 when every invariant held, 1 with the shortest trace printed
when one failed.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

from model.explore import explore, random_walks
from model.options import Bounds, Variant
from model.protocol import Model


def main(argv: list[str] | None = None) -> int:
    defaults = Bounds()
    parser = argparse.ArgumentParser(prog="python -m model", description=__doc__.split("\n")[0])
    parser.add_argument("--instances", default=",".join(defaults.instances))
    parser.add_argument("--messages", type=int, default=defaults.messages)
    parser.add_argument("--crashes", type=int, default=defaults.crashes)
    parser.add_argument("--lost", type=int, default=defaults.lost)
    parser.add_argument("--handoffs", type=int, default=defaults.handoffs)
    parser.add_argument("--steps", type=int, default=defaults.steps)
    parser.add_argument("--drain", action="store_true")
    variants = [f.name for f in dataclasses.fields(Variant)]
    parser.add_argument("--variant", action="append", default=[], choices=variants)
    parser.add_argument("--strict-step-once", action="store_true")
    parser.add_argument("--max-states", type=int, default=None)
    parser.add_argument("--walks", type=int, default=0, help="random walks instead of every state")
    parser.add_argument("--length", type=int, default=60)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    bounds = Bounds(
        instances=tuple(args.instances.split(",")),
        messages=args.messages,
        crashes=args.crashes,
        lost=args.lost,
        handoffs=args.handoffs,
        steps=args.steps,
        drain=args.drain,
    )
    variant = Variant(**{name: True for name in args.variant})
    model = Model(bounds, variant, strict_step_once=args.strict_step_once)
    print(f"bounds: {bounds}\nvariant: {variant.name()}")
    cpu = time.process_time()
    if args.walks:
        walked = random_walks(model, walks=args.walks, length=args.length, seed=args.seed)
        print(walked.summary(), f"(cpu {time.process_time() - cpu:.1f} s)")
        violation = walked.violation
    else:
        explored = explore(model, max_states=args.max_states)
        print(explored.summary(), f"(cpu {time.process_time() - cpu:.1f} s)")
        violation = explored.violation
    if violation is not None:
        print(violation)
        return 1
    print("every invariant held")
    return 0


if __name__ == "__main__":
    sys.exit(main())
