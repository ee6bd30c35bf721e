"""`mf-translate CONFIG`: the DeepSpeed JSON on stdout; the Formative log lines, notes and errors on stderr.

Exit codes: 0 translated, 2 bad input (one line naming the key path or file), 1 a bug (with its traceback).
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings

import yaml

from translators.diagnose import effective, fix_text, problem_line, strict_problems, translate_all
from translators.errors import ConfigError
from translators.loader import DuplicateKeyWarning, apply_overrides, load_yaml
from translators.plan import translate

# The fixes `--layout` applies itself: a global batch out of reach on the asked world is planned at the nearest one
BATCH_FIXES = {"--gradient_accumulation_steps", "training.global_batch_size"}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mf-translate", description="Translate a MindFormers training YAML into a "
                                "DeepSpeed config (stdout), a Hugging Face model config and an mf-ds Plan.")
    p.add_argument("config", help="MindFormers YAML file")
    p.add_argument("--hf-config", metavar="PATH", help="write the HF model config (AutoConfig.for_model kwargs)")
    p.add_argument("--plan", metavar="PATH", help="write the whole Plan (deepspeed, hf_config, layers, moe, "
                   "kernels, run, notes)")
    p.add_argument("--explain", action="store_true", help="list every YAML key and what it became (stderr)")
    p.add_argument("--world-size", type=int, metavar="N", help="DeepSpeed ranks (default: the YAML's data x model "
                   "x context parallel x pipeline stages, folded axes adding none; a world size that is no multiple "
                   "of the stages folds them); MindFormers' global batch is kept")
    p.add_argument("--set", action="append", default=[], metavar="a.b.c=VALUE",
                   help="override a YAML key (repeatable; VALUE is read as YAML)")
    p.add_argument("--layout", action="store_true", help="print the parallel layout on --world-size ranks instead "
                   "of the JSON: degrees, rank order, process groups, data shards, checks, memory per device; "
                   "pipeline stages run by default, or fold with the reason translators/pipeline_compose.py gives")
    p.add_argument("--gpu-memory", metavar="SIZE", help="with --layout: device memory (80GiB, 141GB) for a verdict "
                   "and the smallest change that fits")
    p.add_argument("--json", action="store_true", help="with --layout: the layout report as JSON")
    p.add_argument("--gradient_accumulation_steps", type=int, metavar="N",
                   help="override the gradient accumulation (as MindFormers' run script does)")
    p.add_argument("--strict", action="store_true", help="a key this translator does not know is an error, not a "
                   "warning")
    p.add_argument("--effective", action="store_true", help="print the YAML as MindFormers runs it (base_config "
                   "merged, --set applied, the model's config-class defaults filled) instead of the JSON")
    p.add_argument("--mindformers-version", metavar="X.Y.Z",
                   help="the MindFormers version the YAML comes from: its config classes' defaults fill what "
                        "model_config leaves out (default: the YAML's mindformers_version, else the newest)")
    return p


def _write(path: str, payload: object) -> None:
    try:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(payload, f, indent=2)
            f.write("\n")
    except OSError as exc:
        raise ConfigError(path, f"cannot write: {exc.strerror}") from None


def run(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if not args.layout and (args.json or args.gpu_memory is not None):
        print(f"mf-translate: error: {'--json' if args.json else '--gpu-memory'} goes with --layout", file=sys.stderr)
        return 2
    try:
        gpu_memory = None
        if args.layout:  # imported here: plain translation stays as fast to start as before
            from translators.memory import parse_size
            from translators.planner import layout_report, render

            gpu_memory = parse_size(args.gpu_memory) if args.gpu_memory is not None else None
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", DuplicateKeyWarning)
            tree = apply_overrides(load_yaml(args.config), list(args.set))
        for warning in (w for w in caught if issubclass(w.category, DuplicateKeyWarning)):
            print(f"mf-translate: warning: {args.config}: {warning.message}", file=sys.stderr)
        if args.effective:
            yaml.safe_dump(effective(tree, args.mindformers_version), sys.stdout, sort_keys=False)
            return 0
        diagnosis = translate_all(tree, translate, world_size=args.world_size,
                                  gradient_accumulation_steps=args.gradient_accumulation_steps,
                                  mindformers_version=args.mindformers_version)
        result, problems = diagnosis.result, diagnosis.problems
        planned = args.layout and result is not None and all(p.fix.keys() <= BATCH_FIXES for p in problems)
        if problems and not planned:  # every problem at once, each with its fix (translators/diagnose.py)
            for problem in problems:
                print(f"mf-translate: error: {problem_line(problem)}", file=sys.stderr)
            if result is None and problems[-1].fix:
                print("mf-translate: (more problems may follow once these are fixed)", file=sys.stderr)
            return 2
        if args.strict and strict_problems(result):
            for problem in strict_problems(result):
                print(f"mf-translate: error: {problem}", file=sys.stderr)
            return 2
        for line in result.formative:
            print(line, file=sys.stderr)
        lines = result.ledger.explain() if args.explain else [note.line() for note in result.warnings]
        for line in lines:
            print(line, file=sys.stderr)
        plan = result.plan
        if args.hf_config:
            if plan.hf_config is None:
                print(f"mf-translate: no HF config written to {args.hf_config}: see the note on 'model'",
                      file=sys.stderr)
            else:
                _write(args.hf_config, dict(plan.hf_config))
        if args.plan:
            _write(args.plan, result.json)
        if args.layout:
            # what the YAML asked for (shown beside the degrees); MindFormers resets it without use_parallel
            raw_pc = result.asked if result.asked is not None else \
                tree.get("parallel_config") if tree.get("use_parallel") is True else None
            rename = None
            if result.asked is not None:  # a PyNative-schema YAML: the suggestions in its own keys
                from translators.pynative import layout_setting

                def rename(setting: str) -> str:
                    return layout_setting(setting, len(plan.layers))
            # model_config.offset: the YAML's stages as LayerSetting places them (translators/pipeline_planner.py)
            mc = tree["model"].get("model_config") if isinstance(tree.get("model"), dict) else None
            offset = mc.get("offset", 0) if isinstance(mc, dict) else 0
            report = layout_report(plan, raw_pc if isinstance(raw_pc, dict) else {}, gpu_memory, rename, offset)
            if problems:  # the asked global batch is out of reach on this world: the nearest, said
                asked = problems[0]
                report["data"]["planned"] = (f"{asked.path}: {asked.message}; {asked.hint}; planned the nearest: "
                                             + " ".join(fix_text(p.fix) for p in problems))
    except ConfigError as exc:
        print(f"mf-translate: error: {exc}", file=sys.stderr)
        return 2
    if args.layout:
        if args.json:
            json.dump(report, sys.stdout, indent=2)
            sys.stdout.write("\n")
        else:
            print("\n".join(render(report)))
        return 0
    json.dump(result.printed_deepspeed(), sys.stdout, indent=2)  # with the nearest optimizer / scheduler blocks
    sys.stdout.write("\n")
    return 0


def main() -> None:
    sys.exit(run())


if __name__ == "__main__":
    main()
