"""Before and after, in one run: `make bench-compare REV=...` (or `PYTHONPATH=. python bench/compare.py --against REV`).

The daemons of two trees, REV's (exported from git into a temporary directory, its Vulkan layer built there) and
this checkout's, measured by bench/run.py's own steps, in interleaved rounds: each step runs for one tree, then at
once for the other, the order turned every round, so that the machine's mood moves both alike. The table gives
each figure's median for each tree, after/before, and whether it grew beyond noise. See bench/README.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from rich.console import Console, RenderableType
from rich.text import Text

from bench.figures import Figure
from bench.run import ROOT, bench_plugin_basics, bench_size, dra_run, number
from bench.trees import HERE, Tree
from gpuppetti.base.tables import Column, Prose, print_table

# A figure grew only where every round of the after tree is above every round of the before tree, and their medians
# differ by more than this: two shared cores move a figure by a few percent from one round to the next.
NOISE_FLOOR = 0.05
# Two trees that do not differ put every round of one above every round of the other for one figure in C(2n, n):
# one in 252 with 5 rounds, against one in 20 with 3, which a dozen figures would hit at random.
ROUNDS = 5
PLUGIN_UNITS = 1000
DRA_DEVICES, DRA_CLAIMS = 10000, 1000
# Does every module of the tree import, with this virtualenv's dependencies? (__main__ would run the command.)
IMPORTS_ALL = ("import importlib, pkgutil, gpuppetti\n"
               "for module in pkgutil.walk_packages(gpuppetti.__path__, 'gpuppetti.'):\n"
               "    if not module.name.endswith('__main__'):\n"
               "        importlib.import_module(module.name)\n")


class Refused(Exception):
    """What cannot be compared, in one line."""


Step = Callable[[Path, Tree, argparse.Namespace], Awaitable[list[Figure]]]


async def _plugin_basics(workdir: Path, tree: Tree, args: argparse.Namespace) -> list[Figure]:
    figures: list[Figure] = []
    await bench_plugin_basics(workdir, args.idle_seconds, figures, tree)
    return figures


async def _plugin_units(workdir: Path, tree: Tree, args: argparse.Namespace) -> list[Figure]:
    figures: list[Figure] = []
    await bench_size(workdir, PLUGIN_UNITS, args.calls, figures, tree)
    return figures


async def _dra(workdir: Path, tree: Tree, args: argparse.Namespace) -> list[Figure]:
    run = await dra_run(workdir / "dra", DRA_DEVICES, tree=tree)
    if run.errors:
        raise RuntimeError(f"{tree.name}'s DRA driver failed {len(run.errors)} claims: {run.errors[0]}")
    return [Figure(f"DRA driver CPU to publish {DRA_DEVICES:,} devices", run.cpu_published, "s"),
            Figure(f"DRA NodePrepareResources, {DRA_CLAIMS:,} claims in one call", run.prepare_ms, "ms"),
            Figure(f"DRA driver resident memory, {DRA_DEVICES:,} devices and {DRA_CLAIMS:,} prepared claims",
                   run.rss_prepared / 2**20, "MiB")]


# bench/run.py's steps that take the figures issue 39 asked to hold: the device plugin's basics (start, idle CPU,
# memory, kubelet restarts, an enforced Allocate), its size step at 1,000 units, and the DRA driver at 10,000
# devices. --only picks among them by a word of the label, as bench/run.py's does.
STEPS: dict[str, Step] = {"plugin basics": _plugin_basics, f"plugin {PLUGIN_UNITS:,} units": _plugin_units,
                          f"DRA {DRA_DEVICES:,} devices": _dra}


def _git(*args: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, check=False)


def export(revision: str, into: Path) -> Tree:
    """``revision``'s package and layer sources, exported into ``into``: its layer built (where this machine builds
    one) and its modules compiled, as `make bench` has this checkout's. Raises Refused."""
    found = _git("rev-parse", "--verify", "--quiet", f"{revision}^{{commit}}")
    if found.returncode != 0:
        raise Refused(f"--against {revision}: no such commit in {ROOT}")
    commit = found.stdout.decode().strip()
    archive = _git("archive", commit, "src", "native/vulkan-layer")
    if archive.returncode != 0:
        raise Refused(f"--against {revision}: git archive failed: {archive.stderr.decode().strip()}")
    into.mkdir(parents=True)
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    src = into / "src"
    tree = Tree(f"{revision} ({commit[:9]})", src)
    # As the Makefile's native target does: without a compiler or the Vulkan headers the plugin runs unenforced,
    # which this checkout's does too on such a machine.
    built = subprocess.run(["make", "-s", "-C", str(into / "native" / "vulkan-layer"),
                            f"OUT={src / 'gpuppetti' / '_native'}"], capture_output=True, check=False)
    if built.returncode != 0:
        print(f"bench-compare: {revision}'s Vulkan layer was not built, so its plugin does not enforce slices: "
              f"{built.stderr.decode().strip().splitlines()[-1:]}", file=sys.stderr)
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(src)], check=True, stdout=subprocess.DEVNULL)
    imported = subprocess.run([sys.executable, "-c", IMPORTS_ALL], env=tree.env(), capture_output=True, check=False)
    if imported.returncode != 0:
        said = imported.stderr.decode().strip().splitlines()
        raise Refused(f"--against {revision}: its modules do not import with this virtualenv's dependencies: "
                      f"{said[-1] if said else 'exit status ' + str(imported.returncode)}")
    return tree


@dataclass
class Compared:
    name: str
    unit: str
    before: list[float]
    after: list[float]

    @property
    def ratio(self) -> float | None:
        before = statistics.median(self.before)
        return statistics.median(self.after) / before if before else None

    def beyond_noise(self, later: list[float], earlier: list[float]) -> bool:
        return min(later) > max(earlier) and statistics.median(later) > statistics.median(earlier) * (1 + NOISE_FLOOR)

    @property
    def grew(self) -> bool:
        return self.beyond_noise(self.after, self.before)

    @property
    def shrank(self) -> bool:
        return self.beyond_noise(self.before, self.after)


@dataclass
class Outcome:
    compared: list[Compared]
    # Steps that failed once and were run again, each with its first line of why.
    retried: list[str]


async def _step_once_or_twice(step: Step, directory: Path, tree: Tree, args: argparse.Namespace,
                              retried: list[str], where: str) -> list[Figure]:
    """The step's figures; a step that fails (a daemon the stand-ins did not see register in time, on a busy
    machine) runs once more, in a fresh directory, and is named in the output."""
    try:
        return await step(directory / "1", tree, args)
    except (RuntimeError, TimeoutError) as exc:
        why = (str(exc) or type(exc).__name__).splitlines()[0]
        retried.append(f"{where}: {why}")
        print(f"bench-compare: {where} failed ({why}); running it again", file=sys.stderr, flush=True)
        return await step(directory / "2", tree, args)


async def compare(before: Tree, after: Tree, steps: dict[str, Step], args: argparse.Namespace,
                  workdir: Path) -> Outcome:
    samples: dict[str, dict[str, list[float]]] = {}
    units: dict[str, str] = {}
    retried: list[str] = []
    order = [("before", before), ("after", after)]
    for round_ in range(args.rounds):
        for index, (label, step) in enumerate(steps.items()):
            # Interleaved, the order turned every round: neither tree always runs first, on a warmer machine.
            for side, tree in order if round_ % 2 == 0 else order[::-1]:
                where = f"round {round_ + 1} of {args.rounds}, {label}, {side} ({tree.name})"
                print(f"bench-compare: {where}...", file=sys.stderr, flush=True)
                directory = workdir / f"{side}-{round_}-{index}"
                for attempt in ("1", "2"):
                    (directory / attempt).mkdir(parents=True)
                for figure in await _step_once_or_twice(step, directory, tree, args, retried, where):
                    if figure.value is not None:
                        samples.setdefault(figure.name, {"before": [], "after": []})[side].append(figure.value)
                        units[figure.name] = figure.unit
    return Outcome([Compared(name, units[name], sides["before"], sides["after"]) for name, sides in samples.items()
                    if sides["before"] and sides["after"]], retried)


def render(outcome: Outcome, before: Tree, after: Tree, rounds: int, console: Console) -> None:
    """One row a figure, its unit with its name so that the values stay narrow: the medians of the rounds, their
    ratio, whether it grew beyond noise (NOISE_FLOOR's rule), and each round's value, which goes first where the
    console is narrow."""
    rows: list[list[RenderableType]] = []
    for figure in outcome.compared:
        ratio = figure.ratio
        grew = (Text("yes", style="red") if figure.grew else
                Text("no, shrank", style="green") if figure.shrank else Text("no"))
        each = "; ".join(f"{side} {', '.join(number(v) for v in values)}"
                         for side, values in (("before", figure.before), ("after", figure.after)))
        rows.append([Prose(f"{figure.name} ({figure.unit})"), number(statistics.median(figure.before)),
                     number(statistics.median(figure.after)), "-" if ratio is None else f"{ratio:.2f}x", grew,
                     Prose(each)])
    columns = [Column("figure"), Column("before", justify="right"), Column("after", justify="right"),
               Column("after/before", justify="right"), Column("grew"), Column("each round", 1)]
    print_table(console, f"before: {before.name}; after: {after.name}; medians of {rounds} interleaved rounds; "
                "grew: beyond noise", columns, rows)
    for line in outcome.retried:
        console.print(Text(f"run again after it failed once: {line}", style="yellow"))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--against", required=True, metavar="REV",
                        help="the revision whose daemons are the 'before' (this checkout's are the 'after')")
    parser.add_argument("--rounds", type=_positive, default=ROUNDS,
                        help=f"rounds of every step for each tree, interleaved (default {ROUNDS})")
    parser.add_argument("--json", type=Path, metavar="FILE", help="also write the figures as JSON")
    parser.add_argument("--idle-seconds", type=float, default=20.0, help="how long to measure idle CPU (default 20)")
    parser.add_argument("--calls", type=int, default=2000, help="Allocate calls at 1,000 units (default 2000)")
    parser.add_argument("--only", nargs="*", default=[], metavar="WORD",
                        help="run only the steps whose label has one of these words (plugin, units, DRA)")
    return parser


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of at least 1")
    return int(text)


def _this_checkout() -> Tree:
    head = _git("rev-parse", "--short=9", "HEAD").stdout.decode().strip()
    changed = _git("status", "--porcelain", "--untracked-files=no", "--", "src").stdout.strip()
    return Tree(f"this checkout, {head}{' with changes to src/' if changed else ''}", HERE.src)


def main() -> int:
    parser = build_parser()
    args = parser.parse_args()
    steps = {label: step for label, step in STEPS.items()
             if not args.only or any(word in label for word in args.only)}
    if not steps:
        parser.error(f"--only {' '.join(args.only)}: no step's label has these words (the steps: "
                     f"{', '.join(STEPS)})")
    logging.basicConfig(level=logging.ERROR)
    workdir = Path(tempfile.mkdtemp(prefix="gp-compare-", dir="/tmp"))
    try:
        before = export(args.against, workdir / "before-tree")
        after = _this_checkout()
        outcome = asyncio.run(compare(before, after, steps, args, workdir))
    except Refused as exc:
        print(f"bench-compare: {exc}", file=sys.stderr)
        return 2
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    render(outcome, before, after, args.rounds, Console())
    if args.json:
        args.json.write_text(json.dumps({"before": before.name, "after": after.name, "rounds": args.rounds,
                                         "figures": [{**asdict(c), "ratio": c.ratio, "grew": c.grew,
                                                      "shrank": c.shrank} for c in outcome.compared],
                                         "retried": outcome.retried}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
