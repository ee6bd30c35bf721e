"""Preparing a 50,000-record alpaca file (tokenise, pack) for training: mf-ds' HFDataLoader against MindFormers' own.

    python bench/hf_data_prep.py [--records 50000] [--mindformers-python /root/.venvs/mindspore/bin/python]
    # writes bench/results/hf_data_prep.json

Both read the same JSON-lines file with `datasets.load_dataset("json")` and the same tokenizer (a byte-level BPE of
8,000 tokens trained on the file, saved with PreTrainedTokenizerFast), then run AlpacaInstructDataHandler (padding
off) and PackingHandler (pack, seq_length 4096), as the 1.8-2.1 finetune YAMLs configure them:
  mf-ds        mf_ds/data/hfloader.py HFSamples (load, handlers as batched `datasets` maps, the length and vocab
               check), in the project's environment
  MindFormers  1.7.0's HFDataLoader(...) as shipped (load, its handlers, the GeneratorDataset wrap), in the MindSpore
               environment; num_parallel_workers 1
Each runs twice in a fresh process, with a fresh datasets cache the first time and the same cache the second (the
second run reads what the first cached). One process each, single-threaded tokenizers (the machine is shared);
`datasets`' progress bars show the map and packing progress on stderr. Reported: records per second (input
records / wall seconds), and the packed samples of seq_length made and per second.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SEQ = 4096
WORDS = ("the of and to in a is that for it as was with be by on not he this are or his from at which but have an "
         "they you were her she there been one all we their has would when if so no what up out can more about "
         "time only new some could these two may first then do any like my now over such our man me even most "
         "made after also did many before must through back years where much your way well down should because "
         "each just those people how too little state good very make world still own see men work long get here "
         "between both life being under never day same another know while last might us great old year off come "
         "since against go came right used take three").split()


def make(workdir: Path, records: int) -> None:
    """The alpaca file and its tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(0)
    say = lambda lo, hi: " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))  # noqa: E731
    with open(workdir / "alpaca.jsonl", "w") as f:
        for i in range(records):
            f.write(json.dumps({"instruction": say(5, 30) + "?", "input": say(0, 40) if i % 3 else "",
                                "output": say(20, 300) + "."}) + "\n")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=8000, special_tokens=["<unk>", "<pad>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    with open(workdir / "alpaca.jsonl") as f:
        tok.train_from_iterator((line for _, line in zip(range(5000), f, strict=False)), trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>",
                            eos_token="</s>").save_pretrained(str(workdir / "tokenizer"))
    config = workdir / "tokenizer" / "tokenizer_config.json"  # transformers 4 (MindFormers' venv) reads it too
    config.write_text(json.dumps({**json.loads(config.read_text()), "tokenizer_class": "PreTrainedTokenizerFast"}))


def handlers(tokenizer: dict | None) -> list[dict]:
    alpaca = {"type": "AlpacaInstructDataHandler", "seq_length": SEQ, "padding": False}
    if tokenizer is not None:
        alpaca["tokenizer"] = tokenizer
    return [alpaca, {"type": "PackingHandler", "seq_length": SEQ, "pack_strategy": "pack"}]


def run_mfds(workdir: Path) -> dict:
    sys.path.insert(0, str(ROOT))
    from mf_ds.data.hfloader import HFSamples

    hf = {"load_func": "load_dataset", "load": {"path": "json", "data_files": str(workdir / "alpaca.jsonl"),
                                                "split": "train", "cache_dir": str(workdir / "cache-mfds")},
          "handlers": handlers(None), "tokenizer_dir": str(workdir / "tokenizer"), "packed": True,
          "compressed": False, "compressed_length": 128, "mf_labels": False}
    start = time.perf_counter()
    samples = HFSamples(hf, SEQ, 8000, seed=0)
    return {"seconds": time.perf_counter() - start, "samples": len(samples)}


def run_mindformers(workdir: Path) -> dict:
    from mindformers.core.context import build_context
    from mindformers.dataset.dataloader.hf_dataloader import HFDataLoader

    build_context({"context": {"mode": 1, "device_target": "CPU"}, "parallel": {}, "use_parallel": False,
                   "use_legacy": False})
    tokenizer = {"padding_side": "right", "pretrained_model_dir": str(workdir / "tokenizer")}
    start = time.perf_counter()
    ds = HFDataLoader(path="json", data_files=str(workdir / "alpaca.jsonl"), split="train",
                      cache_dir=str(workdir / "cache-mindformers"), handler=handlers(tokenizer), shuffle=False,
                      use_broadcast_data=False, num_parallel_workers=1, python_multiprocessing=False)
    return {"seconds": time.perf_counter() - start, "samples": ds.get_dataset_size()}


def child(kind: str, workdir: Path, python: str) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RAYON_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([python, __file__, "--child", kind, "--workdir", str(workdir)], env=env, cwd=ROOT,
                          stdout=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{kind} run failed (exit {proc.returncode})")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=50_000)
    parser.add_argument("--mindformers-python", default="/root/.venvs/mindspore/bin/python")
    parser.add_argument("--child", choices=("mfds", "mindformers"))
    parser.add_argument("--workdir")
    args = parser.parse_args()
    if args.child:
        result = (run_mfds if args.child == "mfds" else run_mindformers)(Path(args.workdir))
        print(json.dumps(result))
        return
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        make(workdir, args.records)
        runs = {}
        for kind, python in (("mfds", sys.executable), ("mindformers", args.mindformers_python)):
            for attempt in ("first (fresh cache)", "second (cache read)"):
                result = child(kind, workdir, python)
                result["records_per_s"] = args.records / result["seconds"]
                result["packed_samples_per_s"] = result["samples"] / result["seconds"]
                runs.setdefault(kind, {})[attempt] = result
                print(f"{kind} {attempt}: {result['seconds']:.1f} s, {result['records_per_s']:.0f} records/s, "
                      f"{result['samples']} packed samples", flush=True)
    out = {"records": args.records, "seq_length": SEQ, "tokenizer": "byte-level BPE, 8000 tokens",
           "machine": f"{platform.machine()}, {os.cpu_count()} cores (shared), {platform.python_version()}",
           "runs": runs}
    path = ROOT / "bench" / "results" / "hf_data_prep.json"
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
